"""The controller's durable task store: one SQLite database (WAL mode) per output folder.

One row per task (``<output_dir>/.journal/tasks.db``), written by one dedicated writer
thread so nothing here blocks the event loop that serves the ring verbs and the control
channel. Writers enqueue; the writer thread drains what has queued up and commits it as one
transaction, so a burst of state changes costs one commit. Reads (status of a task that has
left memory, the paged list) run on a small pool of reader threads, each with its own
connection: WAL readers never wait for the writer.

Why SQLite: it is in the standard library, a row per task is updated in place (the JSON-lines
journal it replaces grew by a line per event and was reopened and fsync'd per event on the
loop), a retention window is one indexed ``DELETE``, and the list endpoint pages with an
index instead of walking every task ever accepted.

Durability: a commit that carries an accepted, refused or finished task (or a barrier a
caller waits on) runs with ``synchronous=FULL`` (the WAL is fsync'd before the commit
returns); intermediate stage changes use ``NORMAL`` (they survive a process crash, and a
restarted controller puts every unfinished task back in play anyway). Callers that must not
answer before their write is durable wait on the future :meth:`TaskStore.put` or
:meth:`TaskStore.barrier` returns.

API (small on purpose)::

    store = TaskStore(folder, retention_s=86400, delete_results=False)
    store.open()                     # schema, the folder's lock, the writer thread
    restored = store.load()          # unfinished rows (+ input images), counts by status
    fut = store.put(event, task_id, status=..., stage=..., state={...},
                    fixed={...}, image=b"...", durable=True)   # "accepted": insert
    store.put("rejected", task_id)   # delete (a task refused right after it was added)
    store.put("completed", task_id, status="completed", ...)   # update; counts a completion
    store.barrier().result()         # everything queued so far is committed and fsync'd
    store.get(task_id) / store.page(status, offset, limit) / store.counts()   # any thread
    store.prune(now)                 # future: {status: rows removed} past the retention
    store.close()

The SQL itself is :mod:`controller.tasks.store_sql`. Checking a store from outside (what the chaos
soak calls), read-only, safe while the controller runs::

    python -m controller.tasks.store_check --check out/results/.journal [--max-bytes N] [--json]

or :func:`controller.tasks.store_check.check` in-process (a ``StoreReport``; ``.ok``,
``.problems``), and :func:`controller.tasks.store_check.completions` for every task's status and
recorded completions. The check reports tasks by status and fails (exit 1) when a task has
more than one recorded completion, a completed task has none, a task that is not completed
has one, finished tasks older than the retention window (plus one prune interval) are still
present, an input image outlived its task, or the database files exceed ``--max-bytes``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import json
import logging
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contracts.errors import ConfigError, DiffringError
from controller.tasks import store_sql
from controller.tasks.store_sql import DB_NAME, Op

log = logging.getLogger("diffring.controller.store")

__all__ = ["DB_NAME", "Restored", "StoreConflict", "StoreError", "StoreLocked", "TaskStore"]

MAX_BATCH = 1024
"""Most operations one transaction takes; bounds how long a reader waits for a checkpoint."""


class StoreError(DiffringError):
    """The task store cannot record or read a task (disk full, locked, corrupt)."""


class StoreConflict(StoreError):
    """A task with this id is in the store already."""


class StoreLocked(ConfigError):
    """Another controller holds this output folder's task store."""


def prune_interval(retention_s: float) -> float:
    """How often a controller prunes: a tenth of the window, between 1 s and 60 s."""
    return min(60.0, max(1.0, retention_s / 10))


@dataclass
class Restored:
    """What :meth:`TaskStore.open` found: every unfinished task, and counts by status."""

    unfinished: list[dict[str, Any]]
    counts: dict[str, int]
    images: dict[str, bytes]


class TaskStore:
    """One output folder's task rows; see the module docstring for the protocol."""

    def __init__(
        self, folder: Path, *, retention_s: float = 86400.0, delete_results: bool = False
    ) -> None:
        if retention_s <= 0:
            raise ConfigError("task retention must be positive")
        self.folder = folder
        self.path = folder / DB_NAME
        self.retention_s = retention_s
        self.delete_results = delete_results
        self._queue: queue.SimpleQueue[Op | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._lock_file: Any = None
        self._readers: list[sqlite3.Connection] = []
        self._readers_lock = threading.Lock()
        self._local = threading.local()
        self.reads = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="store-read")
        """Where async callers run :meth:`get` / :meth:`page` (each thread its connection)."""
        self.commits = 0
        self.ops = 0
        self._unsynced = False  # a NORMAL commit since the last FULL one

    # -- lifecycle --------------------------------------------------------------------------
    def open(self) -> None:
        """Create or open the database, take the folder's lock, start the writer thread."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock_file = (self.folder / "tasks.lock").open("a")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock_file.close()
            self._lock_file = None
            raise StoreLocked(
                f"another controller uses the task store in {self.folder}; give each "
                "controller its own output_dir"
            ) from None
        conn = None
        try:
            conn = store_sql.connect(self.path)
            store_sql.create(conn, self.retention_s)
        except sqlite3.DatabaseError as exc:
            if conn is not None:
                conn.close()
            self._lock_file.close()
            self._lock_file = None
            raise StoreError(
                f"cannot open the task store {self.path}: {exc}. Move the folder "
                f"{self.folder} aside to start with an empty store (the records of past "
                "tasks are then lost; result files stay)"
            ) from None
        self._writer = threading.Thread(
            target=self._write_loop, args=(conn,), name="task-store", daemon=True
        )
        self._writer.start()

    def load(self) -> Restored:
        """What a restarting controller needs: every unfinished task (with its input image)
        and the counts by status. Sees every change queued before it."""
        self.barrier().result()
        conn = self._reader()
        conn.execute("BEGIN")
        try:
            unfinished, images = store_sql.unfinished(conn)
            counts = store_sql.counts(conn)
        finally:
            conn.execute("COMMIT")
        return Restored(unfinished, counts, images)

    def close(self) -> None:
        """Commit everything queued, stop the writer, close every connection."""
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join()
            self._writer = None
        self.reads.shutdown(wait=True)
        with self._readers_lock:
            for c in self._readers:
                c.close()
            self._readers.clear()
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    # -- writes (enqueue from any thread; the writer thread commits) ------------------------
    def put(
        self,
        event: str,
        task_id: str,
        *,
        status: str = "",
        stage: str = "",
        attempt: int = 1,
        finished_at: float | None = None,
        result_path: str | None = None,
        state: Mapping[str, Any] | None = None,
        fixed: Mapping[str, Any] | None = None,
        image: bytes | None = None,
        durable: bool = False,
    ) -> concurrent.futures.Future[None]:
        """Record one state change of a task; the future resolves once it is committed.

        ``event``: ``accepted`` inserts the row (``fixed`` and ``image`` with it);
        ``rejected`` deletes it; any other event updates it, and ``completed`` also counts a
        completion. A finished task's image is dropped in the same transaction.
        """
        if self._writer is None:
            raise StoreError("the task store is not open")
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        columns = {
            "status": status,
            "stage": stage,
            "attempt": attempt,
            "finished_at": finished_at,
            "result_path": result_path,
            "state": json.dumps(state or {}, separators=(",", ":")),
        }
        self._queue.put(
            Op(
                "put",
                event,
                task_id,
                columns,
                None if fixed is None else json.dumps(fixed, separators=(",", ":")),
                image,
                durable or event in ("accepted", "rejected") or finished_at is not None,
                fut,
            )
        )
        return fut

    def barrier(self, durable: bool = True) -> concurrent.futures.Future[None]:
        """Resolves once everything queued before it is committed (and fsync'd, when
        ``durable``; a reader that only needs to see earlier writes passes False)."""
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._queue.put(Op("barrier", durable=durable, future=fut))
        return fut

    def prune(self, now: float | None = None) -> concurrent.futures.Future[dict[str, int]]:
        """Remove finished tasks older than the retention window (and their result files,
        when configured); the future gives how many rows of each status went."""
        fut: concurrent.futures.Future[dict[str, int]] = concurrent.futures.Future()
        cutoff = (time.time() if now is None else now) - self.retention_s
        self._queue.put(Op("prune", columns={"cutoff": cutoff}, future=fut))
        return fut

    def _write_loop(self, conn: sqlite3.Connection) -> None:
        stopping = False
        while not stopping:
            first = self._queue.get()
            if first is None:
                break
            batch = [first]
            while len(batch) < MAX_BATCH:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stopping = True
                    break
                batch.append(nxt)
            self._commit(conn, batch)
        conn.close()

    def _commit(self, conn: sqlite3.Connection, batch: list[Op]) -> None:
        durable = any(op.durable for op in batch)
        writes = any(op.kind != "barrier" for op in batch)
        results: list[Any] = [None] * len(batch)
        try:
            conn.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
            conn.execute("BEGIN IMMEDIATE")
            for i, op in enumerate(batch):
                results[i] = store_sql.apply(conn, op, self.delete_results)
            conn.execute("COMMIT")
        except Exception as exc:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            if len(batch) > 1:
                # Find the culprit: one transaction per operation, so only it fails.
                log.warning("task store: a batch of %d failed (%s); retrying one by one",
                            len(batch), exc)
                for op in batch:
                    self._commit(conn, [op])
                return
            op = batch[0]
            err: Exception
            if isinstance(exc, sqlite3.IntegrityError):
                err = StoreConflict(f"task {op.task_id} is in the task store already")
            else:
                log.error("task store: cannot record %s %s: %s", op.kind, op.task_id, exc)
                err = StoreError(f"the task store could not record task {op.task_id}: {exc}")
            if op.future is not None:
                op.future.set_exception(err)
            return
        if writes:
            self._unsynced = not durable  # a FULL commit syncs every earlier frame too
        elif durable and self._unsynced:
            # A transaction without writes adds no WAL frame, so its FULL commit syncs
            # nothing: the earlier NORMAL commits a durable barrier covers are synced here.
            self._sync_wal()
            self._unsynced = False
        self.commits += 1
        self.ops += len(batch)
        for op, res in zip(batch, results, strict=True):
            if op.kind == "prune":
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("PRAGMA incremental_vacuum")
            if op.future is not None:
                op.future.set_result(res)

    def _sync_wal(self) -> None:
        wal = self.path.with_name(self.path.name + "-wal")
        try:
            fd = os.open(wal, os.O_RDONLY)
        except FileNotFoundError:
            return  # checkpointed and truncated: everything is in the database file
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- reads (any thread; each thread its own connection) ---------------------------------
    def _reader(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = store_sql.connect(self.path)
            conn.execute("PRAGMA query_only=1")
            self._local.conn = conn
            with self._readers_lock:
                self._readers.append(conn)
        return conn

    def get(self, task_id: str) -> dict[str, Any] | None:
        """The stored record of one task (``fixed`` and ``state`` merged), or None."""
        row = self._reader().execute(
            "SELECT * FROM tasks WHERE task_id = ?", (task_id,)
        ).fetchone()
        return None if row is None else store_sql.record(row)

    def page(
        self, status: str | None, offset: int, limit: int
    ) -> tuple[int, list[dict[str, Any]]]:
        """(total matching, one page of records) in acceptance order."""
        return store_sql.page(self._reader(), status, offset, limit)

    def counts(self) -> dict[str, int]:
        return store_sql.counts(self._reader())
