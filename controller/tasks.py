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
server and the lease sweeper all live there), so there is no locking.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from contracts.roles import Role

log = logging.getLogger("diffring.controller.tasks")

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
    """All tasks of one controller, in acceptance order.

    Journal: with a journal folder, every accepted task is appended to ``tasks.jsonl`` (its
    input image kept beside it) before it is queued, and every terminal state after it is
    reached; :meth:`replay` rebuilds the table after a restart, so no accepted task is lost.
    """

    def __init__(self, journal: Path | None = None) -> None:
        self.tasks: OrderedDict[str, Task] = OrderedDict()
        self.journal = journal
        if journal is not None:
            (journal / "images").mkdir(parents=True, exist_ok=True)
        self.completed_times: list[tuple[float, float]] = []  # (finished, e2e seconds)

    # -- bookkeeping ------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.tasks)

    def __iter__(self) -> Iterator[Task]:
        return iter(self.tasks.values())

    def get(self, task_id: str) -> Task | None:
        return self.tasks.get(task_id)

    def add(self, task: Task) -> None:
        if task.task_id in self.tasks:
            raise DuplicateTask(task.task_id)
        self.tasks[task.task_id] = task
        self._journal("accepted", task)

    def forget(self, task: Task) -> None:
        """Drop a task that was refused right after being added (e.g. the ring was full)."""
        self.tasks.pop(task.task_id, None)
        self._journal("rejected", task)

    def in_flight(self) -> int:
        return sum(1 for t in self.tasks.values() if t.stage not in TERMINAL)

    def counts(self) -> dict[str, int]:
        out = {s: 0 for s in ("pending", "processing", "completed", "failed", "cancelled")}
        for t in self.tasks.values():
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
            self._journal(stage.value, task)

    def _journal(self, event: str, task: Task) -> None:
        if self.journal is None:
            return
        image = self.journal / "images" / task.task_id
        if event == "accepted" and task.image_bytes is not None:
            image.write_bytes(task.image_bytes)
        rec = {"event": event, "at": time.time(), "task": _task_record(task)}
        with (self.journal / "tasks.jsonl").open("a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if event != "accepted":
            image.unlink(missing_ok=True)

    def replay(self) -> list[Task]:
        """Rebuild the table from the journal; returns the unfinished tasks, each moved to a
        new attempt (whatever a worker was doing with them died with the old controller)."""
        if self.journal is None or not (self.journal / "tasks.jsonl").exists():
            return []
        last: dict[str, dict[str, Any]] = {}
        with (self.journal / "tasks.jsonl").open() as f:
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
        unfinished = []
        for data in last.values():
            fields = {k: v for k, v in data.items() if k in _TASK_FIELDS}
            task = Task(**fields)
            task.stage = Stage(data["stage"])
            if task.stage not in TERMINAL:
                image = self.journal / "images" / task.task_id
                task.image_bytes = image.read_bytes() if image.exists() else None
                task.image = None
                task.attempt += 1
                task.stage = Stage.ACCEPTED
                task.worker = task.worker_id = None
                task.error = "controller restarted; task put back in play"
                unfinished.append(task)
            self.tasks[task.task_id] = task
        # Compact: one line per task, so the journal does not grow across restarts.
        path = self.journal / "tasks.jsonl"
        tmp = path.with_suffix(".compact")
        with tmp.open("w") as f:
            for task in self.tasks.values():
                f.write(
                    json.dumps({"event": "restored", "at": time.time(), "task": _task_record(task)})
                    + "\n"
                )
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
        log.info("journal: %d task(s) restored, %d back in play", len(last), len(unfinished))
        return unfinished

    # -- lifecycle --------------------------------------------------------------------------
    def queued(self, task: Task) -> None:
        self._set(task, Stage.QUEUED)

    def claim(
        self, task_id: str, attempt: int, role: Role, worker: str, worker_id: int, lease_s: float
    ) -> tuple[bool, str]:
        """A worker claimed this task from its ring: may it go on?"""
        task = self.tasks.get(task_id)
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
        return [
            t for t in self.tasks.values() if t.worker_id == worker_id and t.stage not in TERMINAL
        ]

    def expired(self, now: float) -> list[Task]:
        return [
            t
            for t in self.tasks.values()
            if t.lease_expires is not None and t.lease_expires < now and t.stage not in TERMINAL
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


def _task_record(task: Task) -> dict[str, Any]:
    rec = asdict(task)
    rec["stage"] = task.stage.value
    rec.pop("lease_expires", None)
    rec.pop("image_bytes", None)
    return rec
