"""Completions: a task's result, accepted only from the holder of its lease (the end of
window 4 of the ownership argument in :mod:`controller.ownership.coordinator`).

The decoder holding the lease sends its encoded result; the file is written off the event
loop (:mod:`controller.ownership.results`), and the completion is recorded only if the lease still
holds once the file is there: a lease that ended meanwhile (expired, the task cancelled or
failed) removes the file, so a zombie never completes a task. Completions of one task take
turns (:meth:`Results.turn`), so only the winner's file stays and a task completes exactly
once. A write the storage refuses raises ``ResultWriteBlocked``: the decoder keeps the lease
and the result and sends it again (:mod:`controller.ownership.result_writes`). The decoder is
answered once the completion is durable in the task store.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from contracts.errors import ResultWriteBlocked
from controller.ownership.outbox import Outbox
from controller.ownership.rates import CompletionRate
from controller.ownership.registry import WorkerInfo
from controller.ownership.results import Results
from controller.tasks.store import StoreError
from controller.tasks.table import TaskTable
from controller.tasks.tasks import TERMINAL

log = logging.getLogger("diffring.controller")


class Completions:
    """Results of ``table``'s tasks, written to ``results``; each completion is counted in
    ``rates`` (on ``clock``) and reported with ``emit``."""

    def __init__(self, table: TaskTable, results: Results, rates: CompletionRate,
                 out: Outbox, clock: Callable[[], float]) -> None:
        self.table = table
        self.results = results
        self.rates = rates
        self.out = out
        self.clock = clock

    async def complete(self, worker: WorkerInfo, task_id: str, attempt: int, extension: str,
                       media_type: str, data: bytes) -> bool:
        """Write the result file, record the completion, and answer once it is durable;
        False: refused (not the lease holder's, or its lease ended during the write)."""
        worker.tasks.discard(task_id)
        async with self.results.turn(task_id):
            task = self.table.held(task_id, attempt, worker.worker_id)
            if task is None:
                # Completed already, or this worker's lease ran out and the task is another
                # attempt's now: a late result is refused, never a second completion.
                log.info("task %s: result of attempt %d from %s refused (not its lease)",
                         task_id, attempt, worker.name)
                return False
            path = self.results.path(task, extension)
            try:
                await self.results.write(path, data)
            except ResultWriteBlocked:  # the decoder holds the result and sends it again
                worker.tasks.add(task_id)
                raise
            if task.stage in TERMINAL or not self.table.holds(task, attempt, worker.worker_id):
                # Cancelled, failed or its lease lost while the file was written: no result.
                await self.results.remove(path)
                return False
            if not self.table.complete(task, str(path), media_type):
                return False
            self.rates.completed(self.clock())
            log.info("task %s stage=completed worker=%s attempt=%d result=%s (%d bytes)",
                     task_id, worker.name, attempt, path, len(data))
            self.out.emit("completed", task)
            durable = self.table.journal.flush()
            if durable is not None:
                try:
                    await asyncio.wrap_future(durable)
                except StoreError as exc:  # the result stands; only its record is at risk
                    log.error("task %s: completion not recorded durably: %s", task_id, exc)
            return True
