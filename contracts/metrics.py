"""Metric helpers every service uses: the /metrics endpoint (with the health probes beside
it), scrape-time gauges, buckets.

Each service exposes its own registry on its own port (``server.metric_port`` /
``--metric_port``), so co-located services never share one. The same port answers the
orchestrator's probes (:data:`READY_PATH`, :data:`LIVE_PATH`): a JSON body, 200 or 503.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from rings.ports import bind_error

log = logging.getLogger("diffring.metrics")

Sample = tuple[str, str, dict[str, str], float]
"""One gauge sample: (name, help, labels, value)."""

DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800)
CLAIM_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.1, 1)


READY_PATH: Final = "/ready"
"""200 once the service does its job (a worker: registered with the controller), 503 before
and while draining: an orchestrator's readiness probe."""
LIVE_PATH: Final = "/live"
"""200 while the process is up and not stopping for good: an orchestrator's liveness probe."""

Probe = Callable[[], tuple[bool, Mapping[str, Any]]]
"""A probe: (healthy, JSON-able details)."""


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds
        pass


def serve_metrics(
    registry: CollectorRegistry,
    host: str,
    port: int,
    what: str,
    probes: Mapping[str, Probe] | None = None,
    sock: socket.socket | None = None,
) -> Any:
    """Start the /metrics endpoint (and ``probes``, path -> probe), or fail fast naming the
    port and what holds it. Returns the server (``shutdown()`` stops it). ``sock``: the port
    already bound and listening (:func:`rings.ports.bind_socket` at the process's start,
    before it opens ephemeral ports of its own that could take it), served as it is.

    prometheus_client's own ``start_http_server`` answers metrics on every path, so the
    probes need a dispatch of their own: a small WSGI app in front of its metrics app, on the
    same threaded stdlib server it uses.
    """
    metrics_app = make_wsgi_app(registry)
    routes = dict(probes or {})

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        probe = routes.get(environ.get("PATH_INFO", ""))
        if probe is None:
            return metrics_app(environ, start_response)
        ok, details = probe()
        body = json.dumps(dict(details), default=str).encode()
        start_response(
            "200 OK" if ok else "503 Service Unavailable",
            [("Content-Type", "application/json"), ("Content-Length", str(len(body)))],
        )
        return [body]

    class Server(ThreadingWSGIServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        def server_bind(self) -> None:
            if sock is None:
                super().server_bind()
                return
            # Adopt the socket bound at start instead of binding a new one; then set what
            # HTTPServer.server_bind and WSGIServer.setup_environ set after a bind (the
            # stdlib server takes no ready socket; listen() again in server_activate only
            # resets the backlog).
            self.socket.close()
            self.socket = sock
            self.server_address = sock.getsockname()
            self.server_name = host.strip("[]")
            self.server_port = self.server_address[1]
            self.setup_environ()

    try:
        server = make_server(host.strip("[]"), port, app, Server, handler_class=_QuietHandler)
    except OSError as exc:
        raise bind_error(f"{what} metrics endpoint", host, port, exc) from exc
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    log.info("%s metrics on http://%s:%d/metrics (probes: %s)", what, host, port,
             ", ".join(routes) or "none")
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
