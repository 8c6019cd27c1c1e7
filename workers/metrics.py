"""Prometheus metrics of a worker process, and the metrics endpoint every service uses.

Each service exposes its own registry on its own port (``server.metric_port`` /
``--metric_port``), so co-located services never share one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from rings.ports import bind_error

log = logging.getLogger("diffring.metrics")

DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800)
CLAIM_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.1, 1)


def serve_metrics(registry: CollectorRegistry, host: str, port: int, what: str) -> Any:
    """Start the /metrics endpoint, or fail fast naming the port and what holds it."""
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise bind_error(f"{what} metrics endpoint", host, port, exc) from exc
    log.info("%s metrics on http://%s:%d/metrics", what, host, port)
    return server


class CallbackCollector(Collector):
    """Gauges read at scrape time from a callback returning (name, help, labels, value)."""

    def __init__(
        self, fn: Callable[[], Iterable[tuple[str, str, dict[str, str], float]]]
    ) -> None:
        self.fn = fn

    def collect(self) -> Iterable[GaugeMetricFamily]:
        families: dict[str, GaugeMetricFamily] = {}
        for name, doc, labels, value in self.fn():
            fam = families.get(name)
            if fam is None:
                fam = families[name] = GaugeMetricFamily(name, doc, labels=sorted(labels))
            fam.add_metric([labels[k] for k in sorted(labels)], value)
        return list(families.values())


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

    def watch_pool(self, pool_stats: Callable[[], Any]) -> None:
        def read() -> Iterable[tuple[str, str, dict[str, str], float]]:
            st = pool_stats()
            labels = {"role": self.role}
            yield ("diffring_staging_pool_used_bytes", "Bytes allocated in the staging pool",
                   labels, float(st.used_bytes))
            yield ("diffring_staging_pool_capacity_bytes", "Capacity of the staging pool",
                   labels, float(st.capacity))
            yield ("diffring_staging_pool_blocks", "Live blocks in the staging pool", labels,
                   float(st.live_blocks))

        self.registry.register(CallbackCollector(read))
