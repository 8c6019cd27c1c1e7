"""Result files: where a task's result goes, and writing it off the event loop.

Writes run on a small thread pool (``io``), so a large MP4 never stalls the loop that serves
the ring verbs and the control channel. A file is written to ``<name>.part`` and renamed, so
a reader never sees half a result. Completions of one task take turns (:meth:`Results.turn`):
:mod:`controller.ownership.completions` writes a file only as the one completion that may win.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from contracts import faults
from contracts.errors import ResultWriteBlocked, storage_fault
from controller.ownership.result_writes import ResultWrites
from controller.tasks.tasks import Task


class Results:
    """The result folder of one controller."""

    def __init__(self, output_dir: Path) -> None:
        self.output_dir = output_dir
        self.io = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="results")
        """Result-file writes: off the loop that serves the ring verbs and the control channel."""
        self.writes = ResultWrites()
        """Whether this folder takes results now (and each decoder's own, as reported)."""
        self._turns: dict[str, asyncio.Future[None]] = {}

    def path(self, task: Task, extension: str) -> Path:
        rel = task.save_result_path or f"{task.task_id}.{extension}"
        if not Path(rel).suffix:
            rel = f"{rel}.{extension}"
        return self.output_dir / rel

    @contextlib.asynccontextmanager
    async def turn(self, task_id: str) -> AsyncIterator[None]:
        """Wait until no other completion of ``task_id`` is in progress, then hold the turn."""
        while (running := self._turns.get(task_id)) is not None:
            await asyncio.wait([running])  # then look again: another may have taken it
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._turns[task_id] = done
        try:
            yield
        finally:
            del self._turns[task_id]
            done.set_result(None)

    async def write(self, path: Path, data: bytes) -> None:
        """Write ``data`` to ``path``; ResultWriteBlocked when the storage refuses it (a
        full disk, a read-only or missing folder: not the task's fault)."""
        try:
            await asyncio.get_running_loop().run_in_executor(self.io, write_result, path, data)
        except OSError as exc:
            if not storage_fault(exc):
                raise
            self.writes.failed(f"cannot write {path}: {exc}")
            raise ResultWriteBlocked(f"cannot write {path}: {exc}") from exc
        self.writes.written()

    async def remove(self, path: Path) -> None:
        await asyncio.get_running_loop().run_in_executor(self.io, remove_result, path)

    def close(self) -> None:
        """Finish the writes in progress."""
        self.io.shutdown(wait=True)


def write_result(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".part")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        faults.hit("controller.result_write", faults.no_space)
        tmp.write_bytes(data)
        tmp.replace(path)
    except OSError:
        with contextlib.suppress(OSError):  # a partial file takes the room a retry needs
            tmp.unlink(missing_ok=True)
        raise


def remove_result(path: Path) -> None:
    path.unlink(missing_ok=True)
