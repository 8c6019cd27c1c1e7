#!/usr/bin/env python3
"""What a dead or frozen DiT costs while DiTs checkpoint (issue 39), measured from outside on
a tiny CPU group: SIGKILL and SIGSTOP / SIGCONT by pid, nothing armed inside.

    python -m scripts.chaos.chaos_checkpoints [--kills 20] [--freezes 5] [--pipeline wan_t2v]

A controller, one encoder, one decoder and two DiT workers that checkpoint every step (Wan2.1
T2V's tiny random-weight model by default: UniPC's state travels as many small tensors, so a
checkpoint is many reads and as many release writes). Its step is shorter than a
checkpoint's round trip, so a DiT has a checkpoint in flight at every instant of its loop:
a random instant of its loop is a random instant of checkpointing.

* kills -- a DiT running a request is SIGKILLed at a random instant after its second step;
  measured: the time from the kill until the controller put the task back in play (its log
  line, to the millisecond), the same from the instant the kernel had torn the process down
  (its sockets closed; waitpid returned), when a client polling the task's status every few
  ms saw its attempt move on, and the release writes to the dead DiT that the controller
  tried (and failed: about a second each) or dropped. The other DiT
  takes the retry, a new DiT replaces the dead one. ``--lease-s`` (10) bounds the wait when
  the drop is not noticed.
* freezes -- DiT A and DiT B each run a request; A is SIGSTOPped at a random instant of its
  loop, kept frozen ``--frozen-s`` (12: past Mooncake's 10 s read timeout), then SIGCONTed.
  Measured, from the controller's log: the longest gap between B's kept checkpoints over
  the frozen span, and whether B kept its lease (``--freeze-lease-s``, 6) -- its request
  completes in its first attempt.

Every request must complete exactly once. Prints two tables; ``--out`` gets results.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import re
import signal
import statistics
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from launcher import LocalGroup, Service, group_config, wait_task
from scripts import ROOT
from scripts.bench.bench_checkpoints import dit, folder, holder, status, wait
from scripts.bench.bench_serving import log

BODIES: dict[str, dict[str, Any]] = {  # a request of the tiny model (steps: per part)
    "wan_t2v": {"prompt": "a fox in the snow", "height": 32, "width": 32,
                "target_video_length": 5, "target_fps": 8},
    "synthetic": {"prompt": "checkpoints"},
}
EVERY_STEP = {"transformer": {"checkpoint_every_steps": 1}}


def start_group(args: argparse.Namespace, workdir: Path, lease_s: float) -> LocalGroup:
    workdir.mkdir(parents=True, exist_ok=True)
    model = (folder(workdir, 0.05) if args.pipeline == "synthetic"
             else Path(args.models) / args.pipeline)
    cfg = group_config(args.pipeline, str(model), workdir, lease_timeout_s=lease_s,
                       heartbeat_interval_s=0.5, video_threads=1)
    group = LocalGroup(cfg, workdir)
    group.start("controller")
    group.wait_http(timeout=120)
    group.start("encoder")
    group.start("decoder")
    for _ in range(2):
        dit(group, EVERY_STEP)
    group.wait_workers({"encoder": 1, "decoder": 1, "transformer": 2}, timeout=600)
    return group


def post(group: LocalGroup, args: argparse.Namespace, steps: int, seed: int) -> str:
    kind = "video" if args.pipeline.startswith("wan") else "image"
    r = httpx.post(f"{group.url}/v1/tasks/{kind}/", timeout=60,
                   json={**BODIES[args.pipeline], "seed": seed, "infer_steps": steps})
    r.raise_for_status()
    return str(r.json()["task_id"])


def denoising(tid: str, at_least: int) -> Any:
    return lambda s: s["stage"] == "denoising" and s["step"] >= at_least and s["worker"]


# -- kills -----------------------------------------------------------------------------------
def kills(args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    back: list[float] = []
    seen: list[float] = []
    after_end: list[float] = []
    failed_releases: list[int] = []
    dropped: list[int] = []
    with_lease = 0
    group = start_group(args, args.out / "work" / "kills", args.lease_s)
    try:
        ctl = group.services[0]
        for i in range(args.kills):
            tid = post(group, args, args.steps, i)
            st = wait(group.url, tid, denoising(tid, 2))
            time.sleep(rng.uniform(0, args.spread_s))
            st = status(group.url, tid)
            if st["stage"] != "denoising":
                raise RuntimeError(f"request {tid} left denoising before the kill: raise "
                                   "--steps")
            victim = holder(group, st["worker"])
            before = len(ctl.log())
            ended: list[float] = []  # when the kernel had torn the process down (reaped)
            reaper = threading.Thread(target=_reap, args=(victim, ended))
            t0, killed_at = time.monotonic(), time.time()
            victim.proc.send_signal(signal.SIGKILL)
            reaper.start()
            while status(group.url, tid)["attempt"] == st["attempt"]:
                if time.monotonic() - t0 > args.lease_s + 30:
                    raise RuntimeError(f"request {tid} never went back in play")
                time.sleep(0.002)
            seen.append(time.monotonic() - t0)
            # The controller's own word, to the millisecond: the attempt ended, retrying.
            (at, _), *_ = _stamped(ctl.log()[before:], rf"task {tid} attempt {st['attempt']}: "
                                   r".* retrying")
            back.append(at - killed_at)
            reaper.join(60)
            after_end.append(at - ended[0])
            group.services.remove(victim)  # reaped: no longer part of the group
            dit(group, EVERY_STEP)
            final = wait_task(group.url, tid, timeout=600)
            if final["status"] != "completed":
                raise RuntimeError(f"request {tid} {final['status']}: {final.get('error')}")
            text = ctl.log()[before:]
            failed_releases.append(text.count("release of producer block failed"))
            dropped.append(sum(int(n) for n in re.findall(
                r"(\d+) release\(s\) of producer blocks at \S+ dropped", text)))
            with_lease += "expired while" in text
            group.wait_workers({"transformer": 2}, timeout=600)
            log(f"kill {i + 1}: at step {st['step']}, back in play after {back[-1]:.3f} s, "
                f"{after_end[-1]:+.3f} s from the process's end (seen over HTTP after "
                f"{seen[-1]:.3f} s) "
                f"({failed_releases[-1]} release(s) failed, {dropped[-1]} dropped); resumed "
                f"from {final['resumed_from']}")
        done = _completions(ctl.log())
    finally:
        group.stop(timeout=60)
    return {"kills": args.kills, "back_s": back, "max_s": max(back), "p95_s": _p95(back),
            "median_s": statistics.median(back), "after_end_s": after_end,
            "after_end_max_s": max(after_end), "seen_s": seen,
            "seen_p95_s": _p95(seen), "seen_max_s": max(seen), "failed_releases": failed_releases,
            "dropped_releases": dropped, "lease_expiries": with_lease,
            "once": all(n == 1 for n in done.values())}


def _reap(victim: Service, ended: list[float]) -> None:
    victim.proc.wait()
    ended.append(time.time())


# -- freezes ---------------------------------------------------------------------------------
def freezes(args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    trials: list[dict[str, Any]] = []
    group = start_group(args, args.out / "work" / "freezes", args.freeze_lease_s)
    try:
        ctl = group.services[0]
        for i in range(args.freezes):
            ta = post(group, args, args.freeze_steps, 100 + 10 * i)
            a = holder(group, wait(group.url, ta, denoising(ta, 2))["worker"])
            # B's requests, one after the other, outlast the freeze (a request has at most
            # 1000 steps); A is busy, so B takes each.
            tbs = [post(group, args, args.freeze_steps, 101 + 10 * i + k)
                   for k in range(args.chain)]
            b_name = wait(group.url, tbs[0], denoising(tbs[0], 2))["worker"]
            time.sleep(rng.uniform(0, args.spread_s))
            stopped = time.time()
            a.proc.send_signal(signal.SIGSTOP)
            time.sleep(args.frozen_s)  # the span measured: a span, not a wait for an event
            thawed = time.time()
            a.proc.send_signal(signal.SIGCONT)
            finals = [wait_task(group.url, t, 900) for t in (ta, *tbs)]
            if any(f["status"] != "completed" for f in finals):
                raise RuntimeError(f"a request did not complete: {finals}")
            kept = [at for at, m in _stamped(ctl.log(), r"(?:checkpoint|final latents) of "
                                             r"step \d+/\d+ kept from (\S+)")
                    if m.group(1) == b_name]
            if not any(at >= thawed for at in kept):
                raise RuntimeError("B's requests ended before the freeze did: raise --chain")
            span = ([max([at for at in kept if at <= stopped], default=stopped)]
                    + [at for at in kept if stopped < at < thawed]
                    + [min(at for at in kept if at >= thawed)])
            gap = max(y - x for x, y in itertools.pairwise(span))
            held = all(f["attempt"] == 1 for f in finals[1:])
            trials.append({"gap_s": gap, "kept_while_frozen": len(span) - 2,
                           "b_lease_held": held, "a_attempt": finals[0]["attempt"]})
            log(f"freeze {i + 1}: B's longest gap between kept checkpoints {gap:.2f} s "
                f"({len(span) - 2} kept in {args.frozen_s:g} s); B's lease held: {held}; "
                f"A's request in attempt {finals[0]['attempt']}")
        done = _completions(ctl.log())
    finally:
        group.stop(timeout=60)
    return {"freezes": args.freezes, "frozen_s": args.frozen_s, "lease_s": args.freeze_lease_s,
            "trials": trials, "max_gap_s": max(t["gap_s"] for t in trials),
            "b_leases_held": sum(t["b_lease_held"] for t in trials),
            "once": all(n == 1 for n in done.values())}


# -- helpers ---------------------------------------------------------------------------------
def _p95(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(0.95 * (len(s) - 1)))]


def _stamped(text: str, pattern: str) -> list[tuple[float, re.Match[str]]]:
    """(wall-clock time, match) of each log line matching ``pattern``."""
    out = []
    for line in text.splitlines():
        m = re.search(pattern, line)
        if m is not None:
            out.append((datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp(), m))
    return out


def _completions(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for tid in re.findall(r"task (\S+) stage=completed", text):
        out[tid] = out.get(tid, 0) + 1
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--pipeline", choices=sorted(BODIES), default="wan_t2v")
    ap.add_argument("--models", default=str(ROOT / "out" / "tiny-models"),
                    help="tiny models (python -m modelkit.tiny --out DIR)")
    ap.add_argument("--only", default="kills,freezes")
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--steps", type=int, default=200, help="steps of a killed request")
    ap.add_argument("--lease-s", type=float, default=10.0, help="lease of the kills' group")
    ap.add_argument("--freezes", type=int, default=5)
    ap.add_argument("--frozen-s", type=float, default=12.0)
    ap.add_argument("--freeze-steps", type=int, default=1000,
                    help="steps of the requests of the freezes")
    ap.add_argument("--chain", type=int, default=3,
                    help="B's requests per freeze, one after the other (they outlast it)")
    ap.add_argument("--freeze-lease-s", type=float, default=6.0)
    ap.add_argument("--spread-s", type=float, default=1.0,
                    help="the random instant: uniform in [0, this] after the second step")
    ap.add_argument("--seed", type=int, default=39)
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "chaos_checkpoints")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    parts = set(args.only.split(","))
    results: dict[str, Any] = {"pipeline": args.pipeline}
    if "kills" in parts:
        results["kills"] = kills(args, rng)
    if "freezes" in parts:
        results["freezes"] = freezes(args, rng)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    print(report(results))
    return 0 if all(results[p]["once"] for p in ("kills", "freezes") if p in results) else 1


def report(r: dict[str, Any]) -> str:
    lines = []
    if "kills" in r:
        k = r["kills"]
        lines += [f"SIGKILL of a checkpointing DiT ({r['pipeline']}): kill to task back in play",
                  "| kills | median | p95 | max | after the process ended, max | seen over "
                  "HTTP, p95 / max | release writes failed / dropped | lease expiries | "
                  "exactly once |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
                  f"| {k['kills']} | {k['median_s']:.3f} s | {k['p95_s']:.3f} s | "
                  f"{k['max_s']:.3f} s | {k['after_end_max_s']:+.3f} s | "
                  f"{k['seen_p95_s']:.3f} / {k['seen_max_s']:.3f} s | "
                  f"{sum(k['failed_releases'])} / "
                  f"{sum(k['dropped_releases'])} | {k['lease_expiries']} | {k['once']} |", ""]
    if "freezes" in r:
        f = r["freezes"]
        gaps = ", ".join(f"{t['gap_s']:.2f}" for t in f["trials"])
        lines += [f"SIGSTOP of DiT A for {f['frozen_s']:g} s, then SIGCONT ({r['pipeline']}, "
                  f"lease {f['lease_s']:g} s): DiT B's kept checkpoints",
                  "| freezes | longest gap, per freeze | longest | B's lease held | exactly "
                  "once |", "| --- | --- | --- | --- | --- |",
                  f"| {f['freezes']} | {gaps} s "
                  f"| {f['max_gap_s']:.2f} s | {f['b_leases_held']} of {f['freezes']} | "
                  f"{f['once']} |"]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
