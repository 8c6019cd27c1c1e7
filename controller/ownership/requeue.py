"""The controller's side of the rings it feeds: its pushes, and the tasks waiting for room
(window 1 of the ownership argument in :mod:`controller.ownership.coordinator`).

A task accepted -- new, put back in play, or restored after a restart -- is pushed at once;
when its ring is full, or when ``limit()`` tasks of its priority class or a higher one are
already between the controller and a DiT's claim (queued, encoding, encoded: ``release_ahead``
keeps the rings shallow), it waits here, owned by the controller, and is pushed later (a
sweep, a DiT's claim, a worker joining). Waiting tasks are released highest priority first,
oldest first within a class (:mod:`contracts.priority`).

Where a task goes is its :class:`Route`: the request ring (from the start), or, when the
controller keeps a checkpoint of it (:mod:`controller.tasks.checkpoints`), an item the controller
makes itself -- the Phase1 ring for a DiT to resume the loop, the Phase2 ring for a decoder
to decode kept final latents (window 8). Every push is announced (the doorbell that wakes
idle workers of that ring).

One route is no ring: :data:`LOW`, a task handed over at Wan2.2-A14B's boundary by a
high-noise worker of the ``split`` placement (its checkpoint's next expert is the low-noise
one). It stays here, waiting and owned by the controller like any accepted task, until a
low-noise worker asks for one (:meth:`Requeue.take`), which claims it in the same step: ring
claims are FIFO, so a shared ring would let a high-noise worker pop it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from contracts.priority import PRIORITIES, rank
from controller.ownership.outbox import Outbox
from controller.tasks.table import TaskTable
from controller.tasks.tasks import Stage, Task
from rings.ring import Ring

LOW = "low"
"""The route of a task waiting for a low-noise worker (``split``): held here, not a ring."""

AHEAD = (Stage.QUEUED, Stage.ENCODING, Stage.PHASE1)
"""The stages of a task released and not yet claimed by a DiT (what ``limit()`` bounds)."""


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
    phase2) for ``table``; each task once in is reported to ``out`` (``queued``, or
    ``resumed`` from a checkpoint); ``route(task)`` says where a task resumes (None: from the
    start)."""

    def __init__(self, ring: Ring, table: TaskTable, out: Outbox, *,
                 rings: Mapping[str, Ring] | None = None,
                 route: Callable[[Task], Route | None] | None = None,
                 limit: Callable[[], int | None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ring = ring
        self.table = table
        self.out = out
        self.rings: dict[str, Any] = {"request": ring, **(rings or {})}
        self.route = route
        self.limit = limit
        """Tasks of a class and up that may be ahead of the DiTs (None: no bound)."""
        self.clock = clock
        self._waiting: dict[str, int] = {}
        """Waiting task ids, by arrival number (their order within a class)."""
        self._arrival = itertools.count()

    def check(self, task: Task) -> None:
        """Raise ``PayloadTooLarge`` if ``task`` can never fit a slot (before accepting it)."""
        self.ring.encode(task.descriptor())

    def _route(self, task: Task) -> Route:
        resumed = self.route(task) if self.route is not None else None
        if resumed is not None and (resumed.ring in self.rings or resumed.ring == LOW):
            return resumed
        return Route("request", task.descriptor(), Stage.QUEUED)

    def push(self, task: Task, route: Route | None = None) -> bool:
        """Push now (to ``route``: the one :meth:`_route` gives, built once by a caller that
        has it), and mark it waiting in that ring; False when the ring is full (the caller
        decides what that means)."""
        route = route or self._route(task)
        if self.rings[route.ring].try_push(route.item) is not None:
            return False
        if route.stage == Stage.QUEUED:
            self.table.queued(task)
        else:
            self.table.resumed(task, route.stage, route.step)
        self.out.announce(route.ring)
        return True

    def later(self, task: Task) -> None:
        """Queue ``task`` (accepted) among the ones waiting, and push what may go."""
        self._waiting.setdefault(task.task_id, next(self._arrival))
        if task.waiting_since is None:  # its attempt starts waiting (what preemption times)
            task.waiting_since = self.clock()
        self.drain()

    def _bound(self) -> int:
        limit = self.limit()
        return 1 << 62 if limit is None else limit

    def _ahead(self) -> list[int]:
        """Released tasks not yet claimed by a DiT, of each class and up."""
        counts = [0] * len(PRIORITIES)
        for t in self.table:
            if t.stage in AHEAD:
                counts[rank(t.priority)] += 1
        return [sum(counts[r:]) for r in range(len(counts))]

    def drain(self) -> None:
        """Push the waiting tasks, highest priority and oldest first, while their rings and
        the bound have room."""
        waiting = []
        for tid, n in list(self._waiting.items()):
            task = self.table.get(tid)
            if task is None or task.stage != Stage.ACCEPTED:
                del self._waiting[tid]
            else:
                waiting.append((-rank(task.priority), n, task))
        if not waiting:
            return
        bound, ahead = self._bound(), self._ahead()
        full: set[str] = set()
        for _, _, task in sorted(waiting, key=lambda w: w[:2]):
            mine = rank(task.priority)
            route = self._route(task)
            task.waiting_expert = "low" if route.ring == LOW else None  # (for the status)
            if route.ring == LOW:
                continue  # a low-noise worker takes it (take)
            counted = route.ring != "phase2"  # a decode-only resume is not ahead of a DiT
            if route.ring in full or (counted and ahead[mine] >= bound):
                continue  # a later sweep, claim or registration tries again
            if not self.push(task, route):
                full.add(route.ring)
                continue
            del self._waiting[task.task_id]
            if counted:
                for r in range(mine + 1):
                    ahead[r] += 1
            self.out.emit("queued" if task.stage == Stage.QUEUED else "resumed", task)

    def take(self) -> tuple[Task, dict[str, Any], float] | None:
        """The most urgent (then oldest) task waiting for a low-noise worker, now in its
        Phase1 stage as a pushed resume item would be, its resume item and the seconds it
        waited (since it was handed back); None when none waits. The caller claims it for
        the asking worker before it returns to the event loop: from the controller's hands
        to the worker's lease, with nothing between."""
        found = []
        for tid, n in self._waiting.items():
            task = self.table.get(tid)
            if task is None or task.stage != Stage.ACCEPTED:
                continue
            route = self._route(task)
            if route.ring == LOW:
                found.append((-rank(task.priority), n, tid, task, route))
        if not found:
            return None
        _, _, tid, task, route = min(found, key=lambda f: f[:2])
        del self._waiting[tid]
        task.waiting_expert = None
        since = task.waiting_since
        waited = 0.0 if since is None else self.clock() - since
        self.table.resumed(task, route.stage, route.step)
        self.out.emit("resumed", task)
        return task, route.item, waited

    def low_waiting(self) -> int:
        """Tasks waiting for a low-noise worker (``split``)."""
        return sum(1 for tid in self._waiting if (t := self.table.get(tid)) is not None
                   and t.stage == Stage.ACCEPTED and self._route(t).ring == LOW)

    def __len__(self) -> int:
        return len(self._waiting)
