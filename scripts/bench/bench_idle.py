#!/usr/bin/env python
"""Idle cost and wake-up latency: many idle workers connected to one controller.

    python -m scripts.bench.bench_idle --workers 256 [--window 20] [--probes 60] [--md FILE]

Starts a synthetic group (``workers/models/families/synthetic.py``, no torch in any worker) with
``--workers`` workers split evenly over the three roles, in batches (``--batch``), watching
the machine's available memory. Then:

1. idle cost: CPU time of the controller process (utime + stime from /proc/<pid>/stat)
   over ``--window`` seconds with nothing to do, as % of one core; the workers' CPU too;
2. wake-up latency: ``--probes`` tasks, one at a time, each pushed into an empty request
   ring after a pause (``--gap``) long enough for every worker to have backed off. Latency of
   a hop = the controller's time of the claim minus its time of the push (request ring:
   ``encoding - queued``), or of the producer's handoff (phase1: ``denoising - phase1``;
   phase2: ``decoding - phase2``). Both ends are the controller's own clock.

Every process is stopped by pid at the end. Prints a markdown table with the exact command
and the load average.
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from contracts.roles import Role
from launcher import LocalGroup, group_config
from workers.models.families.synthetic import write_config

ROLES = tuple(role.value for role in Role)  # the worker roles, in pipeline order
HOPS = {"request": ("queued", "encoding"), "phase1": ("phase1", "denoising"),
        "phase2": ("phase2", "decoding")}
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def mem_available_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def private_mb(pid: int) -> tuple[int, int]:
    """(RSS, anonymous) MiB of a process."""
    text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    get = lambda key: int(text.split(key + ":")[1].split()[0]) // 1024  # noqa: E731
    return get("Rss"), get("Anonymous")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def start_workers(group: LocalGroup, n: int, batch: int, min_free_mb: int) -> None:
    counts = dict.fromkeys(ROLES, 0)
    started = 0
    while started < n:
        free = mem_available_mb()
        if free < min_free_mb:
            raise RuntimeError(f"only {free} MiB of memory available after {started} "
                               f"workers (limit --min-free-mb {min_free_mb}); stopping")
        for _ in range(min(batch, n - started)):
            role = ROLES[started % len(ROLES)]
            group.start(role)
            counts[role] += 1
            started += 1
        group.wait_workers(counts, timeout=300)
        print(f"  {started} workers registered, {mem_available_mb()} MiB available",
              flush=True)


def probe(client: httpx.Client, url: str, task_id: str, timeout: float = 60) -> dict[str, Any]:
    r = client.post(f"{url}/v1/tasks/image/", json={
        "task_id": task_id, "prompt": "wake up", "infer_steps": 1})
    r.raise_for_status()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st: dict[str, Any] = client.get(f"{url}/v1/tasks/{task_id}/status").json()
        if st["status"] == "completed":
            return st
        if st["status"] in ("failed", "cancelled"):
            raise RuntimeError(f"{task_id} {st['status']}: {st['error']}")
        time.sleep(0.05)
    raise TimeoutError(f"{task_id} not done after {timeout} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workers", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16, help="workers started at a time")
    ap.add_argument("--window", type=float, default=20.0, help="idle CPU window, seconds")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds idle before measuring")
    ap.add_argument("--probes", type=int, default=60)
    ap.add_argument("--gap", type=float, default=0.5, help="idle seconds before each probe")
    ap.add_argument("--min-free-mb", type=int, default=3000,
                    help="stop starting workers below this much available memory")
    ap.add_argument("--md", type=Path, help="append the markdown report here")
    args = ap.parse_args(argv)
    if args.workers < len(ROLES):
        ap.error(f"--workers must be at least {len(ROLES)} (one per role)")
    command = "python -m scripts.bench.bench_idle " + shlex.join(sys.argv[1:] if argv is None
                                                          else argv)
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="bench-idle-") as tmp:
        wd = Path(tmp)
        model = wd / "synthetic"
        # Tiny, quick stages: the probes measure the runtime's wake-up, not the stages.
        write_config(model, encoder_s=0, step_s=0, decoder_s=0,
                     phase1={"e": {"shape": [16], "dtype": "float32"}},
                     phase2={"l": {"shape": [16], "dtype": "float32"}})
        cfg = group_config("synthetic", str(model), wd, staging_pool_mb=4,
                           max_pending_tasks=1024)
        group = LocalGroup(cfg, wd)
        try:
            group.start("controller")
            group.wait_http()
            ctl = group.services[0].proc.pid
            t0 = time.monotonic()
            start_workers(group, args.workers, args.batch, args.min_free_mb)
            startup = time.monotonic() - t0
            workers = [s.proc.pid for s in group.services[1:]]
            time.sleep(args.settle)
            load_idle = os.getloadavg()
            c0, w0, t0 = cpu_seconds(ctl), sum(map(cpu_seconds, workers)), time.monotonic()
            time.sleep(args.window)
            c1, w1, t1 = cpu_seconds(ctl), sum(map(cpu_seconds, workers)), time.monotonic()
            ctl_pct = 100 * (c1 - c0) / (t1 - t0)
            workers_pct = 100 * (w1 - w0) / (t1 - t0)
            mem = [private_mb(p) for p in workers[:8]]
            lat: dict[str, list[float]] = {hop: [] for hop in HOPS}
            with httpx.Client(timeout=30) as client:
                probe(client, group.url, "probe-warm")  # first pulls open connections
                for i in range(args.probes):
                    time.sleep(args.gap * (1 + rng.random()))
                    st = probe(client, group.url, f"probe-{i}")["stage_times"]
                    for hop, (a, b) in HOPS.items():
                        lat[hop].append((st[b] - st[a]) * 1e3)
            load_after = os.getloadavg()
        finally:
            group.stop()
    rows = ["| hop | probes | p50 ms | p99 ms | max ms |", "| --- | --- | --- | --- | --- |"]
    for hop, values in lat.items():
        rows.append(f"| {hop} ring: push/handoff -> claim | {len(values)} | "
                    f"{pct(values, 0.5):.2f} | {pct(values, 0.99):.2f} | {max(values):.2f} |")
    report = "\n".join([
        f"`{command}`",
        "",
        f"{args.workers} idle synthetic workers ({args.workers // 3}+ per role), started in "
        f"{startup:.0f} s; per worker RSS {statistics.mean(m[0] for m in mem):.0f} MiB, "
        f"anonymous {statistics.mean(m[1] for m in mem):.0f} MiB.",
        "",
        f"- controller CPU while idle: **{ctl_pct:.1f} % of one core** over "
        f"{t1 - t0:.0f} s; all workers together: {workers_pct:.1f} % of one core",
        f"- load average when idle {load_idle[0]:.2f} {load_idle[1]:.2f} {load_idle[2]:.2f}, "
        f"after the probes {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} "
        f"({os.cpu_count()} cores)",
        "",
        *rows,
    ])
    print("\n" + report)
    if args.md:
        with args.md.open("a") as fh:
            fh.write(report + "\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
