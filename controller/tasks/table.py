"""The controller's task table: the live tasks and every step of their lifecycle.

The table holds the unfinished tasks, in acceptance order, and is their source of truth;
each change is journaled (:mod:`controller.tasks.journal`) as it happens, and a task that reaches
a terminal stage moves to :mod:`controller.tasks.history`. Completion is idempotent: the first one
wins, later ones are ignored. Which ended attempts count against a task is the retry
budget's (:mod:`controller.ownership.budget`); claim deadlines are
:mod:`controller.ownership.leases`'.

Everything here runs on the controller's event-loop thread (the front door, the control
server and the sweeper all live there), so there is no locking. Built with no I/O;
:func:`open_table` opens the store a table journals to, and is called by whoever assembles
the controller (the table is then handed to the coordinator).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from pathlib import Path

from contracts.priority import rank
from contracts.roles import Role
from controller.tasks.history import FinishedTasks
from controller.tasks.journal import TaskJournal
from controller.tasks.migrate import import_jsonl
from controller.tasks.store import TaskStore
from controller.tasks.tasks import (
    CLAIMABLE_FROM,
    HANDOFF_STAGE,
    TERMINAL,
    WAITING_FOR,
    WORKING_STAGE,
    DuplicateTask,
    Stage,
    Task,
    task_from_record,
)

log = logging.getLogger("diffring.controller.tasks")

_PAST_THE_CONSUMER = {Role.ENCODER: (Stage.PHASE2, Stage.DECODING), Role.TRANSFORMER: ()}
"""Stages in which a producer's staged outputs have been pulled already (or never will be)."""


def open_table(
    folder: Path | None, *, retention_s: float = 86400.0, delete_results: bool = False
) -> TaskTable:
    """A table journaled to the task store in ``folder`` (opened here: schema, the folder's
    lock, the writer thread), or kept in memory only when ``folder`` is None."""
    if folder is None:
        return TaskTable()
    store = TaskStore(folder, retention_s=retention_s, delete_results=delete_results)
    store.open()
    return TaskTable(TaskJournal(store))


class TaskTable:
    """All unfinished tasks of one controller, and the way to find the finished ones."""

    def __init__(self, journal: TaskJournal | None = None) -> None:
        self.journal = journal or TaskJournal()
        self.tasks: OrderedDict[str, Task] = OrderedDict()
        """The unfinished tasks, in acceptance order (:meth:`_finished` moves them out)."""
        self.history = FinishedTasks(self.journal.store)

    def close(self) -> None:
        """Commit every queued change and close the store."""
        self.journal.close()

    # -- finding tasks ----------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.tasks)

    def __iter__(self) -> Iterator[Task]:
        """The unfinished tasks, in acceptance order."""
        return iter(list(self.tasks.values()))

    def get(self, task_id: str) -> Task | None:
        """A task in memory: unfinished, or among the last finished ones."""
        return self.tasks.get(task_id) or self.history.get(task_id)

    def lookup(self, task_id: str) -> Task | None:
        """A task in memory or, failing that, in the store (blocking read: call it off the
        event loop, e.g. on ``store.reads``)."""
        return self.get(task_id) or self.history.lookup(task_id)

    def page(self, status: str | None, offset: int, limit: int, newest_first: bool = False
             ) -> tuple[int, list[Task]]:
        """(total, one page) of every stored task in acceptance order (``newest_first``: the
        reverse), the live ones as they are in memory (blocking read, like :meth:`lookup`)."""
        return self.history.page(status, offset, limit, self.tasks, newest_first)

    def in_flight(self) -> int:
        return len(self.tasks)

    def counts(self) -> dict[str, int]:
        """Tasks by status: the unfinished in memory, the finished ones still stored."""
        out = {s: 0 for s in ("pending", "processing")}
        out.update(self.history.counts)
        # list(): the metrics thread calls this while the loop may change the dict.
        for t in list(self.tasks.values()):
            out[t.status] += 1
        return out

    def counts_by_stage(self) -> dict[str, int]:
        """The unfinished tasks by stage (every stage named, zeros included)."""
        out = {s.value: 0 for s in Stage if s not in TERMINAL}
        for t in list(self.tasks.values()):
            out[t.stage.value] += 1
        return out

    def waiting(self) -> dict[Role, list[Task]]:
        """The tasks no worker holds, by the role they wait for, each list in the order the
        role's workers are expected to take them: a ring's items before the tasks not yet
        released into it (the request ring), then the higher priority class first (the
        release order, and a DiT's deferred claims), then the earliest into the wait."""
        out: dict[Role, list[Task]] = {role: [] for role in Role}
        for t in self.tasks.values():
            role = WAITING_FOR.get(t.stage)
            if role is not None:
                out[role].append(t)
        for queue in out.values():
            queue.sort(key=lambda t: (t.stage == Stage.ACCEPTED, -rank(t.priority),
                                      t.stage_times.get(t.stage.value, t.created_at)))
        return out

    def queue_positions(self) -> dict[str, int]:
        """Task id -> its 1-based place in the queue of the role it waits for."""
        return {t.task_id: i for queue in self.waiting().values()
                for i, t in enumerate(queue, 1)}

    def queue_position(self, task: Task) -> int | None:
        """1-based place of ``task`` in the queue of the role it waits for (an encoder, a
        DiT or a decoder: :meth:`waiting`), or None while a worker holds it or it is over."""
        if task.stage not in WAITING_FOR:
            return None
        return self.queue_positions().get(task.task_id)

    def not_held(self, worker_id: int, task_ids: Iterable[str]) -> list[str]:
        """Of the tasks a worker reports running, those it should stop: over, cancelled, or
        no longer its own (its lease expired while it was stalled, say) -- rather than finish
        work whose result would be refused."""
        stop = []
        for tid in task_ids:
            t = self.get(tid)
            if (t is None or t.cancel_requested or t.stage in TERMINAL
                    or t.worker_id != worker_id):
                stop.append(tid)
        return stop

    def unwanted(self, role: Role, staged: Iterable[tuple[str, int]]) -> list[tuple[str, int]]:
        """Of the outputs (task_id, attempt) a producer of ``role`` still holds in its pool
        for the next stage, those nobody will pull any more: the task is over, the attempt
        superseded, or the consumer already past them. The consumer normally releases them
        after its pull; these the producer frees itself instead of leaking pool memory.

        Named by (task_id, attempt), never by task alone: a producer may hold a superseded
        attempt's outputs (its consumer died before pulling them) beside the current
        attempt's, which a consumer is about to read; freeing those would let the pool
        reuse their block under that read (a checksum failure charged to the task)."""
        past = _PAST_THE_CONSUMER.get(role, ())
        return [(tid, attempt) for tid, attempt in staged
                if (t := self.get(tid)) is None or t.stage in TERMINAL or t.attempt != attempt
                or t.stage in past]

    # -- lifecycle --------------------------------------------------------------------------
    def add(self, task: Task) -> None:
        if self.get(task.task_id) is not None:
            raise DuplicateTask(task.task_id)
        self.tasks[task.task_id] = task
        self.journal.accepted(task)

    def forget(self, task: Task) -> None:
        """Drop a task that was refused right after being added (e.g. the ring was full)."""
        self.tasks.pop(task.task_id, None)
        self.journal.rejected(task)

    def restore(self) -> list[Task]:
        """After a restart: rebuild the table from the store; returns the unfinished tasks,
        each moved to a new attempt (whatever a worker was doing with them died with the old
        controller). Finished tasks stay in the store (status and result served from there).
        """
        store = self.journal.store
        if store is None:
            return []
        import_jsonl(self.journal, store.folder)
        restored = store.load()
        self.history.restored(restored.counts)
        unfinished = []
        for data in restored.unfinished:
            task = task_from_record(data)
            task.image_bytes = restored.images.get(task.task_id)
            task.image = None
            task.attempt += 1
            task.stage = Stage.ACCEPTED
            task.worker = task.worker_id = None
            task.resumed_from = None
            task.error = "controller restarted; task put back in play"
            unfinished.append(task)
            self.tasks[task.task_id] = task
            self.journal.record("restored", task)
        log.info(
            "task store: %d unfinished task(s) back in play, %d finished kept (%s)",
            len(unfinished),
            sum(self.history.counts.values()),
            ", ".join(f"{k} {v}" for k, v in self.history.counts.items()),
        )
        return unfinished

    def queued(self, task: Task) -> None:
        self._set(task, Stage.QUEUED)

    def resumed(self, task: Task, stage: Stage, step: int) -> None:
        """The controller pushed a resume item of ``task`` itself (from its kept checkpoint,
        at ``step``): it waits in ``stage``'s ring (PHASE1: for a DiT, PHASE2: a decoder)."""
        task.producer_id = None  # the controller staged these inputs
        task.resumes += 1
        task.resumed_from = task.step = step
        self._set(task, stage)

    def claim(
        self, task_id: str, attempt: int, role: Role, worker: str, worker_id: int,
        lease_until: float,
    ) -> tuple[bool, str]:
        """A worker claimed this task from its ring: may it go on (holding a lease until
        ``lease_until``)?"""
        task = self.get(task_id)
        if task is None:
            return False, "unknown task"
        if task.stage in TERMINAL:
            return False, f"task is {task.stage.value}"
        if task.cancel_requested:
            self.cancelled(task, "cancelled before it started this stage")
            return False, "task was cancelled"
        if attempt != task.attempt:
            return False, f"stale attempt {attempt} (current attempt is {task.attempt})"
        if task.stage not in CLAIMABLE_FROM[role]:
            return False, f"task is {task.stage.value}, not waiting for a {role}"
        waiting = CLAIMABLE_FROM[role][0]
        if role == Role.ENCODER:
            task.producer_id = None  # a new attempt starts from the request
        elif task.stage != waiting:  # the handoff message is still on its way
            task.producer_id = task.worker_id
            self._set(task, waiting)
        task.worker, task.worker_id = worker, worker_id
        task.lease_expires = lease_until
        if task.started_at is None:
            task.started_at = time.time()
        self._set(task, WORKING_STAGE[role])
        return True, "ok"

    def holds(self, task: Task, attempt: int, worker_id: int) -> bool:
        return (
            task.stage not in TERMINAL and task.attempt == attempt and task.worker_id == worker_id
        )

    def held(self, task_id: str, attempt: int, worker_id: int) -> Task | None:
        """The task, if ``worker_id`` holds the lease of its current ``attempt``; None: the
        message of an old attempt or of another worker (the attempt fences zombies)."""
        task = self.get(task_id)
        return task if task is not None and self.holds(task, attempt, worker_id) else None

    def progress(self, task: Task, step: int, steps: int, expert: str | None = None) -> None:
        task.step, task.steps, task.expert = step, steps, expert
        task.updated_at = time.time()

    def handoff(self, task: Task, role: Role) -> None:
        task.producer_id = task.worker_id
        task.worker_id = None
        task.lease_expires = None
        self._set(task, HANDOFF_STAGE[role])

    def complete(self, task: Task, result_path: str, media_type: str) -> bool:
        if task.stage in TERMINAL:
            return False
        task.result_path, task.media_type = result_path, media_type
        self._set(task, Stage.COMPLETED)
        return True

    def failed(self, task: Task, error: str, error_type: str) -> None:
        if task.stage in TERMINAL:
            return
        task.error, task.error_type = error, error_type
        self._set(task, Stage.FAILED)

    def cancelled(self, task: Task, reason: str) -> None:
        if task.stage in TERMINAL:
            return
        task.error, task.error_type = reason, "cancelled"
        self._set(task, Stage.CANCELLED)

    def retry(self, task: Task, reason: str) -> bool:
        """Put a task back in play (new attempt); False when it is over (or was cancelled).
        Whether it may be retried at all is :mod:`controller.ownership.recovery`'s call (the retry
        budget)."""
        if task.stage in TERMINAL:
            return False
        if task.cancel_requested:
            self.cancelled(task, "cancelled")
            return False
        log.warning("task %s attempt %d: %s; retrying", task.task_id, task.attempt, reason)
        task.attempt += 1
        task.worker = None
        task.worker_id = None
        task.lease_expires = None
        task.step = 0
        task.resumed_from = None
        task.yield_requested = False
        task.waiting_since = None
        task.error = reason
        self._set(task, Stage.ACCEPTED)
        return True

    def _set(self, task: Task, stage: Stage) -> None:
        now = time.time()
        task.stage_times[stage.value] = now
        task.stage = stage
        task.updated_at = now
        if stage in TERMINAL:
            task.finished_at = now
            task.lease_expires = None
            task.worker_id = None
            self._finished(task)
        # "accepted" is the event that inserts a task; a retry back to that stage updates it.
        self.journal.record("requeued" if stage == Stage.ACCEPTED else stage.value, task)

    def _finished(self, task: Task) -> None:
        """A task reached a terminal stage: out of the live table, into the history."""
        self.journal.finished(task)
        if self.tasks.pop(task.task_id, None) is not None:
            self.history.add(task)
