"""The SQL of the task store (:mod:`controller.tasks.store`): schema, the statements of each
operation, and rows back to records. Plain functions on a connection; which thread runs them
(the writer, a reader, the read-only check) is the caller's business.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DB_NAME = "tasks.db"
SCHEMA_VERSION = 1
STATUSES = ("pending", "processing", "completed", "failed", "cancelled")

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


@dataclass
class Op:
    kind: str  # "put", "barrier", "prune"
    event: str = ""
    task_id: str = ""
    columns: dict[str, Any] = field(default_factory=dict)
    fixed: str | None = None
    image: bytes | None = None
    durable: bool = False
    future: concurrent.futures.Future[Any] | None = None


def connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA busy_timeout=10000")
    return conn


def create(conn: sqlite3.Connection, retention_s: float) -> None:
    """Create the schema, or check the one there (``sqlite3.DatabaseError`` if it is not
    this controller's), and record the retention window for the read-only check."""
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
        raise sqlite3.DatabaseError(
            f"it has schema version {version}, this controller reads {SCHEMA_VERSION}"
        )
    conn.execute(
        "INSERT INTO meta VALUES ('retention_s', ?) "
        "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
        (repr(retention_s),),
    )


def apply(conn: sqlite3.Connection, op: Op, delete_results: bool) -> Any:
    """Run one operation inside the writer's transaction; what its future resolves to."""
    if op.kind == "barrier":
        return None
    if op.kind == "prune":
        return prune(conn, op.columns["cutoff"], delete_results)
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


def prune(conn: sqlite3.Connection, cutoff: float, delete_results: bool) -> dict[str, int]:
    """Delete the tasks finished before ``cutoff`` (and their result files, when asked);
    how many of each status went."""
    where = "finished_at IS NOT NULL AND finished_at < ?"
    gone: dict[str, int] = {
        status: n
        for status, n in conn.execute(
            f"SELECT status, count(*) FROM tasks WHERE {where} GROUP BY status", (cutoff,)
        )
    }
    if delete_results:
        for (path,) in conn.execute(
            f"SELECT result_path FROM tasks WHERE {where} AND result_path IS NOT NULL",
            (cutoff,),
        ).fetchall():
            with contextlib.suppress(OSError):
                Path(path).unlink(missing_ok=True)
    conn.execute(f"DELETE FROM tasks WHERE {where}", (cutoff,))
    return gone


def unfinished(conn: sqlite3.Connection) -> tuple[list[dict[str, Any]], dict[str, bytes]]:
    """Every unfinished task's record, in acceptance order, and their input images."""
    rows = [
        record(r)
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
    return rows, images


def page(conn: sqlite3.Connection, status: str | None, offset: int, limit: int,
         newest_first: bool = False) -> tuple[int, list[dict[str, Any]]]:
    """(total matching, one page of records) in acceptance order (``newest_first``: the
    reverse), from one snapshot."""
    order = "seq DESC" if newest_first else "seq"
    conn.execute("BEGIN")
    try:
        if status is None:
            total = conn.execute("SELECT count(*) FROM tasks").fetchone()[0]
            rows = conn.execute(
                f"SELECT * FROM tasks ORDER BY {order} LIMIT ? OFFSET ?", (limit, offset)
            ).fetchall()
        else:
            total = conn.execute(
                "SELECT count(*) FROM tasks WHERE status = ?", (status,)
            ).fetchone()[0]
            rows = conn.execute(
                f"SELECT * FROM tasks WHERE status = ? ORDER BY {order} LIMIT ? OFFSET ?",
                (status, limit, offset),
            ).fetchall()
    finally:
        conn.execute("COMMIT")
    return int(total), [record(r) for r in rows]


def record(row: sqlite3.Row) -> dict[str, Any]:
    """A task's stored record (``fixed`` and ``state`` merged with the indexed columns)."""
    out: dict[str, Any] = json.loads(row["fixed"])
    out.update(json.loads(row["state"]))
    out["task_id"] = row["task_id"]
    out["stage"] = row["stage"]
    out["attempt"] = row["attempt"]
    out["finished_at"] = row["finished_at"]
    out["result_path"] = row["result_path"]
    return out


def counts(conn: sqlite3.Connection) -> dict[str, int]:
    """Rows by status (every status named, zero or not)."""
    out = dict.fromkeys(STATUSES, 0)
    for status, n in conn.execute("SELECT status, count(*) FROM tasks GROUP BY status"):
        out[status] = n
    return out
