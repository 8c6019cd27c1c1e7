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
the lifecycle are shared. An item this worker cannot run (corrupt, wrong kind, malformed) is
reported to the controller (``dropped``), which puts its task back in play; a worker whose
control channel is down takes nothing from its ring until it has reconnected. The named
fault points of :mod:`contracts.faults` sit between the steps.

The loop's helpers each do one job: :class:`~workers.link.ControlLink` (the connections to
the controller, reconnecting, heartbeats, the worker's reports),
:class:`~workers.staged.StagedOutputs` (what this producer staged and whether the next stage
still needs it), :class:`~workers.idle.IdleWait` (doorbell and back-off while the ring is
empty), :class:`~workers.progress.ProgressReporter` (denoising steps, off the critical path); and
the base class :class:`~workers.stage_host.StageHost` (the role's model stage: load, offers).

Lifecycle: STOPPED -> RUNNING (:meth:`StageWorker.start`) -> DRAINING (SIGTERM/SIGINT: finish
the claimed task -- a DiT that checkpoints hands it back at the next step boundary instead
(:mod:`workers.checkpoints`) --, claim nothing new) -> STOPPED. A fatal error (lost ring or control
connection, model failure at start) propagates out of :meth:`~StageWorker.start` or
:meth:`~StageWorker.run`; the worker's lifecycle (:func:`workers.lifecycle.run_stage_worker`)
reports it to the controller once (:meth:`~StageWorker.report_fatal`), so the worker's leases
are revoked at once, and then closes the worker.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from contracts import faults
from contracts.addresses import default_advertised_host
from contracts.config import ServiceConfig
from contracts.errors import ConnectionLost, PayloadCorrupt, StageError, StageYielded
from contracts.messages import Claim, ClaimReply, Fault
from contracts.metrics import LIVE_PATH, READY_PATH, serve_metrics
from contracts.roles import Role
from tensorplane.descriptor import TensorDescriptor
from tensorplane.engine import MooncakeSettings, TransferEngine
from tensorplane.handoff import pull_tensors
from tensorplane.pool import StagingPool
from workers import preflight
from workers.idle import IdleWait
from workers.link import ControlLink
from workers.metrics import WorkerMetrics
from workers.models.components import check_stage_folder
from workers.models.model_folder import ModelFolder
from workers.progress import ProgressReporter
from workers.stage_host import StageHost
from workers.staged import StagedOutputs
from workers.startup import StopSignal
from workers.triage import check_item, describe_failure

log = logging.getLogger("diffring.worker")


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
    published: bool = False
    """The outputs are in the next ring: from now on the controller decides when the staged
    copies may go (a consumer may be pulling them)."""
    yield_asked: threading.Event = field(default_factory=threading.Event)
    """The controller asked for the task back at the next step boundary (preemption)."""
    resume: Any = None
    """The loop state a resumed attempt starts from (a DiT's resume item)."""
    phase1_kept: bool = False
    """The controller keeps this task's encoder outputs (a checkpoint with them was kept,
    or the attempt resumed from one): later checkpoints leave them out."""
    steps: int | None = None
    """A DiT's step count, from its progress (image-to-image runs the last steps of
    ``infer_steps`` only); None before its first step."""

    def asked(self, cancel: bool = False, hand_back: bool = False) -> None:
        """The controller's word on this task (a heartbeat's or a progress report's reply):
        stop it (cancel), or hand it back at the next step boundary (preemption). Each is
        logged when it first arrives."""
        for wanted, event, what in ((cancel, self.cancel, "cancel it"),
                                    (hand_back, self.yield_asked, "hand it back")):
            if wanted and not event.is_set():
                event.set()
                log.info("task %s: the controller asked to %s", self.task_id, what)

    def descriptors(self) -> list[TensorDescriptor]:
        """The input tensors the producer staged for this task."""
        return [TensorDescriptor.from_dict(d) for d in self.item.get("tensors", [])]


class StageWorker(StageHost):
    """The shared pull loop and its lifecycle (the model stage it runs: :class:`StageHost`).
    A role class sets ``role`` and ``adapter`` and fills in the steps ``fetch_inputs``,
    ``compute``, ``publish``, ``release``."""

    role: ClassVar[Role]

    def __init__(self, cfg: ServiceConfig, token: str, env: Mapping[str, str]) -> None:
        self.cfg = cfg
        self.env = dict(env)
        self.name = f"{self.role.value}-{socket.gethostname()}-{os.getpid()}"
        self.state = State.STOPPED
        self._wake = threading.Event()
        """Wakes the pull loop (drain, close, lost control channel)."""
        self.current: Job | None = None
        self.metrics = WorkerMetrics(self.role.value)
        self.staged = StagedOutputs(lambda descs: self.pool.free_staged(descs))
        self.link = ControlLink(
            cfg, token, self.role, self.name, wake=self._wake, holding=lambda: self.current,
            staged=self.staged, active=lambda: self.state != State.STOPPED,
            beat=self.metrics.heartbeats.labels(self.role.value).inc,
        )
        self.idle = IdleWait(self.link.doorbell, self._wake, self.name)
        self.progress = ProgressReporter(self.link.control, self.name)
        self.engine: Any = None
        self.pool: Any = None
        self.tasks_done = 0
        self._metrics_server: Any = None
        self.model_folder: ModelFolder | None = None
        """What the model folder is (workers.models.model_folder), once start() checked it."""
        self._stop = StopSignal()
        """The process's stop request; start-up checks it at each boundary (an uninstalled
        one, as here, never asks)."""

    @contextlib.contextmanager
    def timed(self, step: str) -> Iterator[None]:
        t0 = time.monotonic()
        yield
        self.metrics.stage_seconds.labels(self.role.value, step).observe(time.monotonic() - t0)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, stop: StopSignal | None = None) -> None:
        """Cheap checks (advertised address, model folder); Mooncake and pool; transport
        preflight (:mod:`workers.preflight`), all before the model load, which takes minutes
        for a real checkpoint; model; rings and register. A stop asked for meanwhile
        (``stop``: :mod:`workers.startup`) ends it at the next boundary (StartupAborted)."""
        if stop is not None:
            self._stop = stop
        srv = self.cfg.server
        if srv.metric_port is not None:
            self._metrics_server = serve_metrics(
                self.metrics.registry, srv.host, srv.metric_port, f"{self.role.value} worker",
                probes={READY_PATH: self._ready, LIVE_PATH: lambda: (True, self._probe_info())},
            )
        self.progress.start()
        own = default_advertised_host(self.cfg, controller=False)
        dit = self.cfg.dit_original_ckpt if self.role.value == "transformer" else None
        self.model_folder = check_stage_folder(Path(self.model_path()), self.cfg.pipeline,
                                             self.role.value, dit, self.cfg.vae_path)
        log.info("worker %s: model folder %s is %s", self.name, self.model_path(),
                 self.model_folder.describe())
        settings = MooncakeSettings.resolve(
            self.cfg.mooncake_config_path, self.env, defaults={"local_hostname": own},
            service=self.cfg.mooncake,
        )
        self.engine = TransferEngine(settings)
        self.engine.start()
        self.pool = StagingPool(self.cfg.staging_pool_mb << 20, device=self.pool_device())
        self.pool.start(self.engine)
        self.metrics.watch_pool(self.pool.stats)
        preflight.check_on_paper(self.engine, self.cfg.disagg_config.bootstrap_addr, self.name)
        self._stop.boundary("startup.transport")
        self.state = State.RUNNING
        self.link.connect_back(self.engine, self.running)
        self._stop.boundary("startup.connected")
        preflight.loopback_read(self.engine, self.pool, self.name)
        self.load_model()
        self._stop.boundary("startup.model")
        self.link.offers = self.offers
        self.link.open(self.engine, self.running)

    def running(self) -> bool:
        """Still running: not draining, stopped, or asked to stop (the waits ask this)."""
        if self._stop.asked:
            self.drain()  # a stop signal whose relay thread has not called drain() yet
        return self.state == State.RUNNING

    def _probe_info(self) -> dict[str, Any]:
        return {"name": self.name, "state": self.state.value, "registered": self.link.registered}

    def _ready(self) -> tuple[bool, dict[str, Any]]:
        """Ready: registered and pulling (not starting, reconnecting or draining)."""
        return self.link.registered and self.state == State.RUNNING, self._probe_info()

    def drain(self) -> None:
        """Finish the claimed task, claim nothing new, then stop (signal handlers call this)."""
        if self.state == State.RUNNING:
            self.state = State.DRAINING
        # Wakes the pull loop only: the heartbeats go on at their pace while the claimed
        # task finishes (they wait on their own event).
        self._wake.set()
        self.idle.interrupt()

    def run(self) -> None:
        """Pull until drained. A fatal error propagates (the caller reports it)."""
        try:
            while self.state == State.RUNNING:
                try:
                    faults.hit("worker.loop")
                    if self.step():
                        self.idle.reset()
                    else:
                        self.wait_for_work()
                except ConnectionLost as exc:
                    # The controller went away (restart, network): whatever this worker held
                    # is back in play on the controller's side; reconnect and go on.
                    log.warning("worker %s: lost the controller: %s", self.name, exc)
                    self.link.reconnect(self.engine, self.running)
            self.wait_drained()
        finally:
            self.state = State.STOPPED

    def wait_for_work(self) -> None:
        """The input was empty: wait for the doorbell of the input ring (or a while)."""
        assert self.link.in_ring is not None
        self.idle.wait(self.link.in_ring, self.running)

    def wait_drained(self) -> None:
        """Draining: the outputs this worker staged live only in its pool until the next
        stage pulls them, so stay (heartbeating, claiming nothing) until the controller says
        they are no longer needed, or ``drain_timeout_s``."""
        if not self.staged.wait_pulled(self.cfg.drain_timeout_s, self.link.heartbeats.alive):
            left = self.staged.keys()
            log.warning("worker %s: exiting with %d task(s) not pulled yet: %s", self.name,
                        len(left), sorted(t for t, _a in left))

    def report_fatal(self, error: str) -> None:
        """Tell the controller this worker is exiting on ``error`` (at most once)."""
        self.link.report_fatal(error)

    def close(self) -> None:
        self.state = State.STOPPED
        self.progress.close()
        self._wake.set()
        self.link.close()
        if self.pool is not None:
            self.pool.close()
        if self.engine is not None:
            self.engine.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()

    # -- one task --------------------------------------------------------------------------------
    def step(self) -> bool:
        """Claim and process at most one task; False when the input ring was empty."""
        job = self.claim()  # 1. claim
        if isinstance(job, Idle):
            return job is Idle.SKIPPED
        self.current = job
        t0 = time.monotonic()
        try:
            faults.hit("worker.after_claim")
            with self.timed("fetch"):
                inputs = self.fetch_inputs(job)  # 2. fetch
            self.check_cancel(job)
            faults.hit("worker.stage", StageError)
            with self.timed("compute"):
                outputs = self.compute(job, inputs)  # 3. compute
            self.check_cancel(job)
            faults.hit("worker.before_publish")
            self.publish(job, outputs)  # 4. publish
            job.published = True
            faults.hit("worker.after_publish")
            self.release(job)  # 5. release
        except TaskDropped as exc:
            self.metrics.tasks.labels(self.role.value, "cancelled").inc()
            self._fail(job, str(exc), "cancelled", Fault.CANCELLED)
        except StageYielded as exc:  # checkpointed at a step boundary: handed back, uncharged
            # (split: handed over at the boundary to a worker holding the other expert)
            fault = Fault.HANDOVER if exc.why == "handover" else Fault.YIELDED
            self.metrics.tasks.labels(self.role.value, fault.value).inc()
            self._fail(job, str(exc), fault.value, fault)
        except Exception as exc:
            self.metrics.tasks.labels(self.role.value, "failed").inc()
            self._fail(job, *describe_failure(exc))
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
            self.progress.forget(job)
            self.current = None
        return True

    def claim(self) -> Job | Idle:
        """Step 1: pop one item from the input ring and claim its task at the controller."""
        in_ring = self.link.in_ring
        assert in_ring is not None
        if self.link.heartbeats.lost.is_set():
            # An item popped now could not be claimed: it would sit unowned until the
            # controller's reconciliation noticed. Reconnect first (the loop does).
            raise ConnectionLost(f"control channel to {self.link.where} lost")
        ring = in_ring.name
        try:
            item = in_ring.try_pop()
        except PayloadCorrupt as exc:
            self.link.report_drop(ring, exc.slot, f"corrupt payload: {exc}", None)
            return Idle.SKIPPED
        if item is None:
            return Idle.EMPTY
        self.metrics.claim_seconds.labels(ring, "pop").observe(in_ring.stats.last_claim_s)
        faults.hit("worker.after_pop", ConnectionLost)
        problem = check_item(item, self.role, self.cfg.pipeline)
        if problem is not None:
            self.link.report_drop(ring, None, problem, item)
            return Idle.SKIPPED
        job = Job(item["task_id"], item["attempt"], item)
        reply = self.link.call(Claim(task_id=job.task_id, attempt=job.attempt), ClaimReply)
        if reply.defer:
            # A more urgent task waits behind it (controller.ownership.priorities): the item goes
            # back to the ring's tail, its inputs untouched; should the ring be full, the
            # controller puts the task back in play instead (window 3).
            if in_ring.try_push(item) is not None:
                self.link.report_drop(ring, None, "deferred and the ring is full", item)
            return Idle.SKIPPED
        if not reply.proceed:
            log.info(
                "task %s stage=%s worker=%s dropped: %s",
                job.task_id,
                self.role.value,
                self.name,
                reply.reason,
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

    # -- failure path ------------------------------------------------------------------------------
    def _fail(self, job: Job, error: str, error_type: str, fault: Fault) -> None:
        log.warning(
            "task %s stage=%s worker=%s failed (%s): %s",
            job.task_id,
            self.role.value,
            self.name,
            error_type,
            error,
        )
        if not job.published:
            self.staged.drop(lambda key: key == (job.task_id, job.attempt))
        self.link.report_failure(job.task_id, job.attempt, error, error_type, fault)

    # -- helpers for the roles ---------------------------------------------------------------------
    def release_inputs(self, job: Job) -> None:
        """Release the producer's buffers of a task we will not pull (refused claim)."""
        descs = job.descriptors()
        if descs and self.pool is not None:
            self.pool.release_producers(self.engine, descs, task_id=job.task_id)

    def pull(self, job: Job) -> dict[str, Any]:
        """Pull the job's input tensors onto this worker's device (and release them)."""
        descs = job.descriptors()
        t0 = time.monotonic()
        out = pull_tensors(
            self.engine, self.pool, descs, device=self.cfg.device, task_id=job.task_id,
            arrays=self.stage.tensor_kind,
        )
        self.metrics.transfer_seconds.labels("pull").observe(time.monotonic() - t0)
        self.metrics.transfer_bytes.labels("pull").inc(sum(d.nbytes for d in descs))
        return out

    def check_cancel(self, job: Job) -> None:
        if job.cancel.is_set():
            raise TaskDropped(f"task {job.task_id} cancelled")
