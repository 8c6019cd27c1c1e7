"""The retry budget: which ended attempts a task is charged for, and when it has had enough.

A task put back in play is charged by the cause of the ended attempt (:class:`Cause`):

- the system's faults are free: a lost or dropped ring item, a transfer from a producer that
  is gone, a controller restart, a revoked ring claim, an injected fault;
- a failure the task causes counts -- its stage raised, its tensors failed their checksum, a
  transfer failed while its producer was alive -- and the ``max_task_failures``-th fails it
  (``retries_exhausted``);
- the loss of the worker holding it (connection dropped, lease expired) puts that worker on
  the task's ``killers``; ``poison_worker_deaths`` of them in a row -- with no attempt ending
  otherwise in between -- quarantine it as poison (``poison``).

Two charges are undone when the controller learns better: a worker that is heard from
again -- it registers again under the same name (same host and pid) after its connection
dropped, or heartbeats again after its lease expired (stalled, starved of CPU) -- was not
killed, so it leaves the ``killers`` of the tasks it lost; and a transfer failure charged
while its producer still looked alive is refunded when that producer's connection then drops
(its buffer was dying).
"""

from __future__ import annotations

import enum
import logging

from controller.tasks.table import TaskTable
from controller.tasks.tasks import TERMINAL, Task

log = logging.getLogger("diffring.controller")


class Cause(enum.Enum):
    """Why an attempt ended, as the retry budget sees it."""

    SYSTEM = "system"
    """The infrastructure's fault: free."""
    TASK = "task"
    """The task's fault: counts against ``max_task_failures``."""
    WORKER_LOST = "worker_lost"
    """The worker holding it vanished: counts towards ``poison_worker_deaths`` in a row."""


class RetryBudget:
    """Charges ended attempts to tasks (``Task.failures``, ``Task.killers``)."""

    def __init__(self, max_task_failures: int, poison_worker_deaths: int) -> None:
        self.max_task_failures = max_task_failures
        self.poison_worker_deaths = poison_worker_deaths
        # Only to undo a charge: worker name -> tasks whose killers list it; producer worker
        # id -> tasks charged a transfer failure while it looked alive.
        self._lost_by: dict[str, set[str]] = {}
        self._blamed_producer: dict[int, set[str]] = {}
        self.refunded = 0

    def charge(self, task: Task, reason: str, cause: Cause, worker: str | None = None
               ) -> str | None:
        """Charge the attempt that just ended; returns the error type when the task has had
        enough (``task.error`` then says why), None when it may be retried."""
        if cause is Cause.TASK:
            task.failures += 1
            task.killers.clear()  # this attempt ended without killing its worker
            if task.failures >= self.max_task_failures:
                task.error = (f"{reason}; the task failed {task.failures} times "
                              f"(max_task_failures={self.max_task_failures})")
                return "retries_exhausted"
        elif cause is Cause.SYSTEM:
            task.killers.clear()  # nor did this one: the row is broken
        elif cause is Cause.WORKER_LOST:
            name = worker or "?"
            task.killers.append(name)
            self._lost_by.setdefault(name, set()).add(task.task_id)
            if len(task.killers) >= self.poison_worker_deaths:
                task.error = (
                    f"quarantined as poison: its last {len(task.killers)} attempts each lost "
                    f"the worker holding it ({', '.join(task.killers)}); last: {reason}"
                )
                return "poison"
        return None

    def blame_producer(self, producer_id: int, task_id: str) -> None:
        """A transfer from live producer ``producer_id`` failed and was charged to the task."""
        self._blamed_producer.setdefault(producer_id, set()).add(task_id)

    def worker_back(self, name: str, table: TaskTable) -> None:
        """Worker ``name`` was heard from again: it was never killed. (Called on every
        heartbeat: a dict lookup unless it lost a task.)"""
        for tid in self._lost_by.pop(name, ()):
            task = table.get(tid)
            if task is not None and name in task.killers:
                task.killers.remove(name)
                self.refunded += 1

    def producer_gone(self, worker_id: int, table: TaskTable) -> None:
        """Worker ``worker_id`` is gone: the transfers from it that failed meanwhile failed
        because it was dying."""
        for tid in self._blamed_producer.pop(worker_id, ()):
            task = table.get(tid)
            if task is not None and task.stage not in TERMINAL and task.failures > 0:
                task.failures -= 1
                self.refunded += 1
                log.info("task %s: transfer failure refunded (its producer died)", tid)

    def forget_finished(self, table: TaskTable) -> None:
        """Drop the undo records of tasks that are over (keeps the maps bounded)."""

        def live(tids: set[str]) -> set[str]:
            return {t for t in tids if (task := table.get(t)) and task.stage not in TERMINAL}

        self._lost_by = {k: v for k, t in self._lost_by.items() if (v := live(t))}
        self._blamed_producer = {k: v for k, t in self._blamed_producer.items() if (v := live(t))}
