"""Finished tasks: where a completed, failed or cancelled task is found once it left the live
table.

Memory keeps the last :data:`RECENT_FINISHED` (clients poll a task right after it ends);
every finished task stays in the task store until its retention window ends, and is read
from there (:meth:`FinishedTasks.lookup`, :meth:`FinishedTasks.page`: blocking reads, run off
the event loop on ``store.reads``), so a long-running controller's memory does not grow with
the number of tasks it has served. Without a store (a controller with no task store) memory
is all there is.
"""

from __future__ import annotations

import concurrent.futures
from collections import OrderedDict
from collections.abc import Mapping

from controller.tasks.store import TaskStore
from controller.tasks.tasks import Task, task_from_record

RECENT_FINISHED = 1024
"""Finished tasks kept in memory as well as in the store."""
FINISHED = ("completed", "failed", "cancelled")


class FinishedTasks:
    """The finished tasks of one table: the recent ones in memory, counts by status, and the
    store's rows of the others."""

    def __init__(self, store: TaskStore | None) -> None:
        self.store = store
        self.recent: OrderedDict[str, Task] = OrderedDict()
        self.counts = dict.fromkeys(FINISHED, 0)
        """Finished tasks still within the retention window, by status."""

    def add(self, task: Task) -> None:
        """``task`` just reached a terminal stage."""
        self.counts[task.status] += 1
        self.recent[task.task_id] = task
        while len(self.recent) > RECENT_FINISHED:
            self.recent.popitem(last=False)

    def get(self, task_id: str) -> Task | None:
        return self.recent.get(task_id)

    def restored(self, counts: Mapping[str, int]) -> None:
        """After a restart: the counts of what the store kept."""
        self.counts = {s: counts.get(s, 0) for s in FINISHED}

    def lookup(self, task_id: str) -> Task | None:
        """A finished task's record in the store (blocking), or None."""
        rec = None if self.store is None else self.store.get(task_id)
        return None if rec is None else task_from_record(rec)

    def page(self, status: str | None, offset: int, limit: int, live: Mapping[str, Task],
             newest_first: bool = False) -> tuple[int, list[Task]]:
        """(total, one page) of every task in acceptance order (``newest_first``: the
        reverse), finished or ``live`` (those as the very objects in memory, whose counters
        move); blocking, like :meth:`lookup`."""
        if self.store is None:
            tasks = [t for t in (*self.recent.values(), *live.values())
                     if status is None or t.status == status]
            tasks.sort(key=lambda t: t.created_at, reverse=newest_first)
            return len(tasks), tasks[offset : offset + limit]
        total, records = self.store.page(status, offset, limit, newest_first)
        return total, [live.get(r["task_id"]) or self.recent.get(r["task_id"])
                       or task_from_record(r) for r in records]

    def prune(self, now: float) -> concurrent.futures.Future[dict[str, int]] | None:
        """Drop the rows finished before the retention window (None without a store); hand
        the result to :meth:`pruned` on the loop."""
        return None if self.store is None else self.store.prune(now)

    def pruned(self, gone: Mapping[str, int], now: float) -> None:
        """Account for what a prune removed; recent tasks past the window leave memory too,
        so status, list and counts agree on what is forgotten."""
        for status, n in gone.items():
            if status in self.counts:
                self.counts[status] = max(0, self.counts[status] - n)
        if self.store is not None:
            cutoff = now - self.store.retention_s
            for tid in [t.task_id for t in self.recent.values()
                        if t.finished_at is not None and t.finished_at < cutoff]:
                del self.recent[tid]
