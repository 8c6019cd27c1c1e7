"""Metric helpers every service uses: the /metrics endpoint, scrape-time gauges, buckets.

Each service exposes its own registry on its own port (``server.metric_port`` /
``--metric_port``), so co-located services never share one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from rings.ports import bind_error

log = logging.getLogger("diffring.metrics")

Sample = tuple[str, str, dict[str, str], float]
"""One gauge sample: (name, help, labels, value)."""

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
        self, fn: Callable[[], Iterable[Sample]]
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
