"""Checkpoints on the coordinator's side (window 8 of the ownership argument in
:mod:`controller.ownership.coordinator`): which DiT may keep a task's checkpoint, where a task with
one starts its next attempt, and what a resuming DiT fetches. The tensors themselves are
:mod:`controller.tasks.checkpoints`' (the store)."""

from __future__ import annotations

import logging
from typing import Any

from contracts.errors import DiffringError
from contracts.messages import Checkpoint as CheckpointMsg
from contracts.messages import CheckpointReply
from controller.errors import ControlError
from controller.ownership.outbox import Outbox
from controller.ownership.registry import WorkerInfo
from controller.ownership.requeue import LOW, Route
from controller.tasks.checkpoints import Checkpoint, CheckpointStore
from controller.tasks.table import TaskTable
from controller.tasks.tasks import Stage, Task
from tensorplane.descriptor import TensorDescriptor

log = logging.getLogger("diffring.controller")


class Resumes:
    """The checkpoints of ``table``'s tasks in ``store`` (None: none are kept); ``emit``
    reports a task's ``checkpoint`` event."""

    def __init__(self, store: CheckpointStore | None, table: TaskTable,
                 out: Outbox) -> None:
        self.store = store
        self.table = table
        self.out = out

    def may_keep(self, worker: WorkerInfo, task_id: str, attempt: int, final: bool
                 ) -> Task | None:
        """The task, if ``worker`` may keep a checkpoint of it now: the lease holder of its
        current attempt, or (final latents) the producer of that attempt's Phase2 item."""
        task = self.table.get(task_id)
        if task is None:
            return None
        if self.table.holds(task, attempt, worker.worker_id):
            return task
        if final and task.attempt == attempt and task.producer_id == worker.worker_id \
                and task.stage in (Stage.PHASE2, Stage.DECODING):  # (neither is terminal)
            return task
        return None

    async def keep(self, worker: WorkerInfo, msg: CheckpointMsg) -> CheckpointReply:
        """A ``checkpoint`` message: pull and keep it, or say why not."""
        store = self.store
        tid, attempt, final, step, steps = msg.task_id, msg.attempt, msg.final, msg.step, msg.steps
        if store is None:
            return CheckpointReply(accepted=False, reason="this controller keeps no "
                                   "checkpoints (checkpoint_store_mb is 0)")
        if self.may_keep(worker, tid, attempt, final) is None:
            return CheckpointReply(accepted=False,
                                   reason=f"attempt {attempt} is not {worker.name}'s")
        phase1 = msg.phase1
        if phase1 is None and not final and not store.has_phase1(tid):
            return CheckpointReply(accepted=False,
                                   reason="no encoder outputs kept: send them too")
        try:
            kept1, kept = await store.pull(
                tid, None if phase1 is None else [TensorDescriptor.from_dict(d) for d in phase1],
                [TensorDescriptor.from_dict(d) for d in msg.state], worker.worker_id)
        except DiffringError as exc:
            store.counts["refused"] += 1
            log.warning("task %s: checkpoint of step %d refused: %s", tid, step, exc)
            return CheckpointReply(accepted=False, reason=str(exc))
        task = self.may_keep(worker, tid, attempt, final)
        if task is None:  # the attempt ended during the pull: never replace its successor's
            store.discard(kept1, kept)
            return CheckpointReply(accepted=False, reason=f"attempt {attempt} ended meanwhile")
        ckpt = Checkpoint(step, steps, final, dict(msg.meta), kept, attempt)
        store.put(tid, ckpt, kept1)
        task.checkpoint_step = step
        log.info("task %s: %s of step %d/%d kept from %s (%d bytes)", tid,
                 "final latents" if final else "checkpoint", step, steps, worker.name,
                 ckpt.nbytes)
        self.out.emit("checkpoint", task)
        return CheckpointReply(accepted=True)

    def fetch(self, worker: WorkerInfo, task_id: str, attempt: int) -> dict[str, Any]:
        """What the lease holder of a resumed attempt fetches (``resume``); ControlError
        for anyone else, or when nothing is kept."""
        if self.table.held(task_id, attempt, worker.worker_id) is None:
            raise ControlError(f"task {task_id} attempt {attempt} is not {worker.name}'s")
        reply = self.store.resume_reply(task_id) if self.store is not None else None
        if reply is None:
            raise ControlError(f"no checkpoint of task {task_id} is kept (attempt {attempt})")
        return reply

    def route(self, task: Task) -> Route | None:
        """Where ``task``'s next attempt starts, from its kept checkpoint (None: the request
        ring, from the start)."""
        ckpt = self.store.get(task.task_id) if self.store is not None else None
        if ckpt is None:
            return None
        item = {"task_id": task.task_id, "attempt": task.attempt, "pipeline": task.pipeline,
                "request": task.request, "producer": "controller"}
        if ckpt.final:
            return Route("phase2", {"kind": "phase2", **item,
                                    "tensors": [k.desc.to_dict() for k in ckpt.state]},
                         Stage.PHASE2, ckpt.step)
        # split: a state whose next expert is the low-noise one, made by a worker holding
        # one expert, waits for a low-noise worker (requeue.LOW); any other for any DiT.
        low = ckpt.meta.get("split") is True and ckpt.meta.get("expert") == "low"
        return Route(LOW if low else "phase1",
                     {"kind": "phase1", **item, "tensors": [],
                      "resume": {"step": ckpt.step, "steps": ckpt.steps}},
                     Stage.PHASE1, ckpt.step)

    def load(self, unfinished: list[Task]) -> None:
        """After a restart: keep the checkpoints the files hold of ``unfinished`` tasks."""
        if self.store is None:
            return
        self.store.load(t.task_id for t in unfinished)
        for task in unfinished:
            ckpt = self.store.get(task.task_id)
            task.checkpoint_step = ckpt.step if ckpt is not None else None

    def worker_gone(self, worker: WorkerInfo) -> None:
        """``worker`` is gone: its checkpoint pulls and releases still to do are dropped."""
        if self.store is not None:
            self.store.forget(worker.worker_id)

    def drop(self, task: Task) -> None:
        """``task``'s checkpoint cannot be resumed: forget it (it starts over)."""
        if self.store is not None and self.store.drop(task.task_id):
            log.warning("task %s: its checkpoint cannot be resumed; dropped", task.task_id)
        task.checkpoint_step = None
