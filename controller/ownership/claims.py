"""Claims: a worker taking a task's lease, and what it reports while it holds it (windows 4
and 5 of the ownership argument in ``coordinator``).

A worker that popped a ring item claims its task here. The claim is granted -- the worker
holds the task's lease (``leases``) until it hands the task off, completes,
fails or is lost -- or refused (an old attempt, a task that moved on or was cancelled), or
deferred (a more urgent task waits in the same ring: ``priorities``). Progress
and a handoff count only from the holder of the current attempt's lease
(:meth:`TaskTable.held`); a zombie's are refused. A handoff rings the next ring's doorbell
whoever reports it: the item is in that ring all the same. Renewing a lease is the
heartbeat's (:meth:`Coordinator.on_heartbeat`); what ends it otherwise -- a failure, the
holder gone, the lease expired -- is ``recovery``'s, the result
``completions``'.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from contracts.roles import ROLE_RINGS, Role
from controller.ownership.leases import Leases
from controller.ownership.outbox import Outbox
from controller.ownership.priorities import Priorities
from controller.ownership.registry import WorkerInfo
from controller.ownership.requeue import Requeue
from controller.tasks.table import TaskTable
from controller.tasks.tasks import TERMINAL, Stage

log = logging.getLogger("diffring.controller")


class Claims:
    """Claims of ``table``'s tasks, with ``leases`` timed on ``clock``. ``priorities`` may
    defer a DiT's claim; ``requeue`` releases more work once a DiT claims; ``emit`` reports a
    task's event and ``announce`` rings a ring's doorbell."""

    def __init__(self, table: TaskTable, leases: Leases, priorities: Priorities,
                 requeue: Requeue, out: Outbox, clock: Callable[[], float]) -> None:
        self.table = table
        self.leases = leases
        self.priorities = priorities
        self.requeue = requeue
        self.out = out
        self.clock = clock

    def claim(self, worker: WorkerInfo, task_id: str, attempt: int) -> tuple[bool, str]:
        """Grant ``worker`` the lease of ``task_id``'s ``attempt``, or say why not (a reason
        starting with :data:`controller.ownership.priorities.DEFERRED`: put the item back)."""
        deferred = self.priorities.defer(worker, task_id, attempt)
        if deferred is not None:
            return False, deferred
        task = self.table.get(task_id)
        was_over = task is not None and task.stage in TERMINAL
        ok, reason = self.table.claim(task_id, attempt, worker.role, worker.name,
                                      worker.worker_id, self.leases.until(self.clock()))
        if ok and task is not None:
            if worker.role == Role.TRANSFORMER:
                self.requeue.drain()  # one fewer ahead of the DiTs
            worker.tasks.add(task_id)
            log.info("task %s stage=%s worker=%s attempt=%d", task_id, task.stage.value,
                     worker.name, attempt)
            self.out.emit("claimed", task)
        elif task is not None and task.stage == Stage.CANCELLED and not was_over:
            # This refusal ended it (cancelled while a worker held it). A task cancelled
            # before was announced then: its leftover items' refusals say nothing more.
            self.out.emit("cancelled", task)
        else:
            log.info("task %s claim by %s refused: %s", task_id, worker.name, reason)
        return ok, reason

    def take(self, worker: WorkerInfo) -> dict[str, Any] | None:
        """A low-noise worker (``split``) asks for a task handed over at the boundary: the
        resume item of one, claimed for it now (no deferral: the task already ran its
        high-noise steps), or None. One synchronous step, so the task goes from the
        controller's hands to ``worker``'s lease with no owner in between."""
        if worker.role != Role.TRANSFORMER or worker.experts != "low":
            return None  # only a worker holding the low-noise expert runs these
        taken = self.requeue.take()
        if taken is None:
            return None
        task, item, waited = taken
        ok, reason = self.table.claim(task.task_id, task.attempt, worker.role, worker.name,
                                      worker.worker_id, self.leases.until(self.clock()))
        if not ok:  # cancelled meanwhile (the table ended it), or never: nothing to run
            log.info("task %s take by %s refused: %s", task.task_id, worker.name, reason)
            if task.stage not in TERMINAL:
                self.requeue.later(task)
            return None
        worker.tasks.add(task.task_id)
        log.info("task %s stage=%s worker=%s attempt=%d (low-noise expert, waited %.3f s)",
                 task.task_id, task.stage.value, worker.name, task.attempt, waited)
        self.out.emit("claimed", task)
        return item

    def progress(self, worker: WorkerInfo, task_id: str, attempt: int, step: int,
                 steps: int, expert: str | None = None) -> bool:
        """Record a denoising step; True when the worker should stop (cancelled, or not its
        lease)."""
        task = self.table.held(task_id, attempt, worker.worker_id)
        if task is None:
            return True
        self.table.progress(task, step, steps, expert)
        self.out.emit("progress", task)
        return task.cancel_requested

    def handoff(self, worker: WorkerInfo, task_id: str, attempt: int) -> None:
        """The holder published to its output ring, then said so (window 5)."""
        # Wake a consumer even for a task the worker no longer holds: the item is there.
        self.out.announce(ROLE_RINGS[worker.role][1])
        worker.tasks.discard(task_id)
        task = self.table.held(task_id, attempt, worker.worker_id)
        if task is None:
            return
        self.table.handoff(task, worker.role)
        log.info("task %s stage=%s from worker=%s", task_id, task.stage.value, worker.name)
        self.out.emit("handoff", task)
