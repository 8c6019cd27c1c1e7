"""The one-process baseline (``--service all``): the controller's coordinator and front door
with all three model stages run in this process (no rings, no Mooncake). The reference for
fidelity and the baseline of the benchmarks.

This is the one module that imports both :mod:`controller` and :mod:`workers`: the baseline
is composed here, at the entry point, so neither of them knows the other.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from contracts.config import STAGE_SECTIONS, ServiceConfig
from contracts.errors import (
    ConfigError,
    DiffringError,
    InvalidRequestError,
    StageCancelled,
    StageInputError,
)
from contracts.messages import Fault
from contracts.request import GenerationRequest
from contracts.roles import Role
from controller.app import (
    FixedPorts,
    LocalQueue,
    open_table_for,
    retention_loop,
    serve_all,
    start_metrics,
)
from controller.config import CoordinatorConfig
from controller.http.frontdoor import FrontDoor
from controller.http.webapp import build_app
from controller.main import run_async
from controller.ownership.coordinator import Coordinator
from controller.ownership.registry import WorkerInfo
from workers.metrics import WorkerMetrics
from workers.models import LocalPipeline
from workers.roles import _size, video_settings

log = logging.getLogger("diffring.baseline")
T = TypeVar("T")


class BaselineWorker:
    """Runs whole requests in this process, reporting the same lifecycle as the workers."""

    def __init__(
        self, cfg: ServiceConfig, co: Coordinator, jobs: LocalQueue, loop: asyncio.AbstractEventLoop
    ) -> None:
        if not cfg.model_path:
            raise ConfigError("--service all needs model_path (config) or --model_path")
        self.cfg = cfg
        self.pipeline = LocalPipeline(
            cfg.model_path, cfg.pipeline, cfg.device, cfg.dtype, cfg.attention_backend,
            compile=cfg.compile, cfg_batch=cfg.cfg_batch, video=video_settings(cfg),
            prompt_cache_bytes=cfg.prompt_cache_mb << 20,
            stage_options={role: cfg.stage_options(role) for role in STAGE_SECTIONS},
            budget_shapes=cfg.warmup_shapes, attention_fallback=cfg.attention_fallback,
            dit_file=cfg.dit_original_ckpt, vae_file=cfg.vae_path,
        )
        # The workers' stage-time histogram, so that benchmarks read both modes alike.
        self.metrics = WorkerMetrics(Role.DECODER.value)
        self.co = co
        self.jobs = jobs
        self.loop = loop
        self.stopping = threading.Event()
        self.roles: dict[Role, WorkerInfo] = {}
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
        # Each stage's GPU memory, as the workers report theirs (one process: each peak is
        # the process's while that stage ran).
        self.metrics.watch_memories({role.value: stage for role, stage in self.stages().items()})
        if self.cfg.warmup_shapes:
            seconds = self.pipeline.transformer.warm_up(self.cfg.warmup_shapes)
            log.info("baseline: warm-up of %s took %.1f s (compile=%s)",
                     ", ".join(self.cfg.warmup_shapes), seconds, self.cfg.compile)

    def stages(self) -> dict[Role, Any]:
        p = self.pipeline
        return {Role.ENCODER: p.encoder, Role.TRANSFORMER: p.transformer, Role.DECODER: p.decoder}

    def report_memory(self) -> None:
        """Each stage's GPU memory into its row of the status, as a worker's heartbeat
        carries it (called on the loop, which owns the registry)."""
        for role, stage in self.stages().items():
            if stage.torch_model:
                self.roles[role].stats = stage.memory.report()

    def start(self) -> None:
        """Register the stages and start serving; :meth:`load` ran first (off the loop)."""
        for role in Role:
            offers = self.pipeline.transformer.offers() if role == Role.TRANSFORMER else {}
            self.roles[role] = self.co.on_register(
                role, f"all/{role}", 0, self.co.config.pipeline, "",
                loras=tuple(offers.get("loras", ())), caches=tuple(offers.get("caches", ())),
                fused=tuple((f["name"], f["strength"]) for f in offers.get("fused", ())),
                recipe=offers.get("recipe"))
        self.report_memory()
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
            self.on_loop(self.report_memory)

    def _one(self, job: dict[str, Any]) -> None:
        tid, attempt = str(job["task_id"]), int(job["attempt"])
        enc, dit, dec = (self.roles[r] for r in (Role.ENCODER, Role.TRANSFORMER, Role.DECODER))
        ok, _ = self.on_loop(self.co.on_claim, enc, tid, attempt)
        if not ok:
            return
        task = self.co.table.get(tid)
        image = task.image_bytes if task is not None else None
        req = GenerationRequest.from_dict(job["request"])
        stop = threading.Event()

        def on_step(k: int, n: int) -> None:
            if self.on_loop(self.co.on_progress, dit, tid, attempt, k, n,
                            self.pipeline.transformer.active_expert):
                stop.set()

        def timed(role: Role, step: str = "compute") -> Any:
            return self.metrics.timed(role.value, step)

        size = _size(req)  # what an out-of-memory error names, as in the workers
        try:
            with timed(Role.ENCODER), self.pipeline.encoder.guarded(size):
                cond = self.pipeline.encoder.encode(req, image)
            self.on_loop(self.co.on_handoff, enc, tid, attempt)
            if not self.on_loop(self.co.on_claim, dit, tid, attempt)[0]:
                return
            with timed(Role.TRANSFORMER), self.pipeline.transformer.guarded(size):
                lat = self.pipeline.transformer.denoise(req, cond, on_step, stop.is_set)
            self.on_loop(self.co.on_handoff, dit, tid, attempt)
            if not self.on_loop(self.co.on_claim, dec, tid, attempt)[0]:
                return
            with timed(Role.DECODER), self.pipeline.decoder.guarded(size):
                pixels = self.pipeline.decoder.decode_pixels(req, lat)
            with timed(Role.DECODER, "encode_media"):
                art = self.pipeline.decoder.encode_media(req, pixels)
            # on_complete is a coroutine (the result file is written off the loop).
            asyncio.run_coroutine_threadsafe(
                self.co.on_complete(dec, tid, attempt, art.extension, art.media_type, art.data),
                self.loop,
            ).result()
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
                Fault.INPUT if isinstance(exc, InvalidRequestError | StageInputError)
                else Fault.TASK,
            )


async def run_all_async(
    cfg: ServiceConfig, token: str, env: Mapping[str, str], stop: asyncio.Event
) -> None:
    output_dir = Path(cfg.output_dir).resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    ports = FixedPorts.bind(cfg, control=False)
    jobs = LocalQueue(cfg.disagg_config.rdma_buffer_slots, cfg.disagg_config.rdma_buffer_slot_size)
    co = Coordinator(
        CoordinatorConfig.from_service(cfg, output_dir),
        open_table_for(cfg, output_dir),
        jobs,  # type: ignore[arg-type]
    )
    co.restore()
    worker = BaselineWorker(cfg, co, jobs, asyncio.get_running_loop())
    try:
        await asyncio.get_running_loop().run_in_executor(None, worker.load)
    except DiffringError:
        ports.close()
        co.close()
        raise
    worker.start()
    front = FrontDoor(co, status_extra=lambda: {"rings": {}}, service="all", server=cfg.server,
                      defaults=cfg.request_defaults, recipe=cfg.recipe)
    app = build_app(front)
    metrics_server = start_metrics(
        cfg, co, app, lambda: {}, None, collectors=[worker.metrics.registry], sock=ports.metrics
    )
    retention = asyncio.create_task(retention_loop(co, cfg.task_retention_s))
    log.info(
        "baseline ready: pipeline=%s http://%s:%d", cfg.pipeline, cfg.server.host, cfg.server.port
    )
    try:
        await serve_all(cfg, front, app, ports, stop)  # + LightX2V's stage ports, if set
    finally:
        log.info("baseline shutting down")
        retention.cancel()
        if metrics_server is not None:
            metrics_server.shutdown()
        await asyncio.get_running_loop().run_in_executor(None, worker.close)
        ports.close()
        front.close()
        co.close()


def run_all(cfg: ServiceConfig, token: str, env: Mapping[str, str]) -> int:
    """Entry point of ``--service all``."""
    return run_async(lambda stop: run_all_async(cfg, token, env, stop))
