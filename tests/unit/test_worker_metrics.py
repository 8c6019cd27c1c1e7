"""The worker metric the GPU smoke reads instead of patching the services: the staging
pool's device and checksum algorithm."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tensorplane.pool import StagingPool
from workers.metrics import WorkerMetrics


def samples(metrics: WorkerMetrics, name: str) -> list[tuple[dict[str, str], float]]:
    text = generate_latest(metrics.registry).decode()
    return [(dict(s.labels), s.value) for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == name]


@pytest.mark.parametrize(("device", "algo"), [("cpu", "crc32"), ("cuda:1", "wsum64")])
def test_pool_info_names_device_and_checksum(device: str, algo: str) -> None:
    metrics = WorkerMetrics("transformer")
    metrics.watch_pool(StagingPool(1 << 20, device=device).stats)  # not started: no buffer
    assert samples(metrics, "diffring_staging_pool_info") == [
        ({"role": "transformer", "device": device, "checksum_algo": algo}, 1.0)]
    assert samples(metrics, "diffring_staging_pool_capacity_bytes") == [
        ({"role": "transformer"}, float(1 << 20))]
