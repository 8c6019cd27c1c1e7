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

Checking a store from outside (what the chaos soak calls), read-only, safe while the
controller runs::

    python -m controller.store --check out/results/.journal [--max-bytes N] [--json]

or :func:`controller.store_check.check` in-process (a ``StoreReport``; ``.ok``,
``.problems``), and :func:`controller.store_check.completions` for every task's status and
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
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contracts.errors import ConfigError, DiffringError

log = logging.getLogger("diffring.controller.store")

DB_NAME = "tasks.db"
SCHEMA_VERSION = 1
MAX_BATCH = 1024
"""Most operations one transaction takes; bounds how long a reader waits for a checkpoint."""
_STATUSES = ("pending", "processing", "completed", "failed", "cancelled")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS tasks (
    seq INTEGER PRIMARY KEY,            -- acceptance order: the list endpoint's stable order
    task_id TEXT NOT NULL UNIQUE,
    status TEXT NOT NULL,               -- pending | processing | completed | failed | cancelled
    stage TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    finished_at REAL,                   -- set once terminal; what retention prunes by
    result_path TEXT,
    completions INTEGER NOT NULL DEFAULT 0,   -- completed events recorded: must end at 0 or 1
    fixed TEXT NOT NULL,                -- JSON written once: request, kind, pipeline, ...
    state TEXT NOT NULL                 -- JSON of the mutable fields, rewritten per change
);
CREATE INDEX IF NOT EXISTS tasks_status ON tasks (status, seq);
CREATE INDEX IF NOT EXISTS tasks_finished ON tasks (finished_at) WHERE finished_at IS NOT NULL;
-- Input images of unfinished tasks (kept to re-stage on a retry or after a restart).
CREATE TABLE IF NOT EXISTS images (task_id TEXT PRIMARY KEY, data BLOB NOT NULL);
"""


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


@dataclass
class _Op:
    kind: str  # "put", "barrier", "prune"
    event: str = ""
    task_id: str = ""
    columns: dict[str, Any] = field(default_factory=dict)
    fixed: str | None = None
    image: bytes | None = None
    durable: bool = False
    future: concurrent.futures.Future[Any] | None = None


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
        self._queue: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
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
        try:
            conn = self._create()
        except sqlite3.DatabaseError as exc:
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

    def _create(self) -> sqlite3.Connection:
        conn = self._connect()
        # auto_vacuum must be chosen before the first table exists: space of pruned rows is
        # returned to the file system a little at a time (incremental_vacuum after a prune).
        conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
        conn.executescript(_SCHEMA)
        conn.execute(
            "INSERT INTO meta VALUES ('schema', ?) ON CONFLICT(key) DO NOTHING",
            (str(SCHEMA_VERSION),),
        )
        (version,) = conn.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
        if version != str(SCHEMA_VERSION):
            conn.close()
            raise sqlite3.DatabaseError(
                f"it has schema version {version}, this controller reads {SCHEMA_VERSION}"
            )
        conn.execute(
            "INSERT INTO meta VALUES ('retention_s', ?) "
            "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            (repr(self.retention_s),),
        )
        return conn

    def load(self) -> Restored:
        """What a restarting controller needs: every unfinished task (with its input image)
        and the counts by status. Sees every change queued before it."""
        self.barrier().result()
        conn = self._reader()
        conn.execute("BEGIN")
        try:
            unfinished = [
                _row(r)
                for r in conn.execute(
                    "SELECT * FROM tasks WHERE finished_at IS NULL ORDER BY seq"
                ).fetchall()
            ]
            images = {
                tid: bytes(data)
                for tid, data in conn.execute(
                    "SELECT i.task_id, i.data FROM images i JOIN tasks t USING (task_id) "
                    "WHERE t.finished_at IS NULL"
                )
            }
            counts = _counts(conn)
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

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA busy_timeout=10000")
        return conn

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
            _Op(
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
        self._queue.put(_Op("barrier", durable=durable, future=fut))
        return fut

    def prune(self, now: float | None = None) -> concurrent.futures.Future[dict[str, int]]:
        """Remove finished tasks older than the retention window (and their result files,
        when configured); the future gives how many rows of each status went."""
        fut: concurrent.futures.Future[dict[str, int]] = concurrent.futures.Future()
        cutoff = (time.time() if now is None else now) - self.retention_s
        self._queue.put(_Op("prune", columns={"cutoff": cutoff}, future=fut))
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

    def _commit(self, conn: sqlite3.Connection, batch: list[_Op]) -> None:
        durable = any(op.durable for op in batch)
        writes = any(op.kind != "barrier" for op in batch)
        results: list[Any] = [None] * len(batch)
        try:
            conn.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
            conn.execute("BEGIN IMMEDIATE")
            for i, op in enumerate(batch):
                results[i] = self._apply(conn, op)
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

    def _apply(self, conn: sqlite3.Connection, op: _Op) -> Any:
        if op.kind == "barrier":
            return None
        if op.kind == "prune":
            return self._prune(conn, op.columns["cutoff"])
        c = op.columns
        if op.event == "accepted":
            conn.execute(
                "INSERT INTO tasks (task_id, status, stage, attempt, finished_at, result_path,"
                " fixed, state) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (op.task_id, c["status"], c["stage"], c["attempt"], c["finished_at"],
                 c["result_path"], op.fixed or "{}", c["state"]),
            )
            if op.image is not None:
                conn.execute("INSERT OR REPLACE INTO images VALUES (?, ?)", (op.task_id, op.image))
            return None
        if op.event == "rejected":
            conn.execute("DELETE FROM tasks WHERE task_id = ?", (op.task_id,))
            conn.execute("DELETE FROM images WHERE task_id = ?", (op.task_id,))
            return None
        conn.execute(
            "UPDATE tasks SET status = ?, stage = ?, attempt = ?, finished_at = ?, "
            "result_path = ?, state = ?, completions = completions + ? WHERE task_id = ?",
            (c["status"], c["stage"], c["attempt"], c["finished_at"], c["result_path"],
             c["state"], 1 if op.event == "completed" else 0, op.task_id),
        )
        if op.image is not None:
            conn.execute("INSERT OR REPLACE INTO images VALUES (?, ?)", (op.task_id, op.image))
        if c["finished_at"] is not None:
            conn.execute("DELETE FROM images WHERE task_id = ?", (op.task_id,))
        return None

    def _prune(self, conn: sqlite3.Connection, cutoff: float) -> dict[str, int]:
        where = "finished_at IS NOT NULL AND finished_at < ?"
        gone: dict[str, int] = {
            status: n
            for status, n in conn.execute(
                f"SELECT status, count(*) FROM tasks WHERE {where} GROUP BY status", (cutoff,)
            )
        }
        if self.delete_results:
            for (path,) in conn.execute(
                f"SELECT result_path FROM tasks WHERE {where} AND result_path IS NOT NULL",
                (cutoff,),
            ).fetchall():
                with contextlib.suppress(OSError):
                    Path(path).unlink(missing_ok=True)
        conn.execute(f"DELETE FROM tasks WHERE {where}", (cutoff,))
        return gone

    # -- reads (any thread; each thread its own connection) ---------------------------------
    def _reader(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._connect()
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
        return None if row is None else _row(row)

    def page(
        self, status: str | None, offset: int, limit: int
    ) -> tuple[int, list[dict[str, Any]]]:
        """(total matching, one page of records) in acceptance order."""
        conn = self._reader()
        # One read transaction: the total and the page see the same snapshot.
        conn.execute("BEGIN")
        try:
            if status is None:
                total = conn.execute("SELECT count(*) FROM tasks").fetchone()[0]
                rows = conn.execute(
                    "SELECT * FROM tasks ORDER BY seq LIMIT ? OFFSET ?", (limit, offset)
                ).fetchall()
            else:
                total = conn.execute(
                    "SELECT count(*) FROM tasks WHERE status = ?", (status,)
                ).fetchone()[0]
                rows = conn.execute(
                    "SELECT * FROM tasks WHERE status = ? ORDER BY seq LIMIT ? OFFSET ?",
                    (status, limit, offset),
                ).fetchall()
        finally:
            conn.execute("COMMIT")
        return int(total), [_row(r) for r in rows]

    def counts(self) -> dict[str, int]:
        return _counts(self._reader())


def _row(row: sqlite3.Row) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(row["fixed"])
    out.update(json.loads(row["state"]))
    out["task_id"] = row["task_id"]
    out["stage"] = row["stage"]
    out["attempt"] = row["attempt"]
    out["finished_at"] = row["finished_at"]
    out["result_path"] = row["result_path"]
    return out


def _counts(conn: sqlite3.Connection) -> dict[str, int]:
    out = dict.fromkeys(_STATUSES, 0)
    for status, n in conn.execute("SELECT status, count(*) FROM tasks GROUP BY status"):
        out[status] = n
    return out


def counts(conn: sqlite3.Connection) -> dict[str, int]:
    """Rows by status (every status named, zero or not)."""
    return _counts(conn)


if __name__ == "__main__":
    from controller.store_check import main

    sys.exit(main())
