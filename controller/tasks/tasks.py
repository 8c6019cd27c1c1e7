"""A task as the controller tracks it, its stages, and its record in the task store.

    accepted -> queued -> encoding -> phase1 -> denoising (step k/n) -> phase2 -> decoding
             -> completed | failed | cancelled

``status`` is LightX2V's coarse view (pending / processing / completed / failed /
cancelled); ``stage`` the fine one above. A task is ``pending`` whenever it waits for a
worker -- of the next stage too: in ``phase1`` it waits for a DiT, in ``phase2`` for a
decoder (``waiting_for`` names the role) -- and ``processing`` only while a worker holds
it, so a queue of tasks behind one DiT reads as one running and the rest waiting.
Attempts: a task put back in play (its worker died, its lease expired, its ring item was
lost, its attempt failed) gets ``attempt + 1``; the attempt number fences work: an older
attempt's claim, progress, handoff or result is refused.

Who changes a task: :class:`controller.tasks.table.TaskTable` (the lifecycle of the live
ones),
:mod:`controller.ownership.leases` (claim deadlines), :mod:`controller.tasks.history` (the
finished ones),
:mod:`controller.tasks.journal` (their rows in the store); the retry budget
(:mod:`controller.ownership.budget`) decides which ended attempts count.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, fields
from typing import Any

from contracts.roles import Role


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
# The role a task waits for in each stage where no worker holds it (ACCEPTED: not yet
# released into the request ring, or put back after a retry).
WAITING_FOR = {
    Stage.ACCEPTED: Role.ENCODER,
    Stage.QUEUED: Role.ENCODER,
    Stage.PHASE1: Role.TRANSFORMER,
    Stage.PHASE2: Role.DECODER,
}


def waiting_for(task: Task) -> str | None:
    """The role ``task`` waits for (None: it waits for none): a DiT for a task handed over
    at Wan2.2-A14B's boundary (``split``: it waits accepted, at the controller)."""
    if task.waiting_expert is not None and task.stage == Stage.ACCEPTED:
        return Role.TRANSFORMER.value
    waiting = WAITING_FOR.get(task.stage)
    return waiting.value if waiting is not None else None


def coarse_status(stage: Stage) -> str:
    """LightX2V's word for ``stage``: pending while waiting for any stage's worker,
    processing while one holds it."""
    if stage in WAITING_FOR:
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
    priority: str = "normal"  # its class (controller.priority): the order of release
    checkpoint_step: int | None = None  # step of its latest kept checkpoint (None: none)
    resumed_from: int | None = None  # step its current attempt resumed from (None: start)
    resumes: int = 0  # attempts started from a kept checkpoint
    preemptions: int = 0  # times it handed its DiT back for a more urgent task
    yield_requested: bool = False  # its DiT was asked to yield (preemption under way)
    waiting_since: float | None = None  # monotonic: its current attempt began waiting
    expert: str | None = None  # Wan2.2-A14B: the expert of its last step (high / low)
    waiting_expert: str | None = None  # split: it waits (accepted) for a DiT of this expert

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
            "expert": self.expert,
            "attempt": self.attempt,
            "worker": self.worker,
            "start_time": self.started_at,
            "end_time": self.finished_at,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "error": self.error,
            "error_type": self.error_type,
            "failures": self.failures,
            "priority": self.priority,
            "checkpoint_step": self.checkpoint_step,
            "resumed_from": self.resumed_from,
            "resumes": self.resumes,
            "preemptions": self.preemptions,
            "save_result_path": self.save_result_path,
            "stage_times": self.stage_times,
        }


class DuplicateTask(Exception):
    """A task with this id exists already."""


_TASK_FIELDS = {f.name for f in fields(Task)} - {"stage", "image_bytes", "lease_expires",
                                                  "yield_requested", "waiting_since",
                                                  "waiting_expert"}
FIXED_FIELDS = ("kind", "pipeline", "request", "save_result_path", "created_at")
"""Written once, when the task is accepted; the rest is rewritten at every state change."""
_RECORD_FIELDS = tuple(sorted(_TASK_FIELDS - {"image"}))


def task_record(task: Task) -> dict[str, Any]:
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
