"""The pull loop every worker runs, one task at a time (:meth:`StageWorker.step`):

  1. claim    pop a slot from the role's input ring; tell the controller (its lease on the
              task starts); a refused claim releases the inputs and moves on
  2. fetch    pull the input tensors from the producer's pool with Mooncake, verify them,
              release the producer's buffers                    (role: ``fetch_inputs``)
  3. compute  the role's model stage                            (role: ``compute``)
  4. publish  stage the outputs in this worker's pool and push their descriptors to the
              next ring (blocking while it is full: backpressure), or, for the decoder,
              write the result file                             (role: ``publish``)
  5. release  tell the controller the task left this worker (handoff, or the completed
              result): the lease ends                           (role: ``release``)

The role classes (:mod:`workers.roles`) fill in steps 2-5; the claim, the failure path and
the lifecycle are shared. Lifecycle: RUNNING -> DRAINING (SIGTERM/SIGINT: finish the claimed
task, claim nothing new) -> STOPPED. A fatal error (lost ring or control connection, model
failure at start) is reported to the controller before exiting, so the worker's leases are
revoked at once.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from contracts.addresses import default_advertised_host
from contracts.config import ServiceConfig
from contracts.errors import (
    ConnectionLost,
    ControlRefused,
    DiffringError,
    ModelError,
    PayloadCorrupt,
    RingFull,
    StageCancelled,
    StageError,
    TransferError,
)
from contracts.messages import ROLE_INPUT_KIND, Op
from contracts.metrics import LIVE_PATH, READY_PATH, serve_metrics
from contracts.roles import ROLE_RINGS, Role
from rings.ring import Ring
from rings.verbs import connect
from tensorplane.descriptor import TensorDescriptor
from tensorplane.engine import MooncakeSettings, TransferEngine
from tensorplane.handoff import pull_tensors
from tensorplane.pool import StagingPool
from workers import preflight
from workers.control import ControlClient
from workers.metrics import WorkerMetrics
from workers.models.base import StageAdapter
from workers.models.components import check_stage_folder

log = logging.getLogger("diffring.worker")

IDLE_BACKOFF_MAX_S = 0.05


class State(enum.Enum):
    RUNNING = "running"
    DRAINING = "draining"
    STOPPED = "stopped"


class Idle(enum.Enum):
    """What :meth:`StageWorker.claim` returns when there is no task to run."""

    EMPTY = "empty"
    """The input ring had nothing."""
    SKIPPED = "skipped"
    """An item was taken from the ring but is not this worker's to run."""


class TaskDropped(Exception):
    """The controller told us to stop working on a task (cancelled or superseded)."""


@dataclass
class Job:
    """One claimed ring item, while this worker holds it."""

    task_id: str
    attempt: int
    item: dict[str, Any]
    cancel: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    """What the publish step leaves for the release step (the decoder's result)."""


class StageWorker:
    """The shared pull loop. A role class sets ``role`` and ``adapter`` and fills in the
    steps ``fetch_inputs``, ``compute``, ``publish``, ``release``."""

    role: ClassVar[Role]
    adapter: ClassVar[type[StageAdapter]]
    """The stage adapter interface of this role; the task picks the family's class."""
    stage: Any

    def __init__(self, cfg: ServiceConfig, token: str, env: Mapping[str, str]) -> None:
        self.cfg = cfg
        self.token = token
        self.env = dict(env)
        self.name = f"{self.role.value}-{socket.gethostname()}-{os.getpid()}"
        self.state = State.STOPPED
        self._wake = threading.Event()
        self.current: Job | None = None
        # (task_id, attempt) -> descriptors of outputs staged for the next stage.
        self.staged: dict[tuple[str, int], list[TensorDescriptor]] = {}
        self._staged_lock = threading.Lock()
        self.control = ControlClient(
            cfg.disagg_config.bootstrap_addr, cfg.disagg_config.control_port, token
        )
        self.engine: Any = None
        self.pool: Any = None
        self.in_ring: Ring | None = None
        self.out_ring: Ring | None = None
        self._hb: threading.Thread | None = None
        self.tasks_done = 0
        self.metrics = WorkerMetrics(self.role.value)
        self._metrics_server: Any = None
        self.registered = False  # over the current control connection (readiness)

    @contextlib.contextmanager
    def timed(self, step: str) -> Iterator[None]:
        t0 = time.monotonic()
        yield
        self.metrics.stage_seconds.labels(self.role.value, step).observe(time.monotonic() - t0)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Cheap checks (advertised address, model folder); Mooncake and pool; transport
        preflight (:mod:`workers.preflight`), all before the model load, which takes minutes
        for a real checkpoint; model; rings and register."""
        srv = self.cfg.server
        if srv.metric_port is not None:
            self._metrics_server = serve_metrics(
                self.metrics.registry, srv.host, srv.metric_port, f"{self.role.value} worker",
                probes={READY_PATH: self._ready, LIVE_PATH: lambda: (True, self._probe_info())},
            )
        if self.cfg.torch_threads is not None:
            import torch

            torch.set_num_threads(self.cfg.torch_threads)
        own = default_advertised_host(self.cfg, controller=False)
        check_stage_folder(Path(self.model_path()), self.cfg.pipeline, self.role.value)
        settings = MooncakeSettings.resolve(
            self.cfg.mooncake_config_path, self.env, defaults={"local_hostname": own}
        )
        self.engine = TransferEngine(settings)
        self.engine.start()
        self.pool = StagingPool(self.cfg.staging_pool_mb << 20, device=self.pool_device())
        self.pool.start(self.engine)
        self.metrics.watch_pool(self.pool.stats)
        preflight.check_on_paper(self.engine, self.cfg.disagg_config.bootstrap_addr, self.name)
        self.state = State.RUNNING
        self._connect_retrying(  # the controller connects back, before the model load
            lambda: preflight.connect_back(self.control, self.engine, self.role, self.name, True)
        )
        preflight.loopback_read(self.engine, self.pool, self.name)
        self.load_model()
        self._connect_retrying()

    def _probe_info(self) -> dict[str, Any]:
        return {"name": self.name, "state": self.state.value, "registered": self.registered}

    def _ready(self) -> tuple[bool, dict[str, Any]]:
        """Ready: registered and pulling (not starting, reconnecting or draining)."""
        return self.registered and self.state == State.RUNNING, self._probe_info()

    def _connect(self) -> None:
        """Join the rings and register with the controller; start heartbeating."""
        in_name, out_name = ROLE_RINGS[self.role]
        self.in_ring = self._join(in_name)
        if out_name is not None:
            self.out_ring = self._join(out_name)
        self.control.connect(self.role.value)
        preflight.connect_back(self.control, self.engine, self.role, self.name)
        reply = self.control.call(
            Op.REGISTER,
            role=self.role.value,
            name=self.name,
            pid=os.getpid(),
            pipeline=self.cfg.pipeline,
            segment=self.engine.session_id,
        )
        self.heartbeat_interval_s = float(reply["heartbeat_interval_s"])
        self.registered = True
        self._hb = threading.Thread(target=self._heartbeats, name="heartbeat", daemon=True)
        self._hb.start()
        log.info(
            "worker %s ready: pipeline=%s in=%s out=%s segment=%s transport=%s",
            self.name,
            self.cfg.pipeline,
            in_name,
            out_name,
            self.engine.session_id,
            self.cfg.disagg_config.ring_transport,
        )

    def _disconnect(self) -> None:
        self.registered = False
        self.control.close()
        for ring in (self.in_ring, self.out_ring):
            if ring is not None:
                ring.verbs.close()
        self.in_ring = self.out_ring = None
        if self._hb is not None:
            self._hb.join(timeout=5)

    def _connect_retrying(self, connect: Callable[[], None] | None = None) -> None:
        """Connect (``connect``, default: join and register), waiting up to
        ``reconnect_timeout_s`` for the controller to (re)appear.

        A controller restart drops every ring and control connection; the worker keeps its
        model and Mooncake state, reconnects, registers again and goes on pulling.
        """
        deadline = time.monotonic() + self.cfg.reconnect_timeout_s
        delay = 0.2
        while True:
            try:
                (connect or self._connect)()
                return
            except ConnectionLost as exc:
                self._disconnect()
                if self.state != State.RUNNING:
                    return  # asked to stop while waiting: nothing left to drain
                if time.monotonic() + delay > deadline:
                    raise ConnectionLost(
                        f"controller at {self.control.where} unreachable for "
                        f"{self.cfg.reconnect_timeout_s:g} s: {exc}"
                    ) from exc
                log.warning("worker %s: controller unreachable (%s); retrying in %.1f s",
                            self.name, exc, delay)
                self._wake.wait(delay)
                delay = min(delay * 2, 5.0)

    def _join(self, ring: str) -> Ring:
        d = self.cfg.disagg_config
        host, port = d.ring_address(ring)
        verbs = connect(
            d.ring_transport,
            host,
            port,
            layout=d.layout(ring),
            ring=ring,
            token=self.token,
            peer_name=self.name,
            **d.rdma_options(),
        )
        return Ring(verbs)

    def drain(self) -> None:
        """Finish the claimed task, claim nothing new, then stop (signal handlers call this)."""
        if self.state == State.RUNNING:
            self.state = State.DRAINING
        self._wake.set()

    def close(self) -> None:
        self.state = State.STOPPED
        self.registered = False
        self._wake.set()
        try:
            self.control.call(Op.BYE)
        except DiffringError:
            pass
        self.control.close()
        for ring in (self.in_ring, self.out_ring):
            if ring is not None:
                ring.verbs.close()
        if self.pool is not None:
            self.pool.close()
        if self.engine is not None:
            self.engine.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()

    def report_fatal(self, error: str) -> None:
        try:
            self.control.call(Op.FATAL, error=error)
        except DiffringError:
            pass

    def run(self) -> None:
        """Pull until drained. Raises on a fatal error (after reporting it)."""
        idle = 0.001
        try:
            while self.state == State.RUNNING:
                try:
                    busy = self.step()
                except ConnectionLost as exc:
                    # The controller went away (restart, network): whatever this worker held
                    # is back in play on the controller's side; reconnect and go on.
                    log.warning("worker %s: lost the controller: %s", self.name, exc)
                    self._disconnect()
                    self._connect_retrying()
                    continue
                if busy:
                    idle = 0.001
                else:
                    self._wake.wait(idle)
                    idle = min(idle * 2, IDLE_BACKOFF_MAX_S)
            self._wait_staged_pulled()
        except DiffringError as exc:
            log.error("worker %s: fatal: %s", self.name, exc)
            self.report_fatal(str(exc))
            raise
        finally:
            self.state = State.STOPPED

    def _wait_staged_pulled(self) -> None:
        """Draining: the outputs this worker staged live only in its pool until the next
        stage pulls them, so stay (heartbeating, claiming nothing) until the controller says
        they are no longer needed, or ``drain_timeout_s``."""
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        while self.staged and time.monotonic() < deadline and self._hb and self._hb.is_alive():
            time.sleep(0.05)
        if self.staged:
            log.warning("worker %s: exiting with %d task(s) not pulled yet: %s", self.name,
                        len(self.staged), sorted(t for t, _a in self.staged))

    # -- heartbeats ----------------------------------------------------------------------------
    def _heartbeats(self) -> None:
        while self.state != State.STOPPED:
            job = self.current
            with self._staged_lock:
                staged = [[t, a] for t, a in self.staged]
            try:
                reply = self.control.call(
                    Op.HEARTBEAT, tasks=[job.task_id] if job else [], staged=staged
                )
            except DiffringError as exc:
                if self.state != State.STOPPED:
                    log.error("worker %s: heartbeat failed: %s", self.name, exc)
                return
            self.metrics.heartbeats.labels(self.role.value).inc()
            if job is not None and job.task_id in reply.get("cancel", []):
                job.cancel.set()
            drop = set(reply.get("drop", []))
            if drop:
                self._free_staged(lambda key, drop=drop: key[0] in drop)
            self._wake.wait(self.heartbeat_interval_s)

    def _free_staged(self, pred: Any) -> None:
        with self._staged_lock:
            keys = [k for k in self.staged if pred(k)]
            descs = [d for k in keys for d in self.staged.pop(k)]
        if descs:
            self.pool.free_staged(descs)

    # -- one task --------------------------------------------------------------------------------
    def step(self) -> bool:
        """Claim and process at most one task; False when the input ring was empty."""
        job = self.claim()  # 1. claim
        if isinstance(job, Idle):
            return job is Idle.SKIPPED
        self.current = job
        t0 = time.monotonic()
        try:
            with self.timed("fetch"):
                inputs = self.fetch_inputs(job)  # 2. fetch
            self.check_cancel(job)
            with self.timed("compute"):
                outputs = self.compute(job, inputs)  # 3. compute
            self.check_cancel(job)
            self.publish(job, outputs)  # 4. publish
            self.release(job)  # 5. release
        except TaskDropped as exc:
            self.metrics.tasks.labels(self.role.value, "cancelled").inc()
            self._fail(job, str(exc), "cancelled", retryable=False)
        except Exception as exc:
            self.metrics.tasks.labels(self.role.value, "failed").inc()
            self._fail(job, *self.describe_failure(exc))
        else:
            self.tasks_done += 1
            self.metrics.tasks.labels(self.role.value, "done").inc()
            log.info(
                "task %s stage=%s worker=%s done in %.2f s",
                job.task_id,
                self.role.value,
                self.name,
                time.monotonic() - t0,
            )
        finally:
            self.current = None
        return True

    def claim(self) -> Job | Idle:
        """Step 1: pop one item from the input ring and claim its task at the controller."""
        assert self.in_ring is not None
        try:
            item = self.in_ring.try_pop()
        except PayloadCorrupt as exc:
            log.error("worker %s: dropped a corrupt %s slot: %s", self.name, self.in_ring.name, exc)
            return Idle.SKIPPED
        if item is None:
            return Idle.EMPTY
        self.metrics.claim_seconds.labels(self.in_ring.name, "pop").observe(
            self.in_ring.stats.last_claim_s
        )
        if item.get("kind") != ROLE_INPUT_KIND[self.role]:
            log.error(
                "worker %s: unexpected %r item in ring %s",
                self.name,
                item.get("kind"),
                self.in_ring.name,
            )
            return Idle.SKIPPED
        job = Job(str(item["task_id"]), int(item["attempt"]), item)
        reply = self.control.call(
            Op.CLAIM, task_id=job.task_id, attempt=job.attempt, stage=self.role.value
        )
        if not reply["proceed"]:
            log.info(
                "task %s stage=%s worker=%s dropped: %s",
                job.task_id,
                self.role.value,
                self.name,
                reply.get("reason"),
            )
            self.release_inputs(job)
            return Idle.SKIPPED
        return job

    # -- steps 2-5: the role classes fill these in ---------------------------------------------
    def fetch_inputs(self, job: Job) -> Any:
        """Step 2: the inputs of ``compute``, pulled from the producer."""
        raise NotImplementedError

    def compute(self, job: Job, inputs: Any) -> Any:
        """Step 3: run the role's model stage."""
        raise NotImplementedError

    def publish(self, job: Job, outputs: Any) -> None:
        """Step 4: hand the outputs on (next ring, or the result file)."""
        raise NotImplementedError

    def release(self, job: Job) -> None:
        """Step 5: tell the controller the task has left this worker; the lease ends."""
        raise NotImplementedError

    def load_model(self) -> None:
        """Construct and load this role's model stage (before joining the rings)."""
        self.stage = self.adapter.for_task(
            self.model_path(),
            self.cfg.pipeline,
            self.cfg.device,
            self.cfg.dtype,
            **self.adapter_options(),
        )
        self.stage.load()

    def adapter_options(self) -> dict[str, Any]:
        """Role-specific settings of the stage adapter."""
        return {}

    # -- failure path ------------------------------------------------------------------------------
    def describe_failure(self, exc: Exception) -> tuple[str, str, bool]:
        """(message, error_type, retryable) of a task failure."""
        if isinstance(exc, StageCancelled):
            return str(exc), "cancelled", False
        if isinstance(exc, TransferError | ConnectionLost | RingFull):
            return str(exc), type(exc).__name__, True
        if isinstance(exc, ModelError | StageError):
            return str(exc), type(exc).__name__, False
        log.exception("task failed with an unexpected error")
        return f"{type(exc).__name__}: {exc}", type(exc).__name__, False

    def _fail(self, job: Job, error: str, error_type: str, retryable: bool) -> None:
        log.warning(
            "task %s stage=%s worker=%s failed (%s): %s",
            job.task_id,
            self.role.value,
            self.name,
            error_type,
            error,
        )
        self._free_staged(lambda key: key == (job.task_id, job.attempt))
        try:
            self.control.call(
                Op.FAIL,
                task_id=job.task_id,
                attempt=job.attempt,
                stage=self.role.value,
                error=error,
                error_type=error_type,
                retryable=retryable,
            )
        except ControlRefused as exc:
            log.error("controller refused the failure report of %s: %s", job.task_id, exc)

    # -- helpers for the roles ---------------------------------------------------------------------
    def descriptors(self, job: Job) -> list[TensorDescriptor]:
        return [TensorDescriptor.from_dict(d) for d in job.item.get("tensors", [])]

    def release_inputs(self, job: Job) -> None:
        """Release the producer's buffers of a task we will not pull (refused claim)."""
        descs = self.descriptors(job)
        if descs and self.pool is not None:
            self.pool.release_producers(self.engine, descs, task_id=job.task_id)

    def pull(self, job: Job) -> dict[str, Any]:
        """Pull the job's input tensors onto this worker's device (and release them)."""
        descs = self.descriptors(job)
        t0 = time.monotonic()
        out = pull_tensors(
            self.engine, self.pool, descs, device=self.cfg.device, task_id=job.task_id
        )
        self.metrics.transfer_seconds.labels("pull").observe(time.monotonic() - t0)
        self.metrics.transfer_bytes.labels("pull").inc(sum(d.nbytes for d in descs))
        return out

    def check_cancel(self, job: Job) -> None:
        if job.cancel.is_set():
            raise TaskDropped(f"task {job.task_id} cancelled")

    def model_path(self) -> str:
        if not self.cfg.model_path:
            raise StageError(f"{self.role.value} worker needs model_path (config or --model_path)")
        return self.cfg.model_path

    def pool_device(self) -> str:
        return self.cfg.device
