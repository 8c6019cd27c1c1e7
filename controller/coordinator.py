"""The controller's coordination logic: tasks in, worker events, leases, requeue, results.

It owns the task table, the controller's own handle on the request ring, the worker
registry, and the result folder. The front door calls ``submit`` / ``cancel``; the control
server calls the ``on_*`` handlers; a sweeper calls ``sweep`` periodically. Everything runs
on the event-loop thread, except what would block it: result files are written on the
``io`` thread pool (:meth:`Coordinator.on_complete` awaits them), and the task store writes
on its own thread (:mod:`controller.store`). So each handler sees the table, the registry and
(over tcp) the ring memory at one instant.

Ownership without gaps
----------------------
At every instant each unfinished task is owned by the controller, by a ring slot, or by a
worker's lease, and the owner is what puts it back in play when it fails:

============================  ======================================  ============="""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contracts import faults
from contracts.errors import DiffringError, ResultWriteBlocked, storage_fault
from contracts.messages import Fault
from contracts.roles import ROLE_RINGS, Role
from controller.budget import Cause, RetryBudget
from controller.reconcile import Census, MissingTracker
from controller.result_writes import ResultWrites
from controller.store import StoreError
from controller.tasks import CLAIMABLE_FROM, TERMINAL, Stage, Task, TaskTable
from rings.ring import Ring

log = logging.getLogger("diffring.controller")


class QueueFull(DiffringError):
    """The request ring (or the in-flight limit) has no room: answer 429."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ControlError(DiffringError):
    """A control-channel request that cannot be honoured (reply ok: False)."""


@dataclass
class WorkerInfo:
    worker_id: int
    role: Role
    name: str
    pid: int
    segment: str
    pipeline: str
    connected_at: float = field(default_factory=time.time)
    last_heartbeat: float = field(default_factory=time.time)
    state: str = "running"
    tasks: set[str] = field(default_factory=set)

    def public(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "role": self.role,
            "name": self.name,
            "pid": self.pid,
            "state": self.state,
            "connected_at": self.connected_at,
            "last_heartbeat": self.last_heartbeat,
            "current_tasks": sorted(self.tasks),
            "segment": self.segment,
        }


class Coordinator:
    """Task lifecycle glue between the front door, the rings and the workers."""

    def __init__(
        self,
        *,
        pipeline: str,
        request_ring: Ring,
        output_dir: Path,
        lease_timeout_s: float,
        heartbeat_interval_s: float,
        max_pending: int,
        stage_image: Callable[[bytes], dict[str, Any]] | None = None,
        release_image: Callable[[Task], None] | None = None,
        journal: Path | None = None,
        max_task_failures: int = 3,
        poison_worker_deaths: int = 3,
        census: Callable[[], Census] | None = None,
        retention_s: float = 86400.0,
        delete_results: bool = False,
    ) -> None:
        self.pipeline = pipeline
        self.request_ring = request_ring
        self.output_dir = output_dir
        self.lease_timeout_s = lease_timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.max_pending = max_pending
        self.stage_image = stage_image
        self.release_image = release_image
        self.table = TaskTable(journal, retention_s=retention_s, delete_results=delete_results)
        self.io = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="results")
        """Result-file writes: off the loop that serves the ring verbs and the control channel."""
        self._completing: dict[str, asyncio.Future[None]] = {}
        """Completions being written, by task: a second one waits for the first to end."""
        self.workers: dict[int, WorkerInfo] = {}
        self._next_worker = 1
        self._requeue: collections.deque[str] = collections.deque()
        self.listeners: list[Callable[[str, Task], None]] = []
        self.on_work: Callable[[str], object] | None = None
        """Called with a ring's name when an item was pushed to it (by this controller, or
        by a producer that reported the handoff): the doorbell that wakes idle workers."""
        self.budget = RetryBudget(max_task_failures, poison_worker_deaths)
        self.census = census
        """Reads the rings this controller hosts (None: nothing to reconcile, e.g. the
        in-process baseline, whose queue hands items over without a gap)."""
        self._missing = MissingTracker()
        self._last_forget = time.monotonic()
        self.recovery: dict[str, int] = dict.fromkeys(
            ("reconciled", "dropped_items", "leases_expired", "workers_lost", "poisoned"), 0)
        """Counters of the recovery paths (shown in the service status)."""
        self.result_writes = ResultWrites()
        """Whether results can be written (the front door refuses new tasks while not)."""

    # -- helpers ---------------------------------------------------------------------------
    def _emit(self, event: str, task: Task) -> None:
        for fn in self.listeners:
            fn(event, task)
        if task.stage in TERMINAL:
            if self.release_image is not None and task.image:
                self.release_image(task)
            task.image = None
            task.image_bytes = None

    def retry_after(self) -> float:
        """Seconds until a slot is likely free, from the measured completion rate."""
        rate = self.table.completion_rate()
        backlog = max(1, self.table.in_flight() - self.max_pending + 1)
        if not rate:
            return 5.0
        return round(min(300.0, max(1.0, backlog / rate)), 1)

    def _push(self, task: Task) -> bool:
        pushed = self.request_ring.try_push(task.descriptor()) is None
        if pushed:
            self._announce("request")
        return pushed

    def _announce(self, ring: str | None) -> None:
        if ring is not None and self.on_work is not None:
            self.on_work(ring)

    def restore(self) -> int:
        """After a restart: reload the journal and put unfinished tasks back in play."""
        unfinished = self.table.replay()
        for task in unfinished:
            if task.image_bytes is not None and self.stage_image is not None:
                task.image = self.stage_image(task.image_bytes)
            self._requeue.append(task.task_id)
        self._drain_requeue()
        return len(unfinished)

    def close(self) -> None:
        """Finish pending result writes and close the task store (commits what is queued)."""
        self.io.shutdown(wait=True)
        self.table.close()

    # -- front door ------------------------------------------------------------------------
    def submit(self, task: Task) -> None:
        """Accept a task and queue it, or raise QueueFull and keep nothing of it."""
        if self.table.in_flight() >= self.max_pending:
            raise QueueFull(
                f"{self.table.in_flight()} tasks in flight (limit {self.max_pending})",
                self.retry_after(),
            )
        body = self.request_ring.encode(task.descriptor())  # PayloadTooLarge before accepting
        del body
        self.table.add(task)
        if not self._push(task):
            self.table.forget(task)
            raise QueueFull("the request ring is full", self.retry_after())
        self.table.queued(task)
        log.info("task %s stage=queued pipeline=%s", task.task_id, task.pipeline)
        self._emit("queued", task)

    def cancel(self, task: Task) -> str:
        """Cancel a task: queued ones never start, running ones stop at the next step."""
        if task.stage in TERMINAL:
            return "do_nothing"
        task.cancel_requested = True
        if task.worker_id is None:
            # Nobody works on it: it waits in a ring (or for a requeue). Whoever claims it
            # next is told to drop it, and releases the buffers its descriptor names.
            self.table.cancelled(task, f"cancelled by the client while {task.stage.value}")
            self._emit("cancelled", task)
        log.info("task %s cancel requested (stage=%s)", task.task_id, task.stage.value)
        return "success"

    # -- control channel -------------------------------------------------------------------
    def on_register(
        self, role: str, name: str, pid: int, pipeline: str, segment: str
    ) -> WorkerInfo:
        if pipeline != self.pipeline:
            raise ControlError(
                f"this controller serves pipeline {self.pipeline!r}; worker {name} is "
                f"configured for {pipeline!r}"
            )
        try:
            known = Role(role)
        except ValueError:
            raise ControlError(f"unknown worker role {role!r}") from None
        wid = self._next_worker
        self._next_worker += 1
        info = WorkerInfo(wid, known, name, pid, segment, pipeline)
        self.workers[wid] = info
        log.info("worker %d registered: %s %s pid=%d segment=%s", wid, role, name, pid, segment)
        self.budget.worker_back(name, self.table)  # it was not killed: its connection dropped
        return info

    def on_heartbeat(
        self, worker: WorkerInfo, tasks: list[str], staged: list[tuple[str, int]]
    ) -> tuple[list[str], list[str]]:
        """Renew the worker's leases. Returns (tasks to stop: cancelled, over, or no longer
        this worker's; staged outputs to free).

        ``staged``: (task_id, attempt) whose outputs the worker still holds in its pool for
        the next stage. The consumer normally releases them after its pull; these are the
        ones nobody will pull any more (task over, attempt superseded, or already past the
        consumer), so the producer frees them itself instead of leaking pool memory.
        """
        worker.last_heartbeat = time.time()
        worker.state = "running"
        self.budget.worker_back(worker.name, self.table)  # it outlived any lease it lost
        self.table.renew(worker.worker_id, self.lease_timeout_s)
        cancel = []
        for tid in tasks:
            t = self.table.get(tid)
            # Not its task any more (its lease expired while it was stalled, say): stop now
            # rather than finish work whose result would be refused.
            if (t is None or t.cancel_requested or t.stage in TERMINAL
                    or t.worker_id != worker.worker_id):
                cancel.append(tid)
        past = {Role.ENCODER: (Stage.PHASE2, Stage.DECODING), Role.TRANSFORMER: ()}
        drop = []
        for tid, attempt in staged:
            t = self.table.get(tid)
            if (
                t is None
                or t.stage in TERMINAL
                or t.attempt != attempt
                or t.stage in past.get(worker.role, ())
            ):
                drop.append(tid)
        return cancel, drop

    def on_claim(self, worker: WorkerInfo, task_id: str, attempt: int) -> tuple[bool, str]:
        ok, reason = self.table.claim(
            task_id, attempt, worker.role, worker.name, worker.worker_id, self.lease_timeout_s
        )
        task = self.table.get(task_id)
        if ok and task is not None:
            worker.tasks.add(task_id)
            log.info(
                "task %s stage=%s worker=%s attempt=%d",
                task_id,
                task.stage.value,
                worker.name,
                attempt,
            )
            self._emit("claimed", task)
        elif task is not None and task.stage == Stage.CANCELLED:
            self._emit("cancelled", task)
        else:
            log.info("task %s claim by %s refused: %s", task_id, worker.name, reason)
        return ok, reason

    def _held(self, worker: WorkerInfo, task_id: str, attempt: int) -> Task | None:
        task = self.table.get(task_id)
        if task is None or not self.table.holds(task, attempt, worker.worker_id):
            return None
        return task

    def on_progress(
        self, worker: WorkerInfo, task_id: str, attempt: int, step: int, steps: int
    ) -> bool:
        """Record a denoising step; returns True when the worker should stop (cancel)."""
        task = self._held(worker, task_id, attempt)
        if task is None:
            return True
        self.table.progress(task, step, steps)
        self._emit("progress", task)
        return task.cancel_requested

    def on_handoff(self, worker: WorkerInfo, task_id: str, attempt: int) -> None:
        # The producer published to its output ring before saying so: wake a consumer
        # (even for a task it no longer holds: the item is in the ring all the same).
        self._announce(ROLE_RINGS[worker.role][1])
        worker.tasks.discard(task_id)
        task = self._held(worker, task_id, attempt)
        if task is None:
            return
        self.table.handoff(task, worker.role)
        log.info("task %s stage=%s from worker=%s", task_id, task.stage.value, worker.name)
        self._emit("handoff", task)

    async def on_complete(
        self,
        worker: WorkerInfo,
        task_id: str,
        attempt: int,
        extension: str,
        media_type: str,
        data: bytes,
    ) -> bool:
        """Write the result file (on ``io``), record the completion, and answer once it is
        durable. Completions of one task are serialised: a second one waits for the first
        and is refused if it won, so a result file is only ever written by the winner."""
        worker.tasks.discard(task_id)
        while (running := self._completing.get(task_id)) is not None:
            await asyncio.wait([running])  # then look again: it may have completed the task
        task = self._held(worker, task_id, attempt)
        if task is None:
            # Completed already, or this worker's lease ran out and the task is another
            # attempt's now: a late result is refused, never a second completion.
            log.info("task %s: result of attempt %d from %s refused (not its lease)",
                     task_id, attempt, worker.name)
            return False
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._completing[task_id] = done
        try:
            return await self._complete(worker, task, attempt, extension, media_type, data)
        finally:
            del self._completing[task_id]
            done.set_result(None)

    async def _complete(
        self, worker: WorkerInfo, task: Task, attempt: int, extension: str, media_type: str,
        data: bytes,
    ) -> bool:
        path = self.result_path(task, extension)
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self.io, _write_result, path, data)
        except OSError as exc:
            if not storage_fault(exc):
                raise
            # The storage's fault: the decoder holds the result and retries (uncharged).
            self.result_writes.failed(f"cannot write {path}: {exc}")
            worker.tasks.add(task.task_id)  # still its task: it sends the result again
            raise ResultWriteBlocked(f"cannot write {path}: {exc}") from exc
        self.result_writes.written()
        if task.stage in TERMINAL or not self.table.holds(task, attempt, worker.worker_id):
            # Cancelled, failed or its lease lost while the file was written: not a result.
            await loop.run_in_executor(self.io, _remove, path)
            return False
        accepted = self.table.complete(task, str(path), media_type)
        if accepted:
            log.info(
                "task %s stage=completed worker=%s attempt=%d result=%s (%d bytes)",
                task.task_id,
                worker.name,
                attempt,
                path,
                len(data),
            )
            self._emit("completed", task)
            durable = self.table.flush()
            if durable is not None:
                try:
                    await asyncio.wrap_future(durable)
                except StoreError as exc:  # the result stands; only its record is at risk
                    log.error("task %s: completion not recorded durably: %s", task.task_id, exc)
        return accepted

    def result_path(self, task: Task, extension: str) -> Path:
        rel = task.save_result_path or f"{task.task_id}.{extension}"
        if not Path(rel).suffix:
            rel = f"{rel}.{extension}"
        return self.output_dir / rel

    def on_fail(
        self,
        worker: WorkerInfo,
        task_id: str,
        attempt: int,
        error: str,
        error_type: str,
        retryable: bool,
        fault: str | None = None,
    ) -> None:
        worker.tasks.discard(task_id)
        task = self._held(worker, task_id, attempt)
        if task is None:
            return  # not this worker's attempt (any more): its failure changes nothing
        log.warning(
            "task %s failed at worker=%s attempt=%d (%s, %s): %s",
            task_id,
            worker.name,
            attempt,
            error_type,
            fault,
            error,
        )
        if fault is None:  # a worker of an older build: only ``retryable``
            fault = Fault.TASK if retryable else Fault.INPUT
        reason = f"{worker.role} {worker.name}: {error}"
        if fault == Fault.CANCELLED or error_type == "cancelled" or task.cancel_requested:
            self.table.cancelled(task, "cancelled by the client while running")
            self._emit("cancelled", task)
        elif fault == Fault.INPUT:
            self.table.failed(task, error, error_type)
            self._emit("failed", task)
        elif fault == Fault.TRANSFER:
            producer = task.producer_id
            if producer is None or not self._alive(producer):
                self._retry(task, f"{reason} (its producer is gone)", Cause.SYSTEM)
            else:
                self.budget.blame_producer(producer, task_id)
                self._retry(task, reason, Cause.TASK)
        else:
            self._retry(task, reason, Cause.TASK if fault == Fault.TASK else Cause.SYSTEM)

    def on_dropped(
        self, worker: WorkerInfo, ring: str, reason: str, task_id: str | None,
        attempt: int | None,
    ) -> None:
        """A worker took an item from ``ring`` that it cannot run (window 3 of the module
        doc). Retry the task it names if it is that task's current item; an item that names
        no task is left to reconciliation."""
        self.recovery["dropped_items"] += 1
        log.warning("worker %s dropped an item of ring %s (task %s attempt %s): %s",
                    worker.name, ring, task_id, attempt, reason)
        task = self.table.get(task_id) if task_id is not None else None
        if (
            task is None
            or task.attempt != attempt
            or task.stage not in CLAIMABLE_FROM[worker.role]
        ):
            return
        self._retry(task, f"{worker.role} {worker.name} dropped its {ring} item: {reason}",
                    Cause.SYSTEM)

    def on_gone(self, worker: WorkerInfo, reason: str) -> None:
        """A worker's control connection dropped or it reported a fatal error."""
        if self.workers.pop(worker.worker_id, None) is None:
            return
        worker.state = "gone"
        self.result_writes.forget(worker.name)
        held = self.table.held_by(worker.worker_id)
        log.warning(
            "worker %d (%s %s) gone: %s; %d task(s) back in play",
            worker.worker_id,
            worker.role,
            worker.name,
            reason,
            len(held),
        )
        self.budget.producer_gone(worker.worker_id, self.table)
        for task in held:
            self.recovery["workers_lost"] += 1
            self._retry(task, f"{worker.role} {worker.name} {reason} while {task.stage.value}",
                        Cause.WORKER_LOST, worker.name)

    def _alive(self, worker_id: int) -> bool:
        """Registered and heard from lately (a hung producer serves no reads either)."""
        w = self.workers.get(worker_id)
        return w is not None and time.time() - w.last_heartbeat <= 3 * self.heartbeat_interval_s

    def _retry(self, task: Task, reason: str, cause: Cause = Cause.SYSTEM,
               worker: str | None = None) -> None:
        if task.stage in TERMINAL:
            return
        exhausted = None
        if not task.cancel_requested:
            exhausted = self.budget.charge(task, reason, cause, worker)
        if exhausted is not None:
            self.recovery["poisoned"] += exhausted == "poison"
            log.error("task %s failed: %s", task.task_id, task.error)
            self.table.failed(task, task.error or reason, exhausted)
            self._emit("failed", task)
        elif self.table.retry(task, reason):
            if task.image_bytes is not None and self.stage_image is not None:
                # The encoder of the failed attempt may have released the staged copy
                # already; stage the kept bytes afresh (freeing the old block is safe: it
                # only frees the allocation the descriptor names, if still live).
                if self.release_image is not None and task.image:
                    self.release_image(task)
                task.image = self.stage_image(task.image_bytes)
            self._requeue.append(task.task_id)
            self._drain_requeue()
        else:
            self._emit("failed" if task.stage == Stage.FAILED else "cancelled", task)

    def _drain_requeue(self) -> None:
        while self._requeue:
            task = self.table.get(self._requeue[0])
            if task is None or task.stage != Stage.ACCEPTED:
                self._requeue.popleft()
                continue
            if not self._push(task):
                return  # ring full: try again at the next sweep
            self._requeue.popleft()
            self.table.queued(task)
            self._emit("queued", task)

    # -- periodic --------------------------------------------------------------------------
    def sweep(self) -> None:
        """Expire leases whose worker stopped heartbeating, reconcile the table with the
        rings, push pending requeues."""
        now = time.monotonic()
        for task in self.table.expired(now):
            worker = self.workers.get(task.worker_id or -1)
            name = worker.name if worker else "?"
            self.recovery["leases_expired"] += 1
            self._retry(task, f"lease of worker {name} expired while {task.stage.value}",
                        Cause.WORKER_LOST, name)
        silent = time.time() - self.lease_timeout_s
        for w in self.workers.values():
            if w.last_heartbeat < silent:
                w.state = "silent"
        if self.census is not None:
            self.reconcile(self.census(), now)
        self._drain_requeue()

    def reconcile(self, present: Census, now: float) -> int:
        """Put back in play every task missing from its ring for ``lease_timeout_s``
        (window 2 of the module doc); returns how many. ``present``: what the rings hold,
        read on this thread just now, so no claim can land between that read and this."""
        lost = self._missing.lost(self.table, present, now, self.lease_timeout_s)
        for task, ring, gone in lost:
            self.recovery["reconciled"] += 1
            self._retry(task, f"its {ring} ring item was taken and never claimed (missing for "
                              f"{gone:.1f} s)", Cause.SYSTEM)
        if now - self._last_forget > 60:
            self._last_forget = now
            self.budget.forget_finished(self.table)
        return len(lost)

    def workers_by_role(self) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {role.value: [] for role in Role}
        for w in self.workers.values():
            out.setdefault(w.role, []).append(w.public())
        return out


def _write_result(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".part")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        faults.hit("controller.result_write", faults.no_space)
        tmp.write_bytes(data)
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)  # a partial file takes the room a retry needs
        raise


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)
