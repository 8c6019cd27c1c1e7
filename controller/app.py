"""Assembly of the controller process (``--service controller``) and of the one-process
baseline (``--service all``): rings, control channel, coordinator, front door, sweeper."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import socket
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from controller.coordinator import Coordinator, WorkerInfo
from controller.frontdoor import FrontDoor
from controller.tasks import Task
from rings.config import ServiceConfig
from rings.errors import ConfigError, DiffringError
from rings.payload import encode_body
from rings.ports import bind_socket

log = logging.getLogger("diffring.controller")
T = TypeVar("T")

SWEEP_INTERVAL_S = 0.5


async def serve_http(app: Any, sock: socket.socket, stop: asyncio.Event) -> None:
    """Run uvicorn on an already-bound socket until ``stop`` is set."""
    import uvicorn

    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
    )
    # Signals belong to the process's own handler (which sets ``stop``), not uvicorn.
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    task = asyncio.create_task(server.serve(sockets=[sock]))
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    server.should_exit = True
    stopper.cancel()
    await task


def start_metrics(
    cfg: ServiceConfig,
    co: Coordinator,
    front: FrontDoor,
    ring_status: Callable[[], dict[str, Any]],
    pool_stats: Callable[[], Any] | None,
) -> Any:
    """Instrument the front door; serve /metrics when a metric port is configured."""
    from controller.metrics import ControllerMetrics
    from workers.metrics import serve_metrics

    metrics = ControllerMetrics(co)
    metrics.ring_status = ring_status
    metrics.pool_stats = pool_stats
    front.app.middleware("http")(metrics.middleware)
    if cfg.server.metric_port is None:
        return None
    return serve_metrics(metrics.registry, cfg.server.host, cfg.server.metric_port,
                         "controller")


async def _sweeper(co: Coordinator, extra: Callable[[], None] | None = None) -> None:
    while True:
        await asyncio.sleep(SWEEP_INTERVAL_S)
        try:
            co.sweep()
            if extra is not None:
                extra()
        except Exception:  # the sweeper must outlive any single failure
            log.exception("sweep failed")


def _ring_status(rings: Any) -> dict[str, Any]:
    from rings.inspect import snapshot

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
    from controller.rings_host import ControllerRings

    d = cfg.disagg_config
    output_dir = Path(cfg.output_dir).resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    http_sock = bind_socket(cfg.server.host, cfg.server.port, "front door")
    rings = ControllerRings(d, token)
    await rings.start()
    images = ImageStager.for_pipeline(cfg, env)
    co = Coordinator(
        pipeline=cfg.pipeline,
        request_ring=rings.local["request"],
        output_dir=output_dir,
        lease_timeout_s=cfg.lease_timeout_s,
        heartbeat_interval_s=cfg.heartbeat_interval_s,
        max_pending=cfg.max_pending_tasks,
        stage_image=images.stage if images else None,
        release_image=images.release if images else None,
        journal=output_dir / ".journal",
    )
    co.restore()
    control = ControlServer(co, d.bootstrap_addr, d.control_port, token)
    metrics_server = None
    try:
        await control.start()
        front = FrontDoor(co, status_extra=lambda: _ring_status(rings), service="controller")
        metrics_server = start_metrics(cfg, co, front, lambda: _ring_status(rings),
                                       images.pool.stats if images else None)
        sweeper = asyncio.create_task(_sweeper(co, images.reclaim if images else None))
        log.info(
            "controller ready: pipeline=%s http://%s:%d rings=%s control=%d",
            cfg.pipeline,
            cfg.server.host,
            cfg.server.port,
            rings.ports(),
            control.port,
        )
        await serve_http(front.app, http_sock, stop)
        sweeper.cancel()
    finally:
        log.info("controller shutting down")
        if metrics_server is not None:
            metrics_server.shutdown()
        await control.close()
        await rings.close()
        if images is not None:
            images.close()
        http_sock.close()


class ImageStager:
    """The controller's own Mooncake engine and pool, for I2V / I2I input images."""

    def __init__(self, engine: Any, pool: Any) -> None:
        self.engine = engine
        self.pool = pool

    @classmethod
    def for_pipeline(cls, cfg: ServiceConfig, env: Mapping[str, str]) -> ImageStager | None:
        from workers.models.base import task_spec

        if not task_spec(cfg.pipeline).needs_image:
            return None
        from workers.staging import StagingPool
        from workers.transfer import MooncakeSettings, TransferEngine

        settings = MooncakeSettings.resolve(cfg.mooncake_config_path, env)
        engine = TransferEngine(settings)
        engine.start()
        pool = StagingPool(cfg.staging_pool_mb << 20, device="cpu")
        pool.start(engine)
        return cls(engine, pool)

    def stage(self, data: bytes) -> dict[str, Any]:
        from workers.staging import stage_bytes

        desc = stage_bytes(self.pool, self.engine, "image", data, alloc_timeout=1.0)
        out: dict[str, Any] = desc.to_dict()
        return out

    def release(self, task: Task) -> None:
        from workers.staging import TensorDescriptor

        if task.image:
            self.pool.free_staged([TensorDescriptor.from_dict(task.image)])

    def reclaim(self) -> None:
        self.pool.reclaim()

    def close(self) -> None:
        self.pool.close()
        self.engine.close()


# -- the one-process baseline ---------------------------------------------------------------
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


class BaselineWorker:
    """Runs whole requests in this process, reporting the same lifecycle as the workers."""

    def __init__(
        self, cfg: ServiceConfig, co: Coordinator, jobs: LocalQueue, loop: asyncio.AbstractEventLoop
    ) -> None:
        from workers.models import LocalPipeline

        if not cfg.model_path:
            raise ConfigError("--service all needs model_path (config) or --model_path")
        self.cfg = cfg
        self.pipeline = LocalPipeline(
            cfg.model_path, cfg.pipeline, cfg.device, cfg.dtype, cfg.attention_backend
        )
        self.co = co
        self.jobs = jobs
        self.loop = loop
        self.stopping = threading.Event()
        self.roles: dict[str, WorkerInfo] = {}
        self.thread = threading.Thread(target=self._run, name="baseline", daemon=True)

    def on_loop(self, fn: Callable[..., T], *args: Any) -> T:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()

        def call() -> None:
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # hand every failure back to the worker thread
                fut.set_exception(exc)

        self.loop.call_soon_threadsafe(call)
        return fut.result()

    def load(self) -> None:
        if self.cfg.torch_threads is not None:
            import torch

            torch.set_num_threads(self.cfg.torch_threads)
        self.pipeline.load()

    def start(self) -> None:
        self.load()
        for role in ("encoder", "transformer", "decoder"):
            self.roles[role] = self.co.on_register(role, f"all/{role}", 0, self.co.pipeline, "")
        self.thread.start()

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=600)

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                job = self.jobs.q.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                self._one(job)
            except Exception:
                log.exception("baseline: task %s crashed", job.get("task_id"))

    def _one(self, job: dict[str, Any]) -> None:
        from workers.models import GenerationRequest, StageCancelled

        tid, attempt = str(job["task_id"]), int(job["attempt"])
        enc, dit, dec = self.roles["encoder"], self.roles["transformer"], self.roles["decoder"]
        ok, _ = self.on_loop(self.co.on_claim, enc, tid, attempt)
        if not ok:
            return
        task = self.co.table.get(tid)
        image = task.image_bytes if task is not None else None
        req = GenerationRequest.from_dict(job["request"])
        stop = threading.Event()

        def on_step(k: int, n: int) -> None:
            if self.on_loop(self.co.on_progress, dit, tid, attempt, k, n):
                stop.set()

        try:
            cond = self.pipeline.encoder.encode(req, image)
            self.on_loop(self.co.on_handoff, enc, tid, attempt)
            if not self.on_loop(self.co.on_claim, dit, tid, attempt)[0]:
                return
            lat = self.pipeline.transformer.denoise(req, cond, on_step, stop.is_set)
            self.on_loop(self.co.on_handoff, dit, tid, attempt)
            if not self.on_loop(self.co.on_claim, dec, tid, attempt)[0]:
                return
            art = self.pipeline.decoder.decode(req, lat)
            self.on_loop(
                self.co.on_complete, dec, tid, attempt, art.extension, art.media_type, art.data
            )
        except StageCancelled as exc:
            self.on_loop(self.co.on_fail, dit, tid, attempt, str(exc), "cancelled", False)
        except Exception as exc:
            holder = next(
                (w for w in (enc, dit, dec) if task is not None and task.worker_id == w.worker_id),
                dec,
            )
            self.on_loop(
                self.co.on_fail,
                holder,
                tid,
                attempt,
                f"{type(exc).__name__}: {exc}",
                type(exc).__name__,
                False,
            )


async def run_all_async(
    cfg: ServiceConfig, token: str, env: Mapping[str, str], stop: asyncio.Event
) -> None:
    output_dir = Path(cfg.output_dir).resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    http_sock = bind_socket(cfg.server.host, cfg.server.port, "front door")
    jobs = LocalQueue(cfg.disagg_config.rdma_buffer_slots, cfg.disagg_config.rdma_buffer_slot_size)
    co = Coordinator(
        pipeline=cfg.pipeline,
        request_ring=jobs,  # type: ignore[arg-type]
        output_dir=output_dir,
        lease_timeout_s=cfg.lease_timeout_s,
        heartbeat_interval_s=cfg.heartbeat_interval_s,
        max_pending=cfg.max_pending_tasks,
        journal=output_dir / ".journal",
    )
    co.restore()
    worker = BaselineWorker(cfg, co, jobs, asyncio.get_running_loop())
    try:
        await asyncio.get_running_loop().run_in_executor(None, worker.load)
    except DiffringError:
        http_sock.close()
        raise
    worker.start()
    front = FrontDoor(co, status_extra=lambda: {"rings": {}}, service="all")
    metrics_server = start_metrics(cfg, co, front, lambda: {}, None)
    log.info(
        "baseline ready: pipeline=%s http://%s:%d", cfg.pipeline, cfg.server.host, cfg.server.port
    )
    try:
        await serve_http(front.app, http_sock, stop)
    finally:
        log.info("baseline shutting down")
        if metrics_server is not None:
            metrics_server.shutdown()
        await asyncio.get_running_loop().run_in_executor(None, worker.close)
        http_sock.close()
