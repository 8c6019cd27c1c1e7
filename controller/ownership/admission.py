"""Admission: a new task accepted and queued, or refused keeping nothing of it (window 1 of
the ownership argument in ``coordinator``).

A task is refused while ``max_pending`` tasks are in flight (``QueueFull``, with a
Retry-After estimated from the measured completion rate) or when it can never fit a ring
slot. Accepted, it is added to the table -- whose journal hands its row to the task store
-- and, in the same turn of the event loop, pushed to the request ring and marked queued,
or (``release_ahead`` set) left waiting in the requeue (``requeue``), owned by
the controller, to be released in priority order. A full ring refuses it too, and the row
is deleted again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from controller.errors import QueueFull
from controller.ownership.outbox import Outbox
from controller.ownership.rates import CompletionRate
from controller.ownership.requeue import Requeue
from controller.tasks.table import TaskTable
from controller.tasks.tasks import Task

log = logging.getLogger("diffring.controller")


class Admission:
    """New tasks into ``table``, at most ``max_pending`` in flight, pushed by ``requeue``
    (``release_ahead`` set: released by it in priority order); ``rates`` (on ``clock``)
    estimates when a refused client should try again; ``emit`` reports ``queued``."""

    def __init__(self, table: TaskTable, requeue: Requeue, rates: CompletionRate,
                 out: Outbox, clock: Callable[[], float], *,
                 max_pending: int, release_ahead: int | None) -> None:
        self.table = table
        self.requeue = requeue
        self.rates = rates
        self.out = out
        self.clock = clock
        self.max_pending = max_pending
        self.release_ahead = release_ahead

    def retry_after(self) -> float:
        """Seconds until a slot is likely free, from the measured completion rate."""
        rate = self.rates.per_second(self.clock())
        backlog = max(1, self.table.in_flight() - self.max_pending + 1)
        if not rate:
            return 5.0
        return round(min(300.0, max(1.0, backlog / rate)), 1)

    def submit(self, task: Task) -> None:
        """Accept ``task`` and queue it, or raise QueueFull and keep nothing of it."""
        limit = self.max_pending
        if self.table.in_flight() >= limit:
            raise QueueFull(f"{self.table.in_flight()} tasks in flight (limit {limit})",
                            self.retry_after())
        self.requeue.check(task)
        self.table.add(task)
        if self.release_ahead is not None:  # released in priority order, shallow
            log.info("task %s accepted pipeline=%s priority=%s", task.task_id, task.pipeline,
                     task.priority)
            self.requeue.later(task)
            return
        task.waiting_since = self.clock()  # (Requeue.later sets it on the other paths)
        if not self.requeue.push(task):
            self.table.forget(task)
            raise QueueFull("the request ring is full", self.retry_after())
        log.info("task %s stage=queued pipeline=%s", task.task_id, task.pipeline)
        self.out.emit("queued", task)
