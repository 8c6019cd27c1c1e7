"""The controller's task table: the source of truth for every task's lifecycle.

    accepted -> queued -> encoding -> phase1 -> denoising (step k/n) -> phase2 -> decoding
             -> completed | failed | cancelled

``status`` is LightX2V's coarse view (pending / processing / completed / failed /
cancelled); ``stage`` the fine one above. Attempts: a task put back in play (its worker died,
its lease expired, its ring item was lost, its attempt failed) gets ``attempt + 1``; the
attempt number fences work: an older attempt's claim, progress, handoff or result is refused.
Completion is idempotent: the first one wins, later ones are ignored. The retry budget (which
attempts count, when a task is failed or quarantined) is the coordinator's
(:mod:`controller.coordinator`); this table only counts (``failures``, ``killers``).

Everything here runs on the controller's event-loop thread (the front door, the control
server and the lease sweeper all live there), so there is no locking. Durability lives in
:mod:`controller.store`: every state change is handed to its writer thread (nothing here
waits for a disk), and a caller that must not answer before a change is durable waits on the
future the table hands out (:meth:`TaskTable.durable`, :meth:`TaskTable.flush`).

Memory holds the unfinished tasks and the last ``RECENT_FINISHED`` finished ones; every
other finished task lives only in the store until its retention window ends
(:meth:`TaskTable.lookup`, :meth:`TaskTable.page`), so a long-running controller's memory
does not grow with the number of tasks it has served.
"""

from __future__ import annotations

import concurrent.futures
import enum
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from contracts.roles import Role
from controller.store import TaskStore

log = logging.getLogger("diffring.controller.tasks")

RECENT_FINISHED = 1024
"""Finished tasks kept in memory as well as in the store (clients poll them right after)."""


class Stage(enum.StrEnum):
    ACCEPTED = "accepted"
    QUEUED = "queued"
    ENCODING = "encoding"
    PHASE1 = "phase1"
    DENOISING = "denoising"
    PHASE2 = "phase2"
    DECODING = "decoding"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL = {Stage.COMPLETED, Stage.FAILED, Stage.CANCELLED}
# The stage a task is in while a worker of each role holds it, and after its handoff.
WORKING_STAGE = {
    Role.ENCODER: Stage.ENCODING,
    Role.TRANSFORMER: Stage.DENOISING,
    Role.DECODER: Stage.DECODING,
}
HANDOFF_STAGE = {Role.ENCODER: Stage.PHASE1, Role.TRANSFORMER: Stage.PHASE2}
# Which stages a claim of each role is valid from. A worker publishes to the next ring
# before its handoff message reaches the controller, so the next stage may claim the ring
# item first: the item itself proves the handoff, and the late message is then ignored.
CLAIMABLE_FROM = {
    Role.ENCODER: (Stage.QUEUED,),
    Role.TRANSFORMER: (Stage.PHASE1, Stage.ENCODING),
    Role.DECODER: (Stage.PHASE2, Stage.DENOISING),
}
# The ring a task waits in, with no lease, in each waiting stage (what reconciliation checks).
WAITING_RING = {Stage.QUEUED: "request", Stage.PHASE1: "phase1", Stage.PHASE2: "phase2"}


def coarse_status(stage: Stage) -> str:
    if stage in (Stage.ACCEPTED, Stage.QUEUED):
        return "pending"
    if stage in TERMINAL:
        return stage.value
    return "processing"


@dataclass
class Task:
    """One task as the controller tracks it."""

    task_id: str
    kind: str  # "image" or "video"
    pipeline: str
    request: dict[str, Any]
    save_result_path: str
    image: dict[str, Any] | None = None  # staged input image descriptor
    image_bytes: bytes | None = field(default=None, repr=False)  # kept to re-stage on retry
    stage: Stage = Stage.ACCEPTED
    attempt: int = 1
    step: int = 0
    steps: int = 0
    worker: str | None = None
    worker_id: int | None = None
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    updated_at: float = field(default_factory=time.time)
    error: str | None = None
    error_type: str | None = None
    result_path: str | None = None
    media_type: str | None = None
    cancel_requested: bool = False
    lease_expires: float | None = None  # monotonic
    stage_times: dict[str, float] = field(default_factory=dict)
    failures: int = 0  # attempts the task itself failed (counted against max_task_failures)
    killers: list[str] = field(default_factory=list)  # workers lost in a row holding it
    producer_id: int | None = None  # worker that staged this attempt's inputs of its stage

    @property
    def status(self) -> str:
        return coarse_status(self.stage)

    def descriptor(self) -> dict[str, Any]:
        """The request-ring payload of this task's current attempt."""
        return {
            "kind": "task",
            "task_id": self.task_id,
            "attempt": self.attempt,
            "pipeline": self.pipeline,
            "request": self.request,
            "image": self.image,
        }

    def public(self) -> dict[str, Any]:
        """What the status endpoint shows."""
        return {
            "task_id": self.task_id,
            "status": self.status,
            "stage": self.stage.value,
            "step": self.step,
            "steps": self.steps,
            "attempt": self.attempt,
            "worker": self.worker,
            "start_time": self.started_at,
            "end_time": self.finished_at,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "error": self.error,
            "error_type": self.error_type,
            "failures": self.failures,
            "save_result_path": self.save_result_path,
            "stage_times": self.stage_times,
        }


class DuplicateTask(Exception):
    """A task with this id exists already."""


class TaskTable:
    """All tasks of one controller: the unfinished ones (and the last few finished) in
    memory, in acceptance order; every task in the store (:mod:`controller.store`).

    With a journal folder, every state change is written to the store: an accepted task
    (its input image with it) before it is acknowledged, every stage change after it, and a
    finished task until the retention window ends; :meth:`replay` rebuilds the table after
    a restart, so no accepted task is lost.
    """

    def __init__(
        self,
        journal: Path | None = None,
        *,
        retention_s: float = 86400.0,
        delete_results: bool = False,
    ) -> None:
        self.tasks: OrderedDict[str, Task] = OrderedDict()  # unfinished, acceptance order
        self.recent: OrderedDict[str, Task] = OrderedDict()  # the last finished ones
        self.finished_counts = {s: 0 for s in ("completed", "failed", "cancelled")}
        self.journal = journal
        self.store: TaskStore | None = None
        if journal is not None:
            self.store = TaskStore(journal, retention_s=retention_s,
                                   delete_results=delete_results)
            self.store.open()
        self._durable: dict[str, concurrent.futures.Future[None]] = {}
        self.completed_times: list[tuple[float, float]] = []  # (finished, e2e seconds)

    def close(self) -> None:
        """Commit every queued change and close the store."""
        if self.store is not None:
            self.store.close()

    # -- bookkeeping ------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.tasks)

    def __iter__(self) -> Iterator[Task]:
        """The unfinished tasks, in acceptance order."""
        return iter(list(self.tasks.values()))

    def get(self, task_id: str) -> Task | None:
        """A task in memory: unfinished, or among the last finished ones."""
        return self.tasks.get(task_id) or self.recent.get(task_id)

    def lookup(self, task_id: str) -> Task | None:
        """A task in memory or, failing that, in the store (blocking read: call it off the
        event loop, e.g. on ``store.reads``)."""
        task = self.get(task_id)
        if task is None and self.store is not None:
            rec = self.store.get(task_id)
            task = None if rec is None else task_from_record(rec)
        return task

    def page(self, status: str | None, offset: int, limit: int) -> tuple[int, list[Task]]:
        """(total, one page) of the stored tasks in acceptance order, the live ones as they
        are in memory (blocking read, like :meth:`lookup`)."""
        if self.store is None:
            tasks = [t for t in (*self.recent.values(), *self.tasks.values())
                     if status is None or t.status == status]
            tasks.sort(key=lambda t: t.created_at)
            return len(tasks), tasks[offset : offset + limit]
        total, records = self.store.page(status, offset, limit)
        return total, [self.get(r["task_id"]) or task_from_record(r) for r in records]

    def add(self, task: Task) -> None:
        if self.get(task.task_id) is not None:
            raise DuplicateTask(task.task_id)
        self.tasks[task.task_id] = task
        fut = self._journal("accepted", task)
        if fut is not None:
            self._durable[task.task_id] = fut

    def durable(self, task_id: str) -> concurrent.futures.Future[None] | None:
        """The future of an accepted task's first write (None without a store): resolves
        when the task is durable, raises ``StoreError`` / ``StoreConflict`` if it cannot be."""
        return self._durable.pop(task_id, None)

    def flush(self, durable: bool = True) -> concurrent.futures.Future[None] | None:
        """Resolves once every change made so far is committed — and durable, unless
        ``durable`` is False (enough to read them back); None without a store."""
        return None if self.store is None else self.store.barrier(durable)

    def forget(self, task: Task) -> None:
        """Drop a task that was refused right after being added (e.g. the ring was full)."""
        self.tasks.pop(task.task_id, None)
        self._durable.pop(task.task_id, None)
        self._journal("rejected", task)

    def in_flight(self) -> int:
        return len(self.tasks)  # only unfinished tasks are in it (_finished moves them out)

    def counts(self) -> dict[str, int]:
        """Tasks by status: the unfinished in memory, the finished ones still stored."""
        out = {s: 0 for s in ("pending", "processing")}
        out.update(self.finished_counts)
        # list(): the metrics thread calls this while the loop may change the dict.
        for t in list(self.tasks.values()):
            out[t.status] += 1
        return out

    def queue_position(self, task: Task) -> int | None:
        """1-based position among tasks waiting for an encoder, or None when not queued."""
        if task.stage not in (Stage.ACCEPTED, Stage.QUEUED):
            return None
        pos = 0
        for t in self.tasks.values():
            if t.stage in (Stage.ACCEPTED, Stage.QUEUED):
                pos += 1
            if t is task:
                return pos
        return None

    def _set(self, task: Task, stage: Stage) -> None:
        now = time.time()
        task.stage_times[stage.value] = now
        task.stage = stage
        task.updated_at = now
        if stage in TERMINAL:
            task.finished_at = now
            task.lease_expires = None
            task.worker_id = None
            if stage == Stage.COMPLETED:
                self.completed_times.append((now, now - task.created_at))
                del self.completed_times[:-256]
            self._finished(task)
        # "accepted" is the event that inserts a task; a retry back to that stage updates it.
        self._journal("requeued" if stage == Stage.ACCEPTED else stage.value, task)

    def _finished(self, task: Task) -> None:
        """A task reached a terminal stage: out of the live table, into the recent ones."""
        self._durable.pop(task.task_id, None)
        if self.tasks.pop(task.task_id, None) is None:
            return
        self.finished_counts[task.status] += 1
        self.recent[task.task_id] = task
        while len(self.recent) > RECENT_FINISHED:
            self.recent.popitem(last=False)

    def _journal(self, event: str, task: Task) -> concurrent.futures.Future[None] | None:
        if self.store is None:
            return None
        rec = _task_record(task)
        fixed = {k: rec.pop(k) for k in _FIXED_FIELDS} if event == "accepted" else None
        return self.store.put(
            event,
            task.task_id,
            status=task.status,
            stage=task.stage.value,
            attempt=task.attempt,
            finished_at=task.finished_at if task.stage in TERMINAL else None,
            result_path=task.result_path,
            state=rec,
            fixed=fixed,
            image=task.image_bytes if event == "accepted" else None,
        )

    def prune(self, now: float | None = None) -> concurrent.futures.Future[dict[str, int]] | None:
        """Drop finished tasks past the retention window at ``now`` (wall clock; default:
        the current time) from the store (None without one); hand the result to
        :meth:`pruned` on the loop."""
        return None if self.store is None else self.store.prune(now)

    def pruned(self, gone: dict[str, int], now: float | None = None) -> None:
        """Account for what a prune removed; recent tasks past the window (at ``now``, as
        the prune) leave memory too, so status, list and counts agree on what is
        forgotten."""
        for status, n in gone.items():
            if status in self.finished_counts:
                self.finished_counts[status] = max(0, self.finished_counts[status] - n)
        if self.store is not None:
            cutoff = (time.time() if now is None else now) - self.store.retention_s
            for tid in [t.task_id for t in self.recent.values()
                        if t.finished_at is not None and t.finished_at < cutoff]:
                del self.recent[tid]

    def replay(self) -> list[Task]:
        """Rebuild the table from the store; returns the unfinished tasks, each moved to a
        new attempt (whatever a worker was doing with them died with the old controller).
        Finished tasks stay in the store (status and result still served from there)."""
        if self.store is None or self.journal is None:
            return []
        self._import_jsonl(self.journal)
        restored = self.store.load()
        self.finished_counts = {s: restored.counts.get(s, 0) for s in self.finished_counts}
        unfinished = []
        for data in restored.unfinished:
            task = task_from_record(data)
            task.image_bytes = restored.images.get(task.task_id)
            task.image = None
            task.attempt += 1
            task.stage = Stage.ACCEPTED
            task.worker = task.worker_id = None
            task.error = "controller restarted; task put back in play"
            unfinished.append(task)
            self.tasks[task.task_id] = task
            self._journal("restored", task)
        log.info(
            "task store: %d unfinished task(s) back in play, %d finished kept (%s)",
            len(unfinished),
            sum(self.finished_counts.values()),
            ", ".join(f"{k} {v}" for k, v in self.finished_counts.items()),
        )
        return unfinished

    def _import_jsonl(self, journal: Path) -> None:
        """Move the JSON-lines journal of an older controller into the store, once."""
        path = journal / "tasks.jsonl"
        if self.store is None or not path.exists():
            return
        last: dict[str, dict[str, Any]] = {}
        with path.open() as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    log.warning("journal: skipping a torn line (crash while writing it)")
                    continue
                if rec["event"] == "rejected":
                    last.pop(rec["task"]["task_id"], None)
                else:
                    last[rec["task"]["task_id"]] = rec["task"]
        futures = []
        for data in last.values():
            task = task_from_record(data)
            if self.store.get(task.task_id) is not None:
                continue  # imported already (a restart interrupted the import)
            if task.stage not in TERMINAL:
                image = journal / "images" / task.task_id
                task.image_bytes = image.read_bytes() if image.exists() else None
            futures.append(self._journal("accepted", task))
            if task.stage == Stage.COMPLETED:
                futures.append(self._journal("completed", task))
        for fut in futures:
            if fut is not None:
                fut.result()
        path.rename(path.with_name("tasks.jsonl.imported"))
        for image in (journal / "images").glob("*"):
            image.unlink(missing_ok=True)
        log.info("journal: imported %d task(s) from %s into the task store", len(last), path)

    # -- lifecycle --------------------------------------------------------------------------
    def queued(self, task: Task) -> None:
        self._set(task, Stage.QUEUED)

    def claim(
        self, task_id: str, attempt: int, role: Role, worker: str, worker_id: int, lease_s: float
    ) -> tuple[bool, str]:
        """A worker claimed this task from its ring: may it go on?"""
        task = self.get(task_id)
        if task is None:
            return False, "unknown task"
        if task.stage in TERMINAL:
            return False, f"task is {task.stage.value}"
        if task.cancel_requested:
            self.cancelled(task, "cancelled before it started this stage")
            return False, "task was cancelled"
        if attempt != task.attempt:
            return False, f"stale attempt {attempt} (current attempt is {task.attempt})"
        if task.stage not in CLAIMABLE_FROM[role]:
            return False, f"task is {task.stage.value}, not waiting for a {role}"
        waiting = CLAIMABLE_FROM[role][0]
        if role == Role.ENCODER:
            task.producer_id = None  # a new attempt starts from the request
        elif task.stage != waiting:  # the handoff message is still on its way
            task.producer_id = task.worker_id
            self._set(task, waiting)
        task.worker, task.worker_id = worker, worker_id
        task.lease_expires = time.monotonic() + lease_s
        if task.started_at is None:
            task.started_at = time.time()
        self._set(task, WORKING_STAGE[role])
        return True, "ok"

    def holds(self, task: Task, attempt: int, worker_id: int) -> bool:
        return (
            task.stage not in TERMINAL and task.attempt == attempt and task.worker_id == worker_id
        )

    def progress(self, task: Task, step: int, steps: int) -> None:
        task.step, task.steps = step, steps
        task.updated_at = time.time()

    def handoff(self, task: Task, role: Role) -> None:
        task.producer_id = task.worker_id
        task.worker_id = None
        task.lease_expires = None
        self._set(task, HANDOFF_STAGE[role])

    def complete(self, task: Task, result_path: str, media_type: str) -> bool:
        if task.stage in TERMINAL:
            return False
        task.result_path, task.media_type = result_path, media_type
        self._set(task, Stage.COMPLETED)
        return True

    def failed(self, task: Task, error: str, error_type: str) -> None:
        if task.stage in TERMINAL:
            return
        task.error, task.error_type = error, error_type
        self._set(task, Stage.FAILED)

    def cancelled(self, task: Task, reason: str) -> None:
        if task.stage in TERMINAL:
            return
        task.error, task.error_type = reason, "cancelled"
        self._set(task, Stage.CANCELLED)

    def retry(self, task: Task, reason: str) -> bool:
        """Put a task back in play (new attempt); False when it is over (or was cancelled).
        Whether it may be retried at all is the coordinator's call (the retry budget)."""
        if task.stage in TERMINAL:
            return False
        if task.cancel_requested:
            self.cancelled(task, "cancelled")
            return False
        log.warning("task %s attempt %d: %s; retrying", task.task_id, task.attempt, reason)
        task.attempt += 1
        task.worker = None
        task.worker_id = None
        task.lease_expires = None
        task.step = 0
        task.error = reason
        self._set(task, Stage.ACCEPTED)
        return True

    def held_by(self, worker_id: int) -> list[Task]:
        # Only unfinished tasks are in self.tasks (_finished moves them out).
        return [t for t in self.tasks.values() if t.worker_id == worker_id]

    def expired(self, now: float) -> list[Task]:
        return [
            t
            for t in self.tasks.values()
            if t.lease_expires is not None and t.lease_expires < now
        ]

    def renew(self, worker_id: int, lease_s: float) -> None:
        deadline = time.monotonic() + lease_s
        for t in self.held_by(worker_id):
            t.lease_expires = deadline

    def completion_rate(self, window_s: float = 300.0) -> float | None:
        """Tasks completed per second over the last window (None before the first)."""
        now = time.time()
        recent = [f for f, _ in self.completed_times if now - f <= window_s]
        if len(recent) < 2:
            return None
        span = max(now - min(recent), 1e-3)
        return len(recent) / span


_TASK_FIELDS = {f.name for f in fields(Task)} - {"stage", "image_bytes", "lease_expires"}
# Written once, when the task is accepted; the rest is rewritten at every state change.
_FIXED_FIELDS = ("kind", "pipeline", "request", "save_result_path", "created_at")
_RECORD_FIELDS = tuple(sorted(_TASK_FIELDS - {"image"}))


def _task_record(task: Task) -> dict[str, Any]:
    """A task as the store keeps it (serialised at once by the store, so no copy is needed).
    The staged image descriptor is left out: it means nothing to a restarted controller."""
    rec = {name: getattr(task, name) for name in _RECORD_FIELDS}
    rec["stage"] = task.stage.value
    return rec


def task_from_record(data: dict[str, Any]) -> Task:
    """A task rebuilt from its stored record (the store, or an old JSON-lines journal)."""
    task = Task(**{k: v for k, v in data.items() if k in _TASK_FIELDS})
    task.stage = Stage(data["stage"])
    return task
