"""Assembly of the controller process (``--service controller``): rings, control channel,
coordinator, front door, sweeper. The parts the one-process baseline (``--service all``)
shares with it (HTTP serving, metrics, the sweeper) are public here; the baseline itself is
composed in :mod:`baseline`, which alone imports both the controller and the workers."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contracts import faults
from contracts.addresses import default_advertised_host
from contracts.config import ServiceConfig
from contracts.metrics import LIVE_PATH, READY_PATH, serve_metrics
from contracts.pipelines import task_spec
from contracts.task_store import store_folder
from controller.config import CoordinatorConfig
from controller.http.frontdoor import FrontDoor
from controller.http.webapp import build_app
from controller.metrics import ControllerMetrics
from controller.ownership.coordinator import Coordinator
from controller.tasks.store import prune_interval
from controller.tasks.table import TaskTable, open_table
from controller.tasks.tasks import Task
from rings.inspect import snapshot
from rings.payload import encode_body
from rings.ports import bind_socket

log = logging.getLogger("diffring.controller")

SWEEP_INTERVAL_S = 0.5
GRACEFUL_SHUTDOWN_S = 10
"""Longest a stopping front door waits for open requests (a waiting OpenAI image request)."""


async def serve_http(
    app: Any, sock: socket.socket, stop: asyncio.Event,
    on_stop: Callable[[], None] | None = None,
) -> None:
    """Run uvicorn on an already-bound socket until ``stop`` is set; ``on_stop`` then ends
    what would keep connections open (the front door's event streams)."""
    import uvicorn

    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False,
                       timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    )
    # Signals belong to the process's own handler (which sets ``stop``), not uvicorn.
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    task = asyncio.create_task(server.serve(sockets=[sock]))
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if on_stop is not None:
        on_stop()
    server.should_exit = True
    stopper.cancel()
    await task


def open_table_for(cfg: ServiceConfig, output_dir: Path) -> TaskTable:
    """The task table of a service, journaled to the store in ``<output_dir>/.journal``
    (opened here: the one place a controller or the baseline opens its database)."""
    return open_table(store_folder(output_dir), retention_s=cfg.task_retention_s,
                      delete_results=cfg.delete_results_after_retention)


def start_metrics(
    cfg: ServiceConfig,
    co: Coordinator,
    app: Any,
    ring_status: Callable[[], dict[str, Any]],
    pool_stats: Callable[[], Any] | None,
    stopping: asyncio.Event | None = None,
    collectors: Iterable[Any] = (),
    sock: socket.socket | None = None,
) -> Any:
    """Instrument the front door's ``app``; serve /metrics (and the /ready, /live probes:
    ready until ``stopping`` is set) when a metric port is configured. ``collectors``:
    further Prometheus collectors to serve (the baseline's worker metrics: stage times
    and each stage's GPU memory); ``sock``: the metric port, bound at the process's start
    (:class:`FixedPorts`)."""
    metrics = ControllerMetrics(co)
    for collector in collectors:
        metrics.registry.register(collector)
    metrics.ring_status = ring_status
    metrics.pool_stats = pool_stats
    app.add_middleware(metrics.asgi)
    if cfg.server.metric_port is None:
        return None
    def ready() -> tuple[bool, dict[str, Any]]:
        up = stopping is None or not stopping.is_set()
        return up, {"state": "running" if up else "stopping", "pipeline": cfg.pipeline}

    return serve_metrics(metrics.registry, cfg.server.host, cfg.server.metric_port,
                         "controller", probes={READY_PATH: ready, LIVE_PATH: lambda: (True, {})},
                         sock=sock)


@dataclass
class FixedPorts:
    """The ports of configured numbers, bound and listening at the process's start: before
    it binds or connects from ephemeral ports of its own (its Mooncake engine does), whose
    picks could otherwise take one of them, and before anything slow, so that a port in use
    stops the start at once. The rings bind theirs next, in ``rings.start``."""

    http: socket.socket
    metrics: socket.socket | None
    control: socket.socket | None
    stages: dict[str, socket.socket] = dataclasses.field(default_factory=dict)
    """LightX2V's stage ports (``server.lightx2v_ports``) other than the front door's."""

    @classmethod
    def bind(cls, cfg: ServiceConfig, control: bool) -> FixedPorts:
        """The front door's and the metric port (when configured); ``control``: the
        control channel's too (the controller; the one-process baseline has none)."""
        bound: list[socket.socket] = []

        def take(host: str, port: int, what: str) -> socket.socket:
            bound.append(bind_socket(host, port, what))
            return bound[-1]

        srv, d = cfg.server, cfg.disagg_config
        try:
            return cls(
                take(srv.host, srv.port, "front door"),
                take(srv.host, srv.metric_port, "controller metrics endpoint")
                if srv.metric_port is not None else None,
                take(d.bootstrap_addr, d.control_port, "control channel") if control else None,
                {role: take(srv.host, port, f"LightX2V {role} port")
                 for role, port in (srv.lightx2v_ports or {}).items() if port != srv.port},
            )
        except BaseException:
            for sock in bound:
                sock.close()
            raise

    def close(self) -> None:
        for sock in (self.http, self.metrics, self.control, *self.stages.values()):
            if sock is not None:
                sock.close()


async def _sweeper(co: Coordinator, extra: Callable[[], None] | None = None) -> None:
    while True:
        await asyncio.sleep(SWEEP_INTERVAL_S)
        try:
            co.sweep(co.clock())
            if extra is not None:
                extra()
        except Exception:  # the sweeper must outlive any single failure
            log.exception("sweep failed")


async def retention_loop(co: Coordinator, retention_s: float) -> None:
    """Forget finished tasks past the retention window, every ``prune_interval``."""
    interval = prune_interval(retention_s)
    while True:
        try:
            now = time.time()  # the retention window is wall-clock time, like finished_at
            fut = co.table.history.prune(now)
            if fut is None:
                return
            gone = await asyncio.wrap_future(fut)
            co.table.history.pruned(gone, now)
            if gone:
                log.info("task store: forgot %s finished task(s) older than %g s",
                         ", ".join(f"{n} {s}" for s, n in gone.items()), retention_s)
        except Exception:  # retention must outlive a failed prune (retried next time)
            log.exception("task store: prune failed")
        await asyncio.sleep(interval)


def _ring_status(rings: Any) -> dict[str, Any]:
    out = {}
    for name, host in rings.hosts.items():
        snap = snapshot(host.local)
        out[name] = {k: snap[k] for k in ("depth", "published", "claimed", "slot_count")}
        out[name]["peers"] = len(host.peers)
        out[name]["repairs"] = snap["repairs"]
    return {"rings": out}


async def run_controller_async(
    cfg: ServiceConfig, token: str, env: Mapping[str, str], stop: asyncio.Event
) -> None:
    from controller.control import ControlServer
    from controller.doorbell import Doorbell
    from controller.ownership.reconcile import census
    from controller.rings_host import ControllerRings

    d = cfg.disagg_config
    output_dir = Path(cfg.output_dir).resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    ports = FixedPorts.bind(cfg, control=True)
    rings = ControllerRings(d, token)
    await rings.start()
    engine = tensor_engine(cfg, env)
    images = ImageStager.for_pipeline(cfg, engine) if engine is not None else None
    checkpoints = open_checkpoints(cfg, engine, output_dir) if engine is not None else None
    co = Coordinator(
        CoordinatorConfig.from_service(cfg, output_dir),
        open_table_for(cfg, output_dir),
        rings.local["request"],
        stage_image=images.stage if images else None,
        release_image=images.release if images else None,
        census=lambda: census(rings.local),
        checkpoints=checkpoints,
        rings=rings.local,
    )
    doorbell = Doorbell({name: ring.verbs for name, ring in rings.local.items()})
    co.on_work = doorbell.ring
    co.restore()
    control = ControlServer(co, d.bootstrap_addr, d.control_port, token, doorbell)
    metrics_server = None
    front = None
    try:
        await control.start(ports.control)
        faults.hit("controller.ports")
        front = FrontDoor(co, status_extra=lambda: {
            **_ring_status(rings), "recovery": dict(co.recovery.counts),
            "checkpoints": checkpoints.summary() if checkpoints is not None else None,
            "priorities": dict(co.priorities.counts)},
                          service="controller", server=cfg.server,
                          defaults=cfg.request_defaults, recipe=cfg.recipe)
        app = build_app(front)
        if images is not None:  # start the decoding processes before the first image
            await asyncio.get_running_loop().run_in_executor(None, front.decoder.start)
        metrics_server = start_metrics(cfg, co, app, lambda: _ring_status(rings),
                                       images.pool.stats if images else None, stop,
                                       sock=ports.metrics)

        def periodic() -> None:
            doorbell.sweep()
            if images is not None:
                images.reclaim()

        sweeper = asyncio.create_task(_sweeper(co, periodic))
        retention = asyncio.create_task(retention_loop(co, cfg.task_retention_s))
        log.info(
            "controller ready: pipeline=%s http://%s:%d rings=%s control=%d",
            cfg.pipeline,
            cfg.server.host,
            cfg.server.port,
            rings.ports(),
            control.port,
        )
        await serve_all(cfg, front, app, ports, stop)
        sweeper.cancel()
        retention.cancel()
    finally:
        log.info("controller shutting down")
        if metrics_server is not None:
            metrics_server.shutdown()
        await control.close()
        await rings.close()
        if front is not None:
            front.close()
        co.close()
        if images is not None:
            images.close()
        if checkpoints is not None:
            checkpoints.pool.close()
        if engine is not None:
            engine.close()
        ports.close()


async def serve_all(cfg: ServiceConfig, front: FrontDoor, app: Any, ports: FixedPorts,
                    stop: asyncio.Event) -> None:
    """The front door, and LightX2V's stage ports when configured (their three-POST flow:
    controller/http/lightx2v_edge.py; the encoder's port may be the front door's). The
    controller's and the one-process baseline's."""
    stage_ports = cfg.server.lightx2v_ports
    if not stage_ports:
        await serve_http(app, ports.http, stop, on_stop=front.close)
        return
    from controller.http.lightx2v_edge import LightX2VEdge
    from controller.http.webapp import body_limit

    edge = LightX2VEdge(front, app, cfg.server.lightx2v_pair_timeout_s)
    apps = {role: edge.app(role, body_limit(front)) for role in stage_ports}
    main = apps["encoder"] if stage_ports["encoder"] == cfg.server.port else app
    log.info("LightX2V stage ports: %s", ", ".join(f"{r} {p}" for r, p in stage_ports.items()))
    await asyncio.gather(serve_http(main, ports.http, stop, on_stop=front.close),
                         *(serve_http(apps[role], sock, stop)
                           for role, sock in ports.stages.items()))


def tensor_engine(cfg: ServiceConfig, env: Mapping[str, str]) -> Any:
    """The controller's own Mooncake engine, started, when it moves tensors: the input
    images of I2V / I2I pipelines (and of qwen_t2i, for image-to-image), denoising
    checkpoints (``checkpoint_store_mb``); else None. Its pools are host pools: no torch
    either way."""
    if not task_spec(cfg.pipeline).takes_image and not cfg.checkpoint_store_mb:
        return None
    from tensorplane.engine import MooncakeSettings, TransferEngine

    # Workers on other hosts pull from this segment: advertise the controller's own
    # address unless the operator says otherwise.
    own = default_advertised_host(cfg, controller=True)
    settings = MooncakeSettings.resolve(
        cfg.mooncake_config_path, env, defaults={"local_hostname": own},
        service=cfg.mooncake,
    )
    engine = TransferEngine(settings)
    engine.start()
    return engine


def open_checkpoints(cfg: ServiceConfig, engine: Any, output_dir: Path) -> Any:
    """The store of denoising checkpoints (None with ``checkpoint_store_mb`` 0): a host pool
    of that size, files beside the task store."""
    if not cfg.checkpoint_store_mb:
        return None
    from controller.tasks.checkpoints import CheckpointStore
    from tensorplane.pool import StagingPool

    pool = StagingPool(cfg.checkpoint_store_mb << 20, device="cpu")
    pool.start(engine)
    return CheckpointStore(engine, pool, output_dir / ".journal" / "checkpoints")


class ImageStager:
    """The controller's pool for input images (I2V, I2I, qwen_t2i's image-to-image), on
    its engine."""

    def __init__(self, engine: Any, pool: Any) -> None:
        self.engine = engine
        self.pool = pool

    @classmethod
    def for_pipeline(cls, cfg: ServiceConfig, engine: Any) -> ImageStager | None:
        if not task_spec(cfg.pipeline).takes_image:
            return None
        from tensorplane.pool import StagingPool

        pool = StagingPool(cfg.staging_pool_mb << 20, device="cpu")
        pool.start(engine)
        return cls(engine, pool)

    def stage(self, data: bytes) -> dict[str, Any]:
        from tensorplane.handoff import stage_bytes

        desc = stage_bytes(self.pool, self.engine, "image", data, alloc_timeout=1.0)
        out: dict[str, Any] = desc.to_dict()
        return out

    def release(self, task: Task) -> None:
        from tensorplane.descriptor import TensorDescriptor

        if task.image:
            self.pool.free_staged([TensorDescriptor.from_dict(task.image)])

    def reclaim(self) -> None:
        self.pool.reclaim()

    def close(self) -> None:
        self.pool.close()


class LocalQueue:
    """Stands in for the request ring in ``--service all``: bounded, same payload limit."""

    def __init__(self, capacity: int, slot_size: int) -> None:
        self.q: queue.Queue[dict[str, Any]] = queue.Queue(maxsize=capacity)
        self.slot_size = slot_size

    def encode(self, item: Mapping[str, Any]) -> bytes:
        return encode_body(item, self.slot_size, ring="request")

    def try_push(self, item: Mapping[str, Any]) -> Mapping[str, Any] | None:
        try:
            self.q.put_nowait(dict(item))
        except queue.Full:
            return item
        return None
