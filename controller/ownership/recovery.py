"""Putting tasks back in play when their owner fails (windows 2, 3, 4 and 6 of the ownership
argument in ``coordinator``; a reported failure or a yield, and the checkpoint
a new attempt resumes from, of window 8), each charged to its retry budget
(``budget``) by the cause of the ended attempt.

The coordinator decides *that* an owner failed (a dropped connection, an expired lease, a
reported failure, a census of the rings); this module does what follows: a new attempt
requeued with its input image staged afresh, or the task failed when its budget is spent,
and a count of each path for the service status.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from contracts.messages import Fault
from controller.ownership.budget import Cause, RetryBudget
from controller.ownership.outbox import Outbox
from controller.ownership.reconcile import Census, MissingTracker
from controller.ownership.registry import WorkerInfo
from controller.ownership.requeue import Requeue
from controller.tasks.table import TaskTable
from controller.tasks.tasks import CLAIMABLE_FROM, TERMINAL, Stage, Task

log = logging.getLogger("diffring.controller")

FORGET_EVERY_S = 60.0
"""How often the retry budget drops the undo records of finished tasks."""
PATHS = ("reconciled", "dropped_items", "leases_expired", "workers_lost", "poisoned")


class Recovery:
    """Retries of one table's tasks; ``emit`` reports a task's lifecycle event, ``restage``
    stages a retried task's kept input image for its new attempt."""

    def __init__(self, table: TaskTable, budget: RetryBudget, requeue: Requeue,
                 out: Outbox, restage: Callable[[Task], None],
                 grace_s: float, now: float) -> None:
        self.table = table
        self.budget = budget
        self.requeue = requeue
        self.out = out
        self.restage = restage
        self.grace_s = grace_s
        self.counts: dict[str, int] = dict.fromkeys(PATHS, 0)
        """How often each recovery path ran (shown in the service status)."""
        self._missing = MissingTracker()
        self._last_forget = now

    def retry(self, task: Task, reason: str, cause: Cause = Cause.SYSTEM,
              worker: str | None = None) -> None:
        """Put ``task`` back in play in a new attempt, or fail it if its budget is spent."""
        if task.stage in TERMINAL:
            return
        exhausted = None
        if not task.cancel_requested:
            exhausted = self.budget.charge(task, reason, cause, worker)
        if exhausted is not None:
            self.counts["poisoned"] += exhausted == "poison"
            log.error("task %s failed: %s", task.task_id, task.error)
            self.table.failed(task, task.error or reason, exhausted)
            self.out.emit("failed", task)
        elif self.table.retry(task, reason):
            self.restage(task)
            self.requeue.later(task)
        else:
            self.out.emit("failed" if task.stage == Stage.FAILED else "cancelled", task)

    def failed(self, task: Task, reason: str, error: str, error_type: str, fault: str, *,
               alive: Callable[[int], bool], drop: Callable[[Task], None],
               preempted: Callable[[Task], bool]) -> None:
        """The holder of ``task``'s attempt reported it failed, and whose ``fault`` it was:
        cancelled, failed for good, or retried -- charged only for the task's own faults.
        ``alive(worker_id)``: is a producer still there; ``drop(task)`` forgets its
        checkpoint; ``preempted(task)``: was a yield a preemption (counts it)."""
        if fault == Fault.CANCELLED or error_type == "cancelled" or task.cancel_requested:
            self.table.cancelled(task, "cancelled by the client while running")
            self.out.emit("cancelled", task)
        elif fault == Fault.INPUT:
            self.table.failed(task, error, error_type)
            self.out.emit("failed", task)
        elif fault == Fault.HANDOVER:  # window 8, split: for a worker of the other expert
            self.out.emit("handover", task)
            self.retry(task, reason, Cause.SYSTEM)
        elif fault == Fault.YIELDED:  # window 8: drained or preempted, its state kept
            self.out.emit("preempted" if preempted(task) else "yielded", task)
            self.retry(task, reason, Cause.SYSTEM)
        elif error_type == "CheckpointError" or (
                fault == Fault.TRANSFER and task.resumed_from is not None
                and task.producer_id is None):
            # Window 8: its kept checkpoint cannot be resumed: start over, uncharged.
            drop(task)
            self.retry(task, f"{reason} (its checkpoint is dropped)", Cause.SYSTEM)
        elif fault == Fault.TRANSFER:  # window 6
            producer = task.producer_id
            if producer is None or not alive(producer):
                self.retry(task, f"{reason} (its producer is gone)", Cause.SYSTEM)
            else:
                self.budget.blame_producer(producer, task.task_id)
                self.retry(task, reason, Cause.TASK)
        else:
            self.retry(task, reason, Cause.TASK if fault == Fault.TASK else Cause.SYSTEM)

    def worker_lost(self, worker: WorkerInfo, reason: str, held: list[Task]) -> None:
        """``worker`` is gone (window 4): the tasks it held go back in play, and the
        transfer failures charged while it looked alive are refunded (window 6)."""
        self.budget.producer_gone(worker.worker_id, self.table)
        for task in held:
            self.counts["workers_lost"] += 1
            self.retry(task, f"{worker.role} {worker.name} {reason} while {task.stage.value}",
                       Cause.WORKER_LOST, worker.name)

    def leases_expired(self, tasks: list[Task], holder: Callable[[Task], str]) -> None:
        """Window 4: ``tasks``' holders stopped heartbeating; ``holder`` names each one's."""
        for task in tasks:
            name = holder(task)
            self.counts["leases_expired"] += 1
            self.retry(task, f"lease of worker {name} expired while {task.stage.value}",
                       Cause.WORKER_LOST, name)

    def dropped(self, worker: WorkerInfo, ring: str, reason: str, task_id: str | None,
                attempt: int | None) -> None:
        """Window 3: retry the task the dropped item names if it is that task's current
        item, waiting for this worker's role; an item that names no task is left to 2."""
        self.counts["dropped_items"] += 1
        task = self.table.get(task_id) if task_id is not None else None
        if task is None or task.attempt != attempt or task.stage not in CLAIMABLE_FROM[worker.role]:
            return
        self.retry(task, f"{worker.role} {worker.name} dropped its {ring} item: {reason}",
                   Cause.SYSTEM)

    def reconcile(self, present: Census, now: float) -> int:
        """Window 2: put back in play every task missing from its ring for the grace;
        returns how many."""
        lost = self._missing.lost(self.table, present, now, self.grace_s)
        for task, ring, gone in lost:
            self.counts["reconciled"] += 1
            self.retry(task, f"its {ring} ring item was taken and never claimed (missing for "
                             f"{gone:.1f} s)", Cause.SYSTEM)
        if now - self._last_forget > FORGET_EVERY_S:
            self._last_forget = now
            self.budget.forget_finished(self.table)
        return len(lost)
