"""The worker metrics the GPU smoke reads instead of patching the services: the staging
pool's device and checksum algorithm, and the memory torch allocated on each GPU."""

from __future__ import annotations

import sys
from types import SimpleNamespace

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


def fake_torch(initialized: bool) -> SimpleNamespace:
    peak, now = [0, 5 << 30], [0, 1 << 30]  # device 0 never used by this process
    cuda = SimpleNamespace(is_initialized=lambda: initialized, device_count=lambda: 2,
                           max_memory_allocated=lambda i: peak[i],
                           memory_allocated=lambda i: now[i])
    return SimpleNamespace(cuda=cuda)


def test_device_memory_of_the_devices_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", fake_torch(initialized=True))
    metrics = WorkerMetrics("decoder")
    labels = {"role": "decoder", "device": "cuda:1"}
    assert samples(metrics, "diffring_device_memory_peak_bytes") == [(labels, float(5 << 30))]
    assert samples(metrics, "diffring_device_memory_allocated_bytes") == [
        (labels, float(1 << 30))]


def test_no_device_memory_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", fake_torch(initialized=False))
    assert samples(WorkerMetrics("encoder"), "diffring_device_memory_peak_bytes") == []
    monkeypatch.delitem(sys.modules, "torch")  # a process that never imported torch
    assert samples(WorkerMetrics("encoder"), "diffring_device_memory_peak_bytes") == []
