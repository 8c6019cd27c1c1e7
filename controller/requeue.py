"""The controller's side of the request ring: its pushes, and the tasks waiting for room
(window 1 of the ownership argument in :mod:`controller.coordinator`).

A task accepted -- new, put back in play, or restored after a restart -- is pushed to the
request ring at once; when the ring is full it waits here, owned by the controller, and is
pushed at a later sweep. Every push is announced (the doorbell that wakes idle encoders).
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from controller.table import TaskTable
from controller.tasks import Stage, Task
from rings.ring import Ring


class Requeue:
    """Pushes to ``ring`` for ``table``; ``queued`` is called for each task once it is in."""

    def __init__(self, ring: Ring, table: TaskTable, announce: Callable[[str], None],
                 queued: Callable[[Task], None]) -> None:
        self.ring = ring
        self.table = table
        self.announce = announce
        self.queued = queued
        self._waiting: collections.deque[str] = collections.deque()

    def check(self, task: Task) -> None:
        """Raise ``PayloadTooLarge`` if ``task`` can never fit a slot (before accepting it)."""
        self.ring.encode(task.descriptor())

    def push(self, task: Task) -> bool:
        """Push now; False when the ring is full (the caller decides what that means)."""
        pushed = self.ring.try_push(task.descriptor()) is None
        if pushed:
            self.announce("request")
        return pushed

    def later(self, task: Task) -> None:
        """Queue ``task`` (accepted) behind the ones waiting, and push what fits."""
        self._waiting.append(task.task_id)
        self.drain()

    def drain(self) -> None:
        """Push the waiting tasks, in order, until the ring is full."""
        while self._waiting:
            task = self.table.get(self._waiting[0])
            if task is None or task.stage != Stage.ACCEPTED:
                self._waiting.popleft()
                continue
            if not self.push(task):
                return  # ring full: try again at the next sweep
            self._waiting.popleft()
            self.table.queued(task)
            self.queued(task)

    def __len__(self) -> int:
        return len(self._waiting)
