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

Lifecycle: RUNNING -> DRAINING (SIGTERM/SIGINT: finish the claimed task, claim nothing new)
-> STOPPED. A fatal error (lost ring or control connection, model failure at start) is
reported to the controller before exiting, so the worker's leases are revoked at once.
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

from contracts import faults
from contracts.addresses import default_advertised_host
from contracts.config import ServiceConfig
from contracts.errors import (
    ConnectionLost,
    ControlRefused,
    DiffringError,
    HandshakeError,
    PayloadCorrupt,
    StageError,
)
from contracts.messages import Fault, Op
from contracts.metrics import LIVE_PATH, READY_PATH, serve_metrics
from contracts.roles import ROLE_RINGS, Role
from rings.ring import Ring
from rings.verbs import connect
from tensorplane.descriptor import TensorDescriptor
from tensorplane.engine import MooncakeSettings, TransferEngine
from tensorplane.handoff import pull_tensors
from tensorplane.pool import StagingPool
from workers import preflight
from workers.control import ControlClient, DoorbellClient
from workers.metrics import WorkerMetrics
from workers.models.base import StageAdapter
from workers.models.components import check_stage_folder
from workers.progress import ProgressReporter
from workers.startup import StopSignal
from workers.triage import check_item, describe_failure

log = logging.getLogger("diffring.worker")

IDLE_BACKOFF_MAX_S = 0.05
"""Longest pause after a wake-up that found nothing to claim (see :meth:`StageWorker.idle`)."""
IDLE_HEARTBEAT_MAX_S = 5.0
"""Heartbeat period of a worker that holds no task and no staged outputs (at most a third of
the lease timeout, and never more often than the configured interval)."""
IDLE_WAIT_S = 5.0
"""Longest doorbell wait: an idle worker polls its ring at least this often, so a wake-up
that never came (the controller rings within its sweep interval anyway) costs at most this."""


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
        """Wakes the pull loop (drain, close, lost control channel)."""
        self._hb_stop = threading.Event()
        """Stops the heartbeat thread of the current connection."""
        self._control_lost = threading.Event()
        """The heartbeat failed: reconnect before taking anything from a ring."""
        self.current: Job | None = None
        # (task_id, attempt) -> descriptors of outputs staged for the next stage.
        self.staged: dict[tuple[str, int], list[TensorDescriptor]] = {}
        self._staged_lock = threading.Lock()
        self.control = ControlClient(
            cfg.disagg_config.bootstrap_addr, cfg.disagg_config.control_port, token
        )
        self.doorbell = DoorbellClient(
            cfg.disagg_config.bootstrap_addr, cfg.disagg_config.control_port, token
        )
        self._false_wakes = 0
        self._no_doorbell = False
        self.progress = ProgressReporter(self.control, self.name)
        self.engine: Any = None
        self.pool: Any = None
        self.in_ring: Ring | None = None
        self.out_ring: Ring | None = None
        self._hb: threading.Thread | None = None
        self.tasks_done = 0
        self.metrics = WorkerMetrics(self.role.value)
        self._metrics_server: Any = None
        self.registered = False  # over the current control connection (readiness)
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
        self._stop.boundary("startup.transport")
        self.state = State.RUNNING
        self._connect_retrying(  # the controller connects back, before the model load
            lambda: preflight.connect_back(self.control, self.engine, self.role, self.name, True)
        )
        self._stop.boundary("startup.connected")
        preflight.loopback_read(self.engine, self.pool, self.name)
        self.load_model()
        self._stop.boundary("startup.model")
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
        self.doorbell.connect(self.role.value)
        reply = self.control.call(
            Op.REGISTER,
            role=self.role.value,
            name=self.name,
            pid=os.getpid(),
            pipeline=self.cfg.pipeline,
            segment=self.engine.session_id,
        )
        self.heartbeat_interval_s = float(reply["heartbeat_interval_s"])
        # A worker holding nothing renews no lease: it heartbeats less often (its liveness
        # is its connection), but well within a lease of the task it may claim next.
        self.idle_heartbeat_s = max(
            self.heartbeat_interval_s,
            min(IDLE_HEARTBEAT_MAX_S, float(reply["lease_timeout_s"]) / 3),
        )
        self.registered = True
        self.start_heartbeats()
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
        self._hb_stop.set()
        self.control.close()
        self.doorbell.close()
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
            except (ConnectionLost, HandshakeError) as exc:
                if isinstance(exc, HandshakeError) and not isinstance(
                    exc.__cause__, OSError | ConnectionLost
                ):
                    raise  # refused (token, layout): waiting will not change that
                # Reset or closed mid-handshake: a controller that is just dying or starting.
                self._disconnect()
                if self._stop.asked:
                    self.drain()  # a signal whose relay has not called drain() yet
                if self.state != State.RUNNING:
                    return  # asked to stop while waiting: nothing left to drain
                if time.monotonic() + delay > deadline:
                    raise ConnectionLost(
                        f"controller at {self.control.where} unreachable for "
                        f"{self.cfg.reconnect_timeout_s:g} s: {exc}"
                    ) from exc
                log.warning("worker %s: controller unreachable (%s); retrying in %.1f s",
                            self.name, exc, delay)
                faults.hit("startup.retry_wait")
                self._wake.wait(delay)  # drain() (a stop signal) ends it
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
        # Wakes the pull loop only: the heartbeats go on at their pace while the claimed
        # task finishes (they wait on their own event).
        self._wake.set()
        self.doorbell.interrupt()

    def close(self) -> None:
        self.state = State.STOPPED
        self.registered = False
        self.progress.close()
        self._wake.set()
        self._hb_stop.set()
        self.doorbell.interrupt()
        self.doorbell.close()
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
        try:
            while self.state == State.RUNNING:
                try:
                    if self.step():
                        self._false_wakes = 0
                    else:
                        self.idle()
                except ConnectionLost as exc:
                    # The controller went away (restart, network): whatever this worker held
                    # is back in play on the controller's side; reconnect and go on.
                    log.warning("worker %s: lost the controller: %s", self.name, exc)
                    self._disconnect()
                    self._connect_retrying()
            self._wait_staged_pulled()
        except DiffringError as exc:
            log.error("worker %s: fatal: %s", self.name, exc)
            self.report_fatal(str(exc))
            raise
        finally:
            self.state = State.STOPPED

    def idle(self) -> None:
        """The input ring was empty: wait on the doorbell until the controller says it has
        work (or ``IDLE_WAIT_S`` passes), instead of polling the ring: an idle worker costs
        the controller one wait per ``IDLE_WAIT_S``, and wakes within a round trip of a push.

        A wake-up is a hint: the next step claims through the ring and may find nothing
        (another worker was faster, or the published item sits behind one still being
        written). After such a false wake-up the worker pauses, doubling up to
        ``IDLE_BACKOFF_MAX_S``, so a ring that keeps reporting work it cannot hand out is
        not hammered.
        """
        assert self.in_ring is not None
        if self._false_wakes:
            self._wake.wait(min(0.001 * 2 ** (self._false_wakes - 1), IDLE_BACKOFF_MAX_S))
            if self.state != State.RUNNING:
                return
        if self._no_doorbell:
            # Polling, backing off up to IDLE_BACKOFF_MAX_S: the controller has no doorbell.
            self._false_wakes = min(self._false_wakes + 1, 16)
            return
        try:
            woke = self.doorbell.wait(self.in_ring.name, IDLE_WAIT_S,
                                      self.in_ring.pop_ticket)
        except ControlRefused as exc:
            log.warning("worker %s: no doorbell (%s); polling the ring instead", self.name, exc)
            self._no_doorbell = True
            return
        if woke is None:  # interrupted: draining or stopping
            return
        self._false_wakes = min(self._false_wakes + 1, 16) if woke else 0

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
    def start_heartbeats(self) -> None:
        """Heartbeat the current control connection from a thread of its own."""
        self._hb_stop = threading.Event()
        self._control_lost.clear()
        self._hb = threading.Thread(
            target=self._heartbeats, args=(self._hb_stop,), name="heartbeat", daemon=True
        )
        self._hb.start()

    def _heartbeats(self, stop: threading.Event) -> None:
        while self.state != State.STOPPED and not stop.is_set():
            job = self.current
            with self._staged_lock:
                staged = [[t, a] for t, a in self.staged]
            try:
                reply = self.control.call(
                    Op.HEARTBEAT, tasks=[job.task_id] if job else [], staged=staged,
                    **self.heartbeat_report(),
                )
            except DiffringError as exc:
                if self.state != State.STOPPED and not stop.is_set():
                    log.error("worker %s: heartbeat failed: %s", self.name, exc)
                    self._control_lost.set()  # the pull loop sees it within its idle backoff
                return
            self.metrics.heartbeats.labels(self.role.value).inc()
            if job is not None and job.task_id in reply.get("cancel", []):
                job.cancel.set()
            drop = set(reply.get("drop", []))
            if drop:
                self._free_staged(lambda key, drop=drop: key[0] in drop)
            holding = job is not None or bool(staged)
            stop.wait(self.heartbeat_interval_s if holding else self.idle_heartbeat_s)

    def heartbeat_report(self) -> dict[str, Any]:
        """Fields a role adds to its heartbeats (the decoder: results it holds)."""
        return {}

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
        assert self.in_ring is not None
        if self._control_lost.is_set():
            # An item popped now could not be claimed: it would sit unowned until the
            # controller's reconciliation noticed. Reconnect first (the loop does).
            raise ConnectionLost(f"control channel to {self.control.where} lost")
        ring = self.in_ring.name
        try:
            item = self.in_ring.try_pop()
        except PayloadCorrupt as exc:
            self._report_drop(ring, exc.slot, f"corrupt payload: {exc}", None)
            return Idle.SKIPPED
        if item is None:
            return Idle.EMPTY
        self.metrics.claim_seconds.labels(ring, "pop").observe(self.in_ring.stats.last_claim_s)
        faults.hit("worker.after_pop", ConnectionLost)
        problem = check_item(item, self.role, self.cfg.pipeline)
        if problem is not None:
            self._report_drop(ring, None, problem, item)
            return Idle.SKIPPED
        job = Job(item["task_id"], item["attempt"], item)
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

    def _report_drop(
        self, ring: str, slot: int | None, reason: str, item: dict[str, Any] | None
    ) -> None:
        """Tell the controller about an item taken from ``ring`` that will not be run."""
        tid = item.get("task_id") if item is not None else None
        attempt = item.get("attempt") if item is not None else None
        log.error("worker %s: dropped an item of ring %s (task %r): %s", self.name, ring, tid,
                  reason)
        try:
            self.control.call(
                Op.DROPPED,
                ring=ring,
                slot=slot,
                reason=reason,
                task_id=tid if isinstance(tid, str) else None,
                attempt=attempt if isinstance(attempt, int) and not isinstance(attempt, bool)
                else None,
            )
        except ControlRefused as exc:
            log.error("controller refused the drop report: %s", exc)

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
        """Construct and load this role's model stage (before joining the rings); a stop
        asked for meanwhile ends the load after the component being loaded."""
        self.stage = self.adapter.for_task(
            self.model_path(),
            self.cfg.pipeline,
            self.cfg.device,
            self.cfg.dtype,
            **self.adapter_options(),
        )
        self.stage.on_component = lambda _name: self._stop.boundary("startup.component")
        if self.cfg.torch_threads is not None and self.stage.torch_model:
            # Only a torch model pays for importing torch here (a synthetic stage has none).
            import torch

            torch.set_num_threads(self.cfg.torch_threads)
        self.stage.load()

    def adapter_options(self) -> dict[str, Any]:
        """Role-specific settings of the stage adapter."""
        return {}

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
            self._free_staged(lambda key: key == (job.task_id, job.attempt))
        try:
            self.control.call(
                Op.FAIL,
                task_id=job.task_id,
                attempt=job.attempt,
                stage=self.role.value,
                error=error,
                error_type=error_type,
                retryable=fault in (Fault.SYSTEM, Fault.TRANSFER, Fault.TASK),
                fault=fault.value,
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
            self.engine, self.pool, descs, device=self.cfg.device, task_id=job.task_id,
            arrays=self.stage.tensor_kind,
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
