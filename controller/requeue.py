"""The controller's side of the rings it feeds: its pushes, and the tasks waiting for room
(window 1 of the ownership argument in :mod:`controller.coordinator`).

A task accepted -- new, put back in play, or restored after a restart -- is pushed at once;
when its ring is full it waits here, owned by the controller, and is pushed at a later
sweep. Where it goes is its :class:`Route`: the request ring (from the start), or, when the
controller keeps a checkpoint of it (:mod:`controller.checkpoints`), an item the controller
makes itself -- the Phase1 ring for a DiT to resume the loop, the Phase2 ring for a decoder
to decode kept final latents (window 8). Every push is announced (the doorbell that wakes
idle workers of that ring).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from controller.table import TaskTable
from controller.tasks import Stage, Task
from rings.ring import Ring


@dataclass(frozen=True)
class Route:
    """Where a task's next attempt starts: ``ring`` and the item pushed there, and the
    stage (and step) it is in once pushed."""

    ring: str
    item: dict[str, Any]
    stage: Stage
    step: int = 0


class Requeue:
    """Pushes to ``ring`` (the request ring) and, for resumes, to ``rings`` (phase1 /
    phase2) for ``table``; ``queued`` is called for each task once it is in; ``route(task)``
    says where a task resumes (None: from the start)."""

    def __init__(self, ring: Ring, table: TaskTable, announce: Callable[[str], None],
                 queued: Callable[[Task], None], *, rings: Mapping[str, Ring] | None = None,
                 route: Callable[[Task], Route | None] | None = None) -> None:
        self.ring = ring
        self.table = table
        self.announce = announce
        self.queued = queued
        self.rings: dict[str, Any] = {"request": ring, **(rings or {})}
        self.route = route
        self._waiting: collections.deque[str] = collections.deque()

    def check(self, task: Task) -> None:
        """Raise ``PayloadTooLarge`` if ``task`` can never fit a slot (before accepting it)."""
        self.ring.encode(task.descriptor())

    def _route(self, task: Task) -> Route:
        resumed = self.route(task) if self.route is not None else None
        if resumed is not None and resumed.ring in self.rings:
            return resumed
        return Route("request", task.descriptor(), Stage.QUEUED)

    def push(self, task: Task) -> bool:
        """Push now, and mark it waiting in that ring; False when the ring is full (the
        caller decides what that means)."""
        route = self._route(task)
        if self.rings[route.ring].try_push(route.item) is not None:
            return False
        if route.stage == Stage.QUEUED:
            self.table.queued(task)
        else:
            self.table.resumed(task, route.stage, route.step)
        self.announce(route.ring)
        return True

    def later(self, task: Task) -> None:
        """Queue ``task`` (accepted) behind the ones waiting, and push what fits."""
        self._waiting.append(task.task_id)
        self.drain()

    def drain(self) -> None:
        """Push the waiting tasks, in order, until a ring is full."""
        while self._waiting:
            task = self.table.get(self._waiting[0])
            if task is None or task.stage != Stage.ACCEPTED:
                self._waiting.popleft()
                continue
            if not self.push(task):
                return  # ring full: try again at the next sweep
            self._waiting.popleft()
            self.queued(task)

    def __len__(self) -> int:
        return len(self._waiting)
