"""Prometheus metrics of a worker process (the endpoint: :mod:`contracts.metrics`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from contracts.metrics import CLAIM_BUCKETS, DURATION_BUCKETS, CallbackCollector, Sample


class WorkerMetrics:
    """What a worker measures: stage durations, claims, transfers, pool occupancy."""

    def __init__(self, role: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.role = role
        self.stage_seconds = Histogram(
            "diffring_stage_seconds", "Time spent per task in each step of the worker loop",
            ["role", "step"], buckets=DURATION_BUCKETS, registry=r)
        self.claim_seconds = Histogram(
            "diffring_ring_claim_seconds", "Ring claim latency seen by this worker",
            ["ring", "op"], buckets=CLAIM_BUCKETS, registry=r)
        self.transfer_bytes = Counter(
            "diffring_transfer_bytes", "Tensor bytes moved by Mooncake", ["direction"],
            registry=r)
        self.transfer_seconds = Histogram(
            "diffring_transfer_seconds", "Time to move one task's tensors", ["direction"],
            buckets=DURATION_BUCKETS, registry=r)
        self.tasks = Counter(
            "diffring_worker_tasks", "Tasks handled by this worker, by outcome",
            ["role", "outcome"], registry=r)
        self.heartbeats = Counter(
            "diffring_worker_heartbeats", "Heartbeats sent to the controller", ["role"],
            registry=r)

    @contextlib.contextmanager
    def timed(self, role: str, step: str) -> Iterator[None]:
        """Observe the duration of the block in ``diffring_stage_seconds{role, step}``."""
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.stage_seconds.labels(role, step).observe(time.monotonic() - t0)

    def watch_pool(self, pool_stats: Callable[[], Any]) -> None:
        def read() -> Iterable[Sample]:
            st = pool_stats()
            labels = {"role": self.role}
            yield ("diffring_staging_pool_used_bytes", "Bytes allocated in the staging pool",
                   labels, float(st.used_bytes))
            yield ("diffring_staging_pool_capacity_bytes", "Capacity of the staging pool",
                   labels, float(st.capacity))
            yield ("diffring_staging_pool_blocks", "Live blocks in the staging pool", labels,
                   float(st.live_blocks))

        self.registry.register(CallbackCollector(read))
