"""Priorities at the DiT: which encoded task a free DiT takes, and when a running one is
preempted (the release order before that is :mod:`controller.ownership.requeue`'s).

Two moves, both at a step boundary or a claim, never in the middle of work:

* *Claim order.* The Phase1 ring is first in, first out, and a task's place in it is fixed
  when its encoder publishes. So when a DiT claims a task while a task of a higher class
  waits encoded in that ring, the claim is *deferred*: the DiT puts the item back at the
  ring's tail (unclaimed: no lease, the slot owns it again) and pops the next, until it
  reaches the urgent one. At most :data:`MAX_DEFERRALS` in a row per worker, so a lost item
  (that reconciliation will put back) cannot keep a DiT turning the ring.
* *Preemption.* A task encoded and waiting for a DiT ``preempt_after_s`` since its attempt
  was accepted, while every DiT worker is busy and at least one runs a task of a lower
  class, gets one of those to yield (``yield`` in the progress and heartbeat replies): the
  lowest class first, then the one with most steps left. The DiT checkpoints at its next
  step boundary and hands the task back (fault ``yielded``, uncharged), then its next claim
  is deferred until it reaches the urgent task. Only DiTs that checkpoint are asked; a task
  is preempted at most ``max_preemptions`` times (then it runs to its end), and at most one
  yield is outstanding per urgent task.
"""

from __future__ import annotations

import logging

from contracts.priority import rank
from contracts.roles import Role
from controller.ownership.outbox import Outbox
from controller.ownership.registry import WorkerInfo, WorkerRegistry
from controller.tasks.table import TaskTable
from controller.tasks.tasks import Stage, Task

log = logging.getLogger("diffring.controller")

MAX_DEFERRALS = 16
"""Claims of one DiT deferred in a row at most before it takes what it popped."""
DEFERRED = "deferred"
"""How a deferred claim's reason starts (the worker puts the item back)."""


class Priorities:
    """Claim order and preemption for ``table``'s tasks and ``registry``'s DiTs; ``emit``
    reports a ``preempting`` event."""

    def __init__(self, table: TaskTable, registry: WorkerRegistry,
                 out: Outbox, preempt_after_s: float | None,
                 max_preemptions: int) -> None:
        self.table = table
        self.registry = registry
        self.out = out
        self.preempt_after_s = preempt_after_s
        self.max_preemptions = max_preemptions
        self.counts = {"deferred": 0, "preemptions": 0}
        self._deferrals: dict[int, int] = {}

    def defer(self, worker: WorkerInfo, task_id: str, attempt: int) -> str | None:
        """Why ``worker`` (a DiT) should put ``task_id``'s item of ``attempt`` back (None:
        claim it -- an item of an old attempt is refused by the claim, never put back)."""
        task = self.table.get(task_id)
        if (worker.role != Role.TRANSFORMER or task is None or task.stage != Stage.PHASE1
                or task.attempt != attempt):
            return None
        mine = rank(task.priority)
        urgent = next((t for t in self.table if t.stage == Stage.PHASE1
                       and rank(t.priority) > mine), None)
        n = self._deferrals.get(worker.worker_id, 0)
        if urgent is None or n >= MAX_DEFERRALS:
            self._deferrals.pop(worker.worker_id, None)
            return None
        self._deferrals[worker.worker_id] = n + 1
        self.counts["deferred"] += 1
        return f"{DEFERRED}: {urgent.priority} task {urgent.task_id} waits in the same ring"

    def asked(self, task_ids: list[str]) -> list[str]:
        """Of ``task_ids`` (a DiT's), those it should hand back at the next step boundary."""
        return [tid for tid in task_ids
                if (t := self.table.get(tid)) is not None and t.yield_requested]

    def yielded(self, task: Task) -> bool:
        """``task``'s DiT handed it back; True when that was a preemption (counted)."""
        if not task.yield_requested:
            return False
        task.preemptions += 1
        self.counts["preemptions"] += 1
        return True

    def sweep(self, now: float) -> Task | None:
        """Ask one DiT to yield if a task waits too long behind lower-priority work; the
        task asked to yield, or None."""
        if self.preempt_after_s is None:
            return None
        # The Phase1 ring's DiTs (split: not the low-noise ones, which cannot run the
        # waiting tasks; a task waiting for one of those does not preempt).
        dits = [w for w in self.registry if w.role == Role.TRANSFORMER and w.experts != "low"]
        running = {t.worker_id: t for t in self.table
                   if t.stage == Stage.DENOISING and t.worker_id is not None}
        if not dits or any(w.worker_id not in running for w in dits):
            return None  # a free DiT takes the waiting task without anyone yielding
        urgent = sorted((t for t in self.table if t.stage == Stage.PHASE1
                         and t.waiting_since is not None
                         and now - t.waiting_since >= self.preempt_after_s),
                        key=lambda t: (-rank(t.priority), t.waiting_since))
        outstanding = sum(t.yield_requested for t in running.values())
        if len(urgent) <= outstanding:
            return None
        top = rank(urgent[outstanding].priority)
        victims = [t for t in (running[w.worker_id] for w in dits if w.checkpoints)
                   if not t.yield_requested and rank(t.priority) < top
                   and t.preemptions < self.max_preemptions]
        if not victims:
            return None
        victim = min(victims, key=lambda t: (rank(t.priority), -(t.steps - t.step)))
        victim.yield_requested = True
        log.info("task %s (%s, step %d/%d on %s) asked to yield for %s task %s", victim.task_id,
                 victim.priority, victim.step, victim.steps, victim.worker,
                 urgent[outstanding].priority, urgent[outstanding].task_id)
        self.out.emit("preempting", victim)
        return victim
