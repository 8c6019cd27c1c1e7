"""What the chaos soak checks at the end (``scripts/chaos/chaos_soak.py``): every accepted task
completed exactly once -- by the controller's status, its task store, its logs and the
result files -- none failed or lost, the store bounded, no staging memory left in use."""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from controller.tasks.store_check import check, completions


@dataclass
class Report:
    tasks: int = 0
    completed: int = 0
    failed: int = 0
    lost: int = 0
    duplicated: int = 0
    leaked_staging_bytes: int = 0
    kills: int = 0
    restarts: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and self.completed == self.tasks and not (
            self.failed or self.lost or self.duplicated or self.leaked_staging_bytes)

    def line(self) -> str:
        return (f"chaos: {'OK' if self.ok else 'FAILED'} tasks={self.tasks} "
                f"completed={self.completed} failed={self.failed} lost={self.lost} "
                f"duplicated={self.duplicated} leaked_staging_bytes={self.leaked_staging_bytes}"
                f" kills={self.kills} restarts={self.restarts} seconds={self.seconds:.0f}")


INJECTED_READ_FAILURE = re.compile(
    r"task (\S+) failed at worker=\S+ attempt=\d+ \(TransferFailed, transfer\): "
    r".*fault point transfer\.read fired")
"""The controller's line for a read failure injected at a worker (``transfer.read``) that
the holder of the attempt reported: the only failures the soak's tasks may be charged."""

STORE_BYTES_BASE = 8 << 20
"""SQLite's fixed share: the WAL grows to ~4 MiB between checkpoints, plus page caches."""
STORE_BYTES_PER_TASK = 4096
"""A task's row is ~1.1 KB (BENCHMARKS.md, task store); four times that is the bound."""


def store_completions(output_dir: Path, tasks: int) -> tuple[Counter[str], list[str], str]:
    """(completions recorded per task, the store check's problems, a summary) of the
    controller's task store, read-only (``python -m controller.tasks.store_check --check``)."""
    folder = output_dir / ".journal"
    done: Counter[str] = Counter({tid: n for tid, (_s, n) in completions(folder).items()})
    report = check(folder, max_bytes=STORE_BYTES_BASE + STORE_BYTES_PER_TASK * tasks)
    problems = list(report.problems)
    if report.tasks > tasks:
        problems.append(f"store holds {report.tasks} tasks, {tasks} were accepted")
    return done, problems, f"task store: {report.tasks} rows, {report.db_bytes} bytes"


def final_statuses(url: str, task_ids: Iterable[str], deadline: float
                   ) -> dict[str, dict[str, Any]]:
    """Each task's status once it is over (or at ``deadline``); ``lost`` when unknown."""
    out = {}
    for tid in task_ids:
        while True:
            res = httpx.get(f"{url}/v1/tasks/{tid}/status", timeout=30)
            st: dict[str, Any] = res.json() if res.status_code == 200 else {"status": "lost"}
            if st["status"] not in ("pending", "processing") or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        out[tid] = st
    return out


def check_tasks(r: Report, statuses: dict[str, dict[str, Any]], results: Path,
                controller_logs: list[str]) -> list[str]:
    """Fill ``r``'s task counts; returns notes for the output."""
    counts = Counter(st["status"] for st in statuses.values())
    r.completed, r.failed = counts["completed"], counts["failed"]
    r.lost = r.tasks - r.completed - r.failed - counts["cancelled"]
    for tid, st in statuses.items():
        if st["status"] == "failed":
            r.problems.append(f"{tid} failed: {st.get('error')}")
    stored, store_problems, store_summary = store_completions(results, r.tasks)
    r.problems.extend(store_problems)
    logged: Counter[str] = Counter()
    for log in controller_logs:
        logged.update(re.findall(r"task (\S+) stage=completed", log))
    files = Counter(p.name.split(".")[0] for p in results.iterdir()
                    if p.is_file() and not p.name.endswith(".part"))
    for tid, st in statuses.items():
        if max(stored[tid], logged[tid], files[tid]) > 1:
            r.duplicated += 1
        elif st["status"] == "completed" and min(stored[tid], logged[tid], files[tid]) < 1:
            r.problems.append(f"{tid}: store {stored[tid]}, logged {logged[tid]}, "
                              f"result files {files[tid]}")
    # Only the injected read failures may be charged (a kill, a restart, a lost item, a
    # stalled worker never are): a task charged more often than it met one was charged for
    # the system's fault.
    injected: Counter[str] = Counter()
    for log in controller_logs:
        injected.update(INJECTED_READ_FAILURE.findall(log))
    charged = 0
    for tid, st in statuses.items():
        charged += st.get("failures", 0)
        if st.get("failures", 0) > injected[tid]:
            r.problems.append(f"{tid} was charged {st['failures']} failure(s), "
                              f"{injected[tid]} of them injected: {st.get('error')}")
    attempts = Counter(st.get("attempt", 0) for st in statuses.values())
    return [store_summary,
            f"attempts per task: {dict(sorted(attempts.items()))}; failures charged: "
            f"{charged}, injected read failures reported: {sum(injected.values())}"]


def pool_used(port: int) -> int:
    """Bytes in use in the staging pool of the worker whose metrics are on ``port``."""
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0  # died meanwhile
    m = re.search(r"^diffring_staging_pool_used_bytes\{[^}]*\} (\S+)$", text, re.M)
    return int(float(m.group(1))) if m else 0


def check_resumed(r: Report, url: str, statuses: dict[str, dict[str, Any]], results: Path,
                  pick: Callable[[list[str], int], list[str]], sample: int,
                  body: dict[str, Any]) -> str:
    """A sample (``pick(resumed, n)``) of the tasks that resumed from a checkpoint or from
    kept final latents, run again with no fault: their result files must be byte-identical.
    Adds a problem to ``r`` per difference; returns a note."""
    resumed = sorted(t for t, st in statuses.items()
                     if st.get("status") == "completed" and st.get("resumes"))
    chosen = pick(resumed, min(sample, len(resumed)))
    same = 0
    for tid in chosen:
        i = int(tid.rsplit("-", 1)[1])
        ref = f"again-{i:05d}"
        res = httpx.post(f"{url}/v1/tasks/image/", timeout=30,
                         json={"prompt": f"chaos {i}", "seed": i, "task_id": ref, **body})
        st = final_statuses(url, [ref], time.monotonic() + 300)[ref]
        if res.status_code != 200 or st["status"] != "completed":
            r.problems.append(f"re-run of {tid} did not complete: {st}")
            continue
        if (results / f"{tid}.png").read_bytes() == (results / f"{ref}.png").read_bytes():
            same += 1
        else:
            r.problems.append(f"{tid}, resumed from step {statuses[tid].get('resumed_from')}, "
                              "differs from an uninterrupted run")
    return (f"resumed={len(resumed)} (from a checkpoint or kept final latents); "
            f"sample={len(chosen)} identical={same}")
