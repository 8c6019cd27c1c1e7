#!/usr/bin/env python
"""The task store: submissions/s against the JSON-lines journal it replaced, and controller
memory over a long run.

    python -m scripts.bench.bench_store submit [--tasks 3000] [--concurrency 64] [--image-kb 0]
    python -m scripts.bench.bench_store run [--tasks 100000] [--retention 20] [--concurrency 32]

Both drive the controller's :class:`~controller.ownership.coordinator.Coordinator` in-process,
on one asyncio loop, with a bounded in-memory queue standing in for the request ring
(:class:`~controller.app.LocalQueue`) and fake workers calling the control-channel handlers.

``submit``: ``--concurrency`` clients submit ``--tasks`` tasks, each answered once durable
(what the front door waits for), first with the JSON-lines journal (a faithful copy of the
code the store replaced: one append + fsync per accepted task, on the loop), then with the
SQLite store; prints submissions/s of each and the ratio, measured in the same run.

``run``: ``--tasks`` tasks through their whole lifecycle (submit, encoder claim and handoff,
transformer claim, two progress steps and handoff, decoder claim, completion with a result
file), ``--concurrency`` at a time, with the store's retention window set to ``--retention``
seconds (result files deleted with the rows). Every ``--every`` tasks it prints the
process's resident memory, the tasks in memory (unfinished / recent finished), the rows in
the store and the size of its files.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from contracts.roles import Role
from controller.app import LocalQueue
from controller.config import CoordinatorConfig
from controller.ownership.coordinator import Coordinator
from controller.tasks.journal import TaskJournal
from controller.tasks.store_check import check
from controller.tasks.table import TaskTable, open_table
from controller.tasks.tasks import TERMINAL, Task, task_record

PIPELINE = "qwen_i2i"


class JsonLinesJournal(TaskJournal):
    """The journal the store replaced (controller/tasks/tasks.py before it), kept as the baseline:
    an accepted or finished task is appended to ``tasks.jsonl`` and fsync'd, on the caller's
    thread (the event loop), the input image written beside it."""

    def __init__(self, folder: Path) -> None:
        super().__init__(None)
        self.legacy = folder
        (folder / "images").mkdir(parents=True, exist_ok=True)

    def record(self, event: str, task: Task) -> Any:
        if event not in ("accepted", "rejected") and task.stage not in TERMINAL:
            return None  # the old journal recorded only these events
        image = self.legacy / "images" / task.task_id
        if event == "accepted" and task.image_bytes is not None:
            image.write_bytes(task.image_bytes)
        rec = {"event": event, "at": time.time(), "task": task_record(task)}
        with (self.legacy / "tasks.jsonl").open("a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if event != "accepted":
            image.unlink(missing_ok=True)
        return None


def coordinator(folder: Path, *, legacy: bool, capacity: int, retention: float = 86400.0
                ) -> Coordinator:
    table = (TaskTable(JsonLinesJournal(folder / ".journal")) if legacy else
             open_table(folder / ".journal", retention_s=retention, delete_results=True))
    config = CoordinatorConfig(pipeline=PIPELINE, output_dir=folder / "results",
                               lease_timeout_s=600.0, max_pending=capacity)
    return Coordinator(config, table, LocalQueue(capacity, 4096))  # type: ignore[arg-type]


def new_task(i: int, image: bytes | None) -> Task:
    t = Task(task_id=f"t{i}", kind="image", pipeline=PIPELINE,
             request={"task": PIPELINE, "prompt": f"task {i}", "seed": i}, save_result_path="")
    t.image_bytes = image
    return t


async def submit_one(co: Coordinator, task: Task) -> None:
    co.submit(task)
    fut = co.table.journal.durable(task.task_id)
    if fut is not None:
        await asyncio.wrap_future(fut)


async def submissions(folder: Path, legacy: bool, n: int, conc: int, image: bytes | None
                      ) -> float:
    co = coordinator(folder, legacy=legacy, capacity=n)
    nxt = iter(range(n))

    async def client() -> None:
        for i in nxt:
            await submit_one(co, new_task(i, image))

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(conc)))
    rate = n / (time.perf_counter() - t0)
    co.close()
    return rate


def cmd_submit(args: argparse.Namespace) -> None:
    image = os.urandom(args.image_kb << 10) if args.image_kb else None
    print(f"{args.tasks} submissions, {args.concurrency} concurrent clients, "
          f"image {args.image_kb} KiB; load average {open('/proc/loadavg').read().split()[:3]}")
    rates: dict[str, list[float]] = {"json-lines": [], "sqlite": []}
    for _ in range(args.rounds):
        for name in rates:
            with tempfile.TemporaryDirectory(prefix="bench-store-", dir=args.dir) as tmp:
                rate = asyncio.run(submissions(Path(tmp), name == "json-lines", args.tasks,
                                               args.concurrency, image))
            rates[name].append(rate)
            print(f"  {name:>10}: {rate:8.0f} submissions/s", flush=True)
    best = {k: max(v) for k, v in rates.items()}
    print(f"| journal | submissions/s (best of {args.rounds}) |\n| --- | --- |")
    for name, rate in best.items():
        print(f"| {name} | {rate:,.0f} |")
    print(f"| sqlite / json-lines | {best['sqlite'] / best['json-lines']:.1f}x |")
    print(f"load average after: {open('/proc/loadavg').read().split()[:3]}")


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def lifecycle_run(folder: Path, args: argparse.Namespace) -> None:
    co = coordinator(folder, legacy=False, capacity=args.concurrency * 2,
                     retention=args.retention)
    enc, dit, dec = (co.on_register(role.value, role.value[:3], 1, PIPELINE, "")
                     for role in Role)
    ring: LocalQueue = co.request_ring  # type: ignore[assignment]
    result = b"r" * args.result_bytes
    store = co.table.journal.store
    assert store is not None
    done = 0
    t_start = time.perf_counter()
    print("| tasks done | elapsed s | tasks/s | RSS MiB | in memory (unfinished / recent) "
          "| store rows | store files MiB |")
    print("| --- | --- | --- | --- | --- | --- | --- |", flush=True)

    def report() -> None:
        rows = sum(store.counts().values())
        size = sum(p.stat().st_size for p in (folder / ".journal").glob("tasks.db*"))
        el = time.perf_counter() - t_start
        print(f"| {done:,} | {el:.0f} | {done / max(el, 1e-9):,.0f} | {rss_mib():.1f} | "
              f"{len(co.table.tasks)} / {len(co.table.history.recent)} | {rows:,} | "
              f"{size / 2**20:.1f} |", flush=True)

    async def lane(ids: Any) -> None:
        nonlocal done
        for i in ids:
            task = new_task(i, None)
            await submit_one(co, task)
            job = ring.q.get_nowait()
            tid, attempt = job["task_id"], job["attempt"]
            assert co.on_claim(enc, tid, attempt)[0]
            co.on_handoff(enc, tid, attempt)
            assert co.on_claim(dit, tid, attempt)[0]
            co.on_progress(dit, tid, attempt, 1, 2)
            co.on_progress(dit, tid, attempt, 2, 2)
            co.on_handoff(dit, tid, attempt)
            assert co.on_claim(dec, tid, attempt)[0]
            assert await co.on_complete(dec, tid, attempt, "png", "image/png", result)
            done += 1
            if done % args.every == 0:
                report()
            if done % 1000 == 0:
                await asyncio.sleep(0)  # let the retention task in

    async def retention() -> None:
        from controller.app import retention_loop

        await retention_loop(co, args.retention)

    pruner = asyncio.create_task(retention())
    ids = iter(range(args.tasks))
    await asyncio.gather(*(lane(ids) for _ in range(args.concurrency)))
    pruner.cancel()
    co.close()
    report_ = check(folder / ".journal")
    print(f"store check: {'OK' if report_.ok else 'FAILED'} rows={report_.tasks} "
          f"duplicated={len(report_.duplicated)} expired={report_.expired} "
          f"{report_.problems}")


def cmd_run(args: argparse.Namespace) -> None:
    print(f"{args.tasks:,} tasks, {args.concurrency} in flight, retention {args.retention:g} s; "
          f"load average {open('/proc/loadavg').read().split()[:3]}")
    with tempfile.TemporaryDirectory(prefix="bench-store-run-", dir=args.dir) as tmp:
        asyncio.run(lifecycle_run(Path(tmp), args))
    print(f"load average after: {open('/proc/loadavg').read().split()[:3]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="where the temporary stores go")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("submit")
    s.add_argument("--tasks", type=int, default=3000)
    s.add_argument("--concurrency", type=int, default=64)
    s.add_argument("--image-kb", type=int, default=0)
    s.add_argument("--rounds", type=int, default=3)
    r = sub.add_parser("run")
    r.add_argument("--tasks", type=int, default=100_000)
    r.add_argument("--concurrency", type=int, default=32)
    r.add_argument("--retention", type=float, default=20.0)
    r.add_argument("--every", type=int, default=10_000)
    r.add_argument("--result-bytes", type=int, default=64)
    args = ap.parse_args()
    if args.cmd == "submit":
        cmd_submit(args)
    else:
        cmd_run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
