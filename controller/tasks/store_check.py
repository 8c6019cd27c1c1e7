"""Read-only checks of a task store (:mod:`controller.tasks.store`), for operators and the chaos
soak; safe while the controller runs (WAL readers never block the writer)::

    python -m controller.tasks.store_check --check out/results/.journal [--max-bytes N] [--json]

:func:`check` does the same in-process and returns a :class:`StoreReport`;
:func:`completions` lists every stored task with its status and recorded completions.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from controller.tasks.store import StoreError, prune_interval
from controller.tasks.store_sql import DB_NAME, counts


@dataclass
class StoreReport:
    """What :func:`check` found; ``ok`` when every invariant holds."""

    folder: str
    tasks: int
    by_status: dict[str, int]
    duplicated: list[str]
    """Tasks with more than one recorded completion."""
    completed_without_completion: list[str]
    completion_not_completed: list[str]
    """Tasks that recorded a completion yet are not ``completed``."""
    expired: int
    """Finished tasks past the retention window plus one prune interval (should be 0)."""
    retention_s: float
    images: int
    stale_images: int
    """Input images kept for tasks that are finished or gone (should be 0)."""
    db_bytes: int
    max_bytes: int | None

    @property
    def problems(self) -> list[str]:
        out = []
        if self.duplicated:
            out.append(f"{len(self.duplicated)} task(s) completed more than once: "
                       f"{self.duplicated[:5]}")
        if self.completed_without_completion:
            out.append(f"{len(self.completed_without_completion)} completed task(s) without a "
                       f"recorded completion: {self.completed_without_completion[:5]}")
        if self.completion_not_completed:
            out.append(f"{len(self.completion_not_completed)} task(s) with a completion but "
                       f"another status: {self.completion_not_completed[:5]}")
        if self.expired:
            out.append(f"{self.expired} finished task(s) kept past the retention window")
        if self.stale_images:
            out.append(f"{self.stale_images} input image(s) of finished or gone tasks kept")
        if self.max_bytes is not None and self.db_bytes > self.max_bytes:
            out.append(f"store is {self.db_bytes} bytes, over the bound of {self.max_bytes}")
        return out

    @property
    def ok(self) -> bool:
        return not self.problems


def check(
    folder: Path, *, max_bytes: int | None = None, now: float | None = None
) -> StoreReport:
    """Read-only check of a store (a running controller's included); see the docstring."""
    path = folder / DB_NAME
    if not path.exists():
        raise StoreError(f"no task store at {path}")
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        conn.execute("PRAGMA busy_timeout=10000")
        conn.execute("BEGIN")
        retention = float(
            (conn.execute("SELECT value FROM meta WHERE key = 'retention_s'").fetchone()
             or ("inf",))[0]
        )

        def ids(sql: str) -> list[str]:
            return [r[0] for r in conn.execute(sql)]

        cutoff = (time.time() if now is None else now) - retention - prune_interval(retention)
        report = StoreReport(
            folder=str(folder),
            tasks=conn.execute("SELECT count(*) FROM tasks").fetchone()[0],
            by_status=counts(conn),
            duplicated=ids("SELECT task_id FROM tasks WHERE completions > 1"),
            completed_without_completion=ids(
                "SELECT task_id FROM tasks WHERE status = 'completed' AND completions = 0"),
            completion_not_completed=ids(
                "SELECT task_id FROM tasks WHERE status != 'completed' AND completions > 0"),
            expired=conn.execute(
                "SELECT count(*) FROM tasks WHERE finished_at IS NOT NULL AND finished_at < ?",
                (cutoff,)).fetchone()[0],
            retention_s=retention,
            images=conn.execute("SELECT count(*) FROM images").fetchone()[0],
            stale_images=conn.execute(
                "SELECT count(*) FROM images i LEFT JOIN tasks t USING (task_id) "
                "WHERE t.task_id IS NULL OR t.finished_at IS NOT NULL").fetchone()[0],
            db_bytes=sum(
                p.stat().st_size for p in folder.glob(DB_NAME + "*") if p.is_file()
            ),
            max_bytes=max_bytes,
        )
        conn.execute("COMMIT")
        return report
    finally:
        conn.close()


def completions(folder: Path) -> dict[str, tuple[str, int]]:
    """Every stored task: task_id -> (status, recorded completions). Read-only."""
    conn = sqlite3.connect(f"file:{folder / DB_NAME}?mode=ro", uri=True)
    try:
        conn.execute("PRAGMA busy_timeout=10000")
        return {tid: (status, n) for tid, status, n in
                conn.execute("SELECT task_id, status, completions FROM tasks")}
    finally:
        conn.close()


def main(argv: Iterable[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m controller.tasks.store_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", required=True, metavar="DIR",
                   help="a store folder (<output_dir>/.journal) or an output_dir")
    p.add_argument("--max-bytes", type=int, help="fail when the database files exceed this")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(list(argv) if argv is not None else None)
    folder = Path(args.check)
    if not (folder / DB_NAME).exists() and (folder / ".journal" / DB_NAME).exists():
        folder = folder / ".journal"
    try:
        report = check(folder, max_bytes=args.max_bytes)
    except (StoreError, sqlite3.Error) as exc:
        print(f"store: FAILED {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**asdict(report), "ok": report.ok, "problems": report.problems}))
    else:
        counts = " ".join(f"{k}={v}" for k, v in report.by_status.items())
        print(f"store: {'OK' if report.ok else 'FAILED'} tasks={report.tasks} {counts} "
              f"duplicated={len(report.duplicated)} expired={report.expired} "
              f"images={report.images} bytes={report.db_bytes}")
        for problem in report.problems:
            print(f"  {problem}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
