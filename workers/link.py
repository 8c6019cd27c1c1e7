"""A worker's link to the controller: what it holds open there, and what it tells it.

:class:`ControlLink` owns the control channel, the doorbell and the two ring connections;
joins and registers (:meth:`~ControlLink.open`), waits out a controller that is restarting
(up to ``reconnect_timeout_s``), and sends the worker's reports: an item dropped, an attempt
failed, and the fatal error, once, before the process exits. :class:`Heartbeats` renews the
held task's lease from a thread of its own and brings back cancels and the staged outputs
nobody will pull.

A controller restart drops every ring and control connection; the worker keeps its model
and Mooncake state, reconnects, registers again and goes on pulling.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from contracts import faults
from contracts.config import ServiceConfig
from contracts.errors import ConnectionLost, ControlRefused, DiffringError, HandshakeError
from contracts.messages import (
    Bye,
    ControlMessage,
    Dropped,
    Empty,
    Fail,
    Fatal,
    Fault,
    Heartbeat,
    HeartbeatReply,
    Register,
    RegisterReply,
    StorageReport,
)
from contracts.roles import ROLE_RINGS, Role
from rings.ring import Ring
from rings.transports import connect
from tensorplane.engine import TransferEngine
from workers import preflight
from workers.control import ControlChannel, ControlClient, DoorbellClient, R
from workers.staged import StagedOutputs

log = logging.getLogger("diffring.worker")

IDLE_HEARTBEAT_MAX_S = 5.0
"""Heartbeat period of a worker that holds no task and no staged outputs (at most a third of
the lease timeout, and never more often than the configured interval)."""
FATAL_REPORT_TIMEOUT_S = 5.0
"""How long the fatal report may take when it needs a connection of its own (the process
is exiting; a controller that does not answer by then learns of it from the lease)."""


class HeldTask(Protocol):
    task_id: str

    def asked(self, cancel: bool = False, hand_back: bool = False) -> None: ...


class Heartbeats:
    """Heartbeats of the current control connection, from a thread of their own (one per
    connection: :meth:`start` after registering, :meth:`stop` when the connection goes)."""

    def __init__(
        self,
        call: Callable[[Heartbeat, type[HeartbeatReply]], HeartbeatReply],
        holding: Callable[[], HeldTask | None],
        staged: StagedOutputs,
        active: Callable[[], bool],
        beat: Callable[[], None],
        name: str,
    ) -> None:
        self._call = call
        self._holding = holding
        """The task the pull loop holds now (its lease is renewed), or None."""
        self._staged = staged
        self._active = active
        """False once the worker stopped: no more heartbeats, and a failure is not news."""
        self._beat = beat
        self._name = name
        self.lost = threading.Event()
        """The heartbeat failed: reconnect before taking anything from a ring."""
        self.report: Callable[[], dict[str, float]] = dict
        """Figures each heartbeat carries to the controller's status (the stage's memory)."""
        self.storage: Callable[[], StorageReport | None] = lambda: None
        """The decoder's results held because their files cannot be written (None: none;
        other roles: always None)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, interval_s: float, idle_interval_s: float) -> None:
        self._stop = threading.Event()
        self.lost.clear()
        self._thread = threading.Thread(
            target=self._run, args=(self._stop, interval_s, idle_interval_s),
            name="heartbeat", daemon=True,
        )
        self._thread.start()

    def stop(self) -> None:
        # Its own event, not the pull loop's wake-up: a drain leaves that set, and the
        # heartbeats must go on at their pace while the claimed task finishes.
        self._stop.set()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout=timeout)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self, stop: threading.Event, interval_s: float, idle_interval_s: float) -> None:
        while self._active() and not stop.is_set():
            job = self._holding()
            staged = list(self._staged.keys())
            try:
                reply = self._call(
                    Heartbeat(tasks=[job.task_id] if job else [], staged=staged,
                              stats=self.report(), storage=self.storage()),
                    HeartbeatReply)
            except DiffringError as exc:
                if self._active() and not stop.is_set():
                    log.error("worker %s: heartbeat failed: %s", self._name, exc)
                    self.lost.set()  # the pull loop sees it within its idle backoff
                return
            self._beat()
            if job is not None:
                job.asked(cancel=job.task_id in reply.cancel,
                          hand_back=job.task_id in reply.yield_)
            if reply.drop_staged:  # by (task, attempt): never the attempt being read
                self._staged.drop_keys(set(reply.drop_staged))
            holding = job is not None or bool(staged)
            stop.wait(interval_s if holding else idle_interval_s)


class ControlLink:
    """The control channel, the doorbell and the rings of one worker. No I/O before
    :meth:`connect_back` / :meth:`open`; :meth:`close` ends all of it."""

    def __init__(
        self,
        cfg: ServiceConfig,
        token: str,
        role: Role,
        name: str,
        *,
        wake: threading.Event,
        holding: Callable[[], HeldTask | None],
        staged: StagedOutputs,
        active: Callable[[], bool],
        beat: Callable[[], None],
    ) -> None:
        d = cfg.disagg_config
        self.cfg = cfg
        self.token = token
        self.role = role
        self.name = name
        self._wake = wake
        """Set when the worker drains or closes: ends a retry pause at once."""
        self.control: ControlChannel = ControlClient(d.bootstrap_addr, d.control_port, token)
        self.doorbell = DoorbellClient(d.bootstrap_addr, d.control_port, token)
        self.in_ring: Ring | None = None
        self.out_ring: Ring | None = None
        self.registered = False
        """Registered over the current control connection (readiness)."""
        self.heartbeats = Heartbeats(self.call, holding, staged, active, beat, name)
        self._fatal_reported = False
        self.offers: Callable[[], dict[str, Any]] = dict
        """What requests may ask of this worker's stage (a DiT's adapters and cache kinds),
        read again for every registration (a reconnected worker reports its folder now)."""
        self.on_registered: Callable[[RegisterReply], None] = lambda _reply: None
        """Told the controller's answer to each registration (a DiT: are checkpoints kept)."""

    @property
    def where(self) -> str:
        return self.control.where

    def call(self, msg: ControlMessage, reply: type[R]) -> R:
        """Send ``msg`` on the control channel; the controller's answer, of type ``reply``."""
        return self.control.call(msg, reply)

    # -- connecting ------------------------------------------------------------------------
    def connect_back(self, engine: TransferEngine, running: Callable[[], bool]) -> None:
        """The controller connects back to this worker's Mooncake segment, over a control
        connection of its own (before the model load, which takes minutes)."""
        self._retrying(running, lambda: preflight.connect_back(
            self.control, engine, self.role, self.name, True))

    def open(self, engine: TransferEngine, running: Callable[[], bool]) -> None:
        """Join the rings and register; start heartbeating."""
        self._retrying(running, lambda: self._connect(engine))

    def reconnect(self, engine: TransferEngine, running: Callable[[], bool]) -> None:
        self.disconnect()
        self.open(engine, running)

    def _connect(self, engine: TransferEngine) -> None:
        in_name, out_name = ROLE_RINGS[self.role]
        self.in_ring = self._join(in_name)
        if out_name is not None:
            self.out_ring = self._join(out_name)
        self.control.connect(self.role.value)
        preflight.connect_back(self.control, engine, self.role, self.name)
        self.doorbell.connect(self.role.value)
        reply = self.call(
            Register(role=self.role.value, name=self.name, pid=os.getpid(),
                     pipeline=self.cfg.pipeline, segment=engine.session_id,
                     **self.offers()),  # loras, caches, fused, recipe, checkpoints
            RegisterReply)
        self.on_registered(reply)
        interval = reply.heartbeat_interval_s
        # A worker holding nothing renews no lease: it heartbeats less often (its liveness
        # is its connection), but well within a lease of the task it may claim next.
        idle = max(interval, min(IDLE_HEARTBEAT_MAX_S, reply.lease_timeout_s / 3))
        self.registered = True
        self.heartbeats.start(interval, idle)
        log.info(
            "worker %s ready: pipeline=%s in=%s out=%s segment=%s transport=%s",
            self.name,
            self.cfg.pipeline,
            in_name,
            out_name,
            engine.session_id,
            self.cfg.disagg_config.ring_transport,
        )

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

    def disconnect(self) -> None:
        self.registered = False
        self.heartbeats.stop()
        self.control.close()
        self.doorbell.close()
        self._close_rings()
        self.heartbeats.join(timeout=5)

    def _close_rings(self) -> None:
        for ring in (self.in_ring, self.out_ring):
            if ring is not None:
                ring.verbs.close()
        self.in_ring = self.out_ring = None

    def _retrying(self, running: Callable[[], bool], connect: Callable[[], None]) -> None:
        """``connect``, waiting up to ``reconnect_timeout_s`` for the controller to
        (re)appear; returns early, unconnected, once ``running()`` turns False."""
        deadline = time.monotonic() + self.cfg.reconnect_timeout_s
        delay = 0.2
        while True:
            try:
                connect()
                return
            except (ConnectionLost, HandshakeError) as exc:
                if isinstance(exc, HandshakeError) and not isinstance(
                    exc.__cause__, OSError | ConnectionLost
                ):
                    raise  # refused (token, layout): waiting will not change that
                # Reset or closed mid-handshake: a controller that is just dying or starting.
                self.disconnect()
                if not running():
                    return  # asked to stop while waiting: nothing left to drain
                if time.monotonic() + delay > deadline:
                    raise ConnectionLost(
                        f"controller at {self.where} unreachable for "
                        f"{self.cfg.reconnect_timeout_s:g} s: {exc}"
                    ) from exc
                log.warning("worker %s: controller unreachable (%s); retrying in %.1f s",
                            self.name, exc, delay)
                faults.hit("startup.retry_wait")
                self._wake.wait(delay)  # drain() (a stop signal) ends it
                delay = min(delay * 2, 5.0)

    # -- reports ---------------------------------------------------------------------------
    def report_drop(
        self, ring: str, slot: int | None, reason: str, item: dict[str, Any] | None
    ) -> None:
        """Tell the controller about an item taken from ``ring`` that will not be run."""
        tid = item.get("task_id") if item is not None else None
        attempt = item.get("attempt") if item is not None else None
        log.error("worker %s: dropped an item of ring %s (task %r): %s", self.name, ring, tid,
                  reason)
        try:
            self.call(Dropped(
                ring=ring,
                slot=slot,
                reason=reason,
                task_id=tid if isinstance(tid, str) else None,
                attempt=attempt if isinstance(attempt, int) and not isinstance(attempt, bool)
                else None,
            ), Empty)
        except ControlRefused as exc:
            log.error("controller refused the drop report: %s", exc)

    def report_failure(
        self, task_id: str, attempt: int, error: str, error_type: str, fault: Fault
    ) -> None:
        """Tell the controller an attempt failed, and whose fault it was."""
        try:
            self.call(Fail(
                task_id=task_id,
                attempt=attempt,
                error=error,
                error_type=error_type,
                retryable=fault in (Fault.SYSTEM, Fault.TRANSFER, Fault.TASK),
                fault=fault.value,
            ), Empty)
        except ControlRefused as exc:
            log.error("controller refused the failure report of %s: %s", task_id, exc)

    def report_fatal(self, error: str) -> None:
        """Tell the controller this worker is exiting on ``error``, so that what it holds is
        back in play at once instead of when its leases expire. At most once per link.

        Over the control connection when one is open (the controller then knows which
        registered worker it was); otherwise (failed at start, before registering, or after
        losing the controller) over a short connection of its own, one attempt."""
        if self._fatal_reported:
            return
        self._fatal_reported = True
        log.error("worker %s: fatal: %s", self.name, error)
        client: ControlChannel = self.control
        try:
            if not client.connected:
                d = self.cfg.disagg_config
                client = ControlClient(d.bootstrap_addr, d.control_port, self.token,
                                       timeout=FATAL_REPORT_TIMEOUT_S)
                client.connect(self.role.value)
            client.call(Fatal(error=error), Empty)
        except DiffringError as exc:
            log.warning("worker %s: the controller did not get the fatal report: %s",
                        self.name, exc)
        finally:
            if client is not self.control:
                client.close()

    def close(self) -> None:
        """Say goodbye (a worker that reported a fatal error already has) and close it all."""
        self.registered = False
        self.heartbeats.stop()
        self.doorbell.interrupt()
        self.doorbell.close()
        try:
            self.call(Bye(), Empty)
        except DiffringError:
            pass
        self.control.close()
        self._close_rings()
