"""The live table's link to its task store (:mod:`controller.tasks.store`).

Every state change of a task is handed to the store's writer thread as it happens (nothing
here waits for a disk): an accepted task with its input image, every stage change after it,
and a refused one's deletion. A caller that must not answer before a change is durable waits
on the future handed out here (:meth:`TaskJournal.durable` for an accepted task,
:meth:`TaskJournal.flush` for everything so far). Without a store the journal records
nothing and every future is None (a table kept in memory only).
"""

from __future__ import annotations

import concurrent.futures

from controller.tasks.store import Restored, TaskStore
from controller.tasks.tasks import FIXED_FIELDS, TERMINAL, Task, task_record


class TaskJournal:
    """Writes one table's state changes to ``store`` (None: nowhere)."""

    def __init__(self, store: TaskStore | None = None) -> None:
        self.store = store
        self._accepted: dict[str, concurrent.futures.Future[None]] = {}

    def record(self, event: str, task: Task) -> concurrent.futures.Future[None] | None:
        """Hand one state change to the store; ``accepted`` inserts the row (and the input
        image), ``rejected`` deletes it, any other event updates it."""
        if self.store is None:
            return None
        rec = task_record(task)
        fixed = {k: rec.pop(k) for k in FIXED_FIELDS} if event == "accepted" else None
        return self.store.put(
            event,
            task.task_id,
            status=task.status,
            stage=task.stage.value,
            attempt=task.attempt,
            finished_at=task.finished_at if task.stage in TERMINAL else None,
            result_path=task.result_path,
            state=rec,
            fixed=fixed,
            image=task.image_bytes if event == "accepted" else None,
        )

    def accepted(self, task: Task) -> None:
        fut = self.record("accepted", task)
        if fut is not None:
            self._accepted[task.task_id] = fut

    def rejected(self, task: Task) -> None:
        self._accepted.pop(task.task_id, None)
        self.record("rejected", task)

    def finished(self, task: Task) -> None:
        """``task`` is over: nobody will wait for its acceptance any more."""
        self._accepted.pop(task.task_id, None)

    def durable(self, task_id: str) -> concurrent.futures.Future[None] | None:
        """The future of an accepted task's first write (None without a store): resolves
        when the task is durable, raises ``StoreError`` / ``StoreConflict`` if it cannot be."""
        return self._accepted.pop(task_id, None)

    def flush(self, durable: bool = True) -> concurrent.futures.Future[None] | None:
        """Resolves once every change made so far is committed -- and durable, unless
        ``durable`` is False (enough to read them back); None without a store."""
        return None if self.store is None else self.store.barrier(durable)

    def load(self) -> Restored | None:
        """What the store holds (None without one): for a restarting controller."""
        return None if self.store is None else self.store.load()

    def close(self) -> None:
        """Commit every queued change and close the store."""
        if self.store is not None:
            self.store.close()
