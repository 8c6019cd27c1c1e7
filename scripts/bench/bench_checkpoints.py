#!/usr/bin/env python3
"""Checkpointed denoising, drain at a step boundary, priorities with preemption (issue 23),
measured on groups of processes on this machine with the synthetic pipeline.

    python -m scripts.bench.bench_checkpoints [--quick] [--only lost,cost,drain,priority]

The synthetic DiT takes ``step_s`` per step in real time (``mode: sleep``) and carries
Wan2.1-480P-sized tensors (Phase1 1x512x4096 float32 embeddings, 8 MiB; Phase2 latents
1x16x21x60x104 float32, 8.4 MiB, plus three more of that size standing for UniPC's history,
so a checkpoint moves what a real Wan one does), so what is measured is the runtime's cost
and the work a fault throws away, not a model's speed. Each part starts its own group
(controller, one encoder, one decoder, DiT workers) and prints one table:

* lost  -- DiT work lost per DiT death at a random step: a DiT running a request is SIGKILLed
  at a random step; another DiT takes the retry. Lost = steps the dead attempt had run minus
  the step the retry resumed from (0 without checkpoints), x ``step_s``. Before: checkpoints
  off; after: every ``--every`` steps.
* cost  -- what a checkpoint costs: the copy of the loop's state on the DiT's own path
  (``diffring_stage_seconds{step="checkpoint_capture"}``), sending it (staging in the pool,
  the ``checkpoint`` call, the controller's Mooncake pull; off the loop's path), the bytes.
* drain -- SIGTERM to exit of a DiT in the middle of a request, against its step time (with
  checkpoints it hands the request back at the next step boundary; without, it finishes it).
* priority -- a saturating stream of long low-priority requests on two DiTs, and short
  high-priority ones arriving meanwhile: their latency (accepted to completed, p50 / p99)
  with no priorities (all normal, first come first served), with priorities (release order
  only), and with priorities and preemption.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import signal
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from launcher import LocalGroup, Service, free_ports, group_config
from scripts import ROOT
from scripts.bench.bench_serving import log
from workers.models.families.synthetic import write_config

LATENT = [1, 16, 21, 60, 104]
WAN_SIZED = {
    "phase1": {"prompt_embeds": {"shape": [1, 512, 4096], "dtype": "float32"}},
    # The latents and three tensors of their size: what a UniPC checkpoint carries besides
    # them (two model outputs and the last sample).
    "phase2": {name: {"shape": LATENT, "dtype": "float32"}
               for name in ("latents", "history0", "history1", "history2")},
}


def folder(workdir: Path, step_s: float) -> Path:
    path = workdir / f"synthetic-{step_s:g}"
    write_config(path, step_s=step_s, **json.loads(json.dumps(WAN_SIZED)))
    return path


def status(url: str, tid: str) -> dict[str, Any]:
    out: dict[str, Any] = httpx.get(f"{url}/v1/tasks/{tid}/status", timeout=60).json()
    return out


def submit(url: str, body: dict[str, Any]) -> str:
    r = httpx.post(f"{url}/v1/tasks/image/", json=body, timeout=60)
    r.raise_for_status()
    return str(r.json()["task_id"])


def wait(url: str, tid: str, until: Any, timeout: float = 600) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        st = status(url, tid)
        if until(st):
            return st
        if st["status"] in ("failed", "cancelled"):
            raise RuntimeError(f"task {tid} {st['status']}: {st.get('error')}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"task {tid}: still {st['stage']} after {timeout} s")
        time.sleep(0.01)


def done(st: dict[str, Any]) -> bool:
    return st["status"] == "completed"


@contextlib.contextmanager
def group(workdir: Path, step_s: float, dits: int, dit_extra: dict[str, Any],
          **controller: Any) -> Iterator[LocalGroup]:
    cfg = group_config("synthetic", str(folder(workdir, step_s)), workdir, lease_timeout_s=5.0,
                       heartbeat_interval_s=0.5, torch_threads=1, **controller)
    g = LocalGroup(cfg, workdir)
    try:
        g.start("controller")
        g.wait_http(timeout=120)
        g.start("encoder")
        g.start("decoder")
        for _ in range(dits):
            dit(g, dit_extra)
        g.wait_workers({"encoder": 1, "decoder": 1, "transformer": dits}, timeout=300)
        yield g
    finally:
        g.stop(timeout=60)


METRIC_PORTS: dict[int, int] = {}
"""The metrics port of each DiT started here, by pid."""


def dit(g: LocalGroup, extra: dict[str, Any]) -> Service:
    (port,) = free_ports(1)
    svc = g.start("transformer", {**extra, "server": {"metric_port": port}})
    METRIC_PORTS[svc.proc.pid] = port
    return svc


def holder(g: LocalGroup, worker: str | None) -> Service:
    """The DiT service a status names (worker names end in the pid)."""
    for svc in g.services:
        if svc.role == "transformer" and worker and worker.endswith(f"-{svc.proc.pid}"):
            return svc
    raise RuntimeError(f"no DiT service is {worker!r}")


# -- lost ------------------------------------------------------------------------------------
def lost_work(workdir: Path, checkpoints: bool, trials: int, steps: int, step_s: float,
              every: int, seed: int) -> dict[str, Any]:
    extra = {"transformer": {"checkpoint_every_steps": every}} if checkpoints else {}
    rng = random.Random(seed)
    lost: list[int] = []
    with group(workdir, step_s, 2, extra) as g:
        for i in range(trials):
            k = rng.randint(1, steps - 1)
            tid = submit(g.url, {"prompt": "lost", "seed": i, "infer_steps": steps})
            st = wait(g.url, tid, lambda s, k=k: s["stage"] == "denoising" and s["step"] >= k)
            victim = holder(g, st["worker"])
            victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait(60)
            g.services.remove(victim)  # reaped: no longer part of the group
            reached = st["step"]  # its last reported step (the kill lands within a step)
            dit(g, extra)  # the replacement; the other DiT takes the retry meanwhile
            final = wait(g.url, tid, done)
            lost.append(reached - (final["resumed_from"] or 0))
            g.wait_workers({"transformer": 2}, timeout=300)
            log(f"lost ({'after' if checkpoints else 'before'}): killed at step {reached}, "
                f"resumed from {final['resumed_from']}")
    return {"checkpoints": checkpoints, "kills": trials, "steps": steps, "step_s": step_s,
            "lost_steps": lost, "mean_lost_s": statistics.mean(lost) * step_s,
            "max_lost_s": max(lost) * step_s, "request_s": steps * step_s}


# -- cost ------------------------------------------------------------------------------------
def metrics(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def checkpoint_cost(workdir: Path, requests: int, steps: int, step_s: float) -> dict[str, Any]:
    extra = {"transformer": {"checkpoint_every_steps": 1}}
    with group(workdir, step_s, 1, extra) as g:
        for i in range(requests):
            wait(g.url, submit(g.url, {"prompt": "cost", "seed": i, "infer_steps": steps}),
                 done)
        svc = next(s for s in g.services if s.role == "transformer")
        m = metrics(METRIC_PORTS[svc.proc.pid])
        ckpts = httpx.get(f"{g.url}/v1/service/status", timeout=30).json()["checkpoints"]

    def hist(step: str) -> tuple[float, float]:
        key = (("role", "transformer"), ("step", step))
        return m.get(("diffring_stage_seconds_sum", key), 0.0), \
            m.get(("diffring_stage_seconds_count", key), 0.0)

    cap_s, cap_n = hist("checkpoint_capture")
    send_s, send_n = hist("checkpoint_send")
    sent = m.get(("diffring_transfer_bytes_total", (("direction", "checkpoint"),)), 0.0)
    return {"checkpoints": int(cap_n), "capture_ms": 1e3 * cap_s / max(cap_n, 1),
            "send_ms": 1e3 * send_s / max(send_n, 1), "sends": int(send_n),
            "bytes_per_send": sent / max(send_n, 1), "step_s": step_s,
            "controller_pull_s": ckpts["pull_seconds"], "kept": ckpts["kept"],
            "final": ckpts["final"]}


# -- drain -----------------------------------------------------------------------------------
def drain_time(workdir: Path, checkpoints: bool, trials: int, steps: int, step_s: float,
               seed: int) -> dict[str, Any]:
    extra = {"transformer": {"checkpoint_every_steps": 1000}} if checkpoints else {}
    rng = random.Random(seed)
    times: list[float] = []
    handed: list[float] = []
    with group(workdir, step_s, 2, extra) as g:
        for i in range(trials):
            k = rng.randint(1, steps // 2)
            tid = submit(g.url, {"prompt": "drain", "seed": i, "infer_steps": steps})
            st = wait(g.url, tid, lambda s, k=k: s["stage"] == "denoising" and s["step"] >= k)
            victim = holder(g, st["worker"])
            t0 = time.monotonic()
            victim.proc.send_signal(signal.SIGTERM)
            back = None
            while victim.proc.poll() is None:
                if back is None and status(g.url, tid)["attempt"] > st["attempt"]:
                    back = time.monotonic() - t0  # the task is the controller's again
                time.sleep(0.005)
            times.append(time.monotonic() - t0)
            if back is not None:
                handed.append(back)
            g.services.remove(victim)
            dit(g, extra)
            wait(g.url, tid, done)
            g.wait_workers({"transformer": 2}, timeout=300)
            log(f"drain ({'checkpoints' if checkpoints else 'off'}): SIGTERM at step "
                f"{st['step']}/{steps}, exit after {times[-1]:.2f} s")
    return {"checkpoints": checkpoints, "trials": trials, "step_s": step_s, "steps": steps,
            "drain_s": times, "median_s": statistics.median(times), "max_s": max(times),
            "handed_back_s": handed,
            "handed_median_s": statistics.median(handed) if handed else None}


# -- priority --------------------------------------------------------------------------------
def priority_latency(workdir: Path, mode: str, urgent: int, low_steps: int, step_s: float,
                     seed: int) -> dict[str, Any]:
    prioritised = mode != "none"
    modes: dict[str, dict[str, Any]] = {
        "none": {"release_ahead": None, "preempt_after_s": None},
        "release": {"release_ahead": 2, "preempt_after_s": None},
        "preempt": {"release_ahead": 2, "preempt_after_s": 1.0},
    }
    controller = modes[mode]
    extra = {"transformer": {"checkpoint_every_steps": 1000}}
    rng = random.Random(seed)
    highs: list[str] = []
    lows: list[str] = []
    stop = threading.Event()
    with group(workdir, step_s, 2, extra, max_pending_tasks=1024, **controller) as g:

        def feed() -> None:  # keep the DiTs saturated: 8 low-priority requests unfinished
            n = 0
            while not stop.is_set():
                unfinished = sum(status(g.url, t)["status"] in ("pending", "processing")
                                 for t in lows[-16:])
                if unfinished < 8:
                    body = {"prompt": "low", "seed": n, "infer_steps": low_steps}
                    if prioritised:
                        body["priority"] = "low"
                    lows.append(submit(g.url, body))
                    n += 1
                stop.wait(0.05)

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        time.sleep(low_steps * step_s)  # the queue fills: the DiTs are busy with low work
        for i in range(urgent):
            body = {"prompt": "high", "seed": 1000 + i, "infer_steps": 2}
            if prioritised:
                body["priority"] = "high"
            highs.append(submit(g.url, body))
            time.sleep(rng.expovariate(4 / (low_steps * step_s)))  # 4 per low request
        stop.set()
        feeder.join()
        high_lat = [(st["end_time"] - st["created_at"]) for st in
                    (wait(g.url, t, done) for t in highs)]
        low_done = [st for st in (status(g.url, t) for t in lows) if st["status"] == "completed"]
        preempted = sum(st["preemptions"] for st in low_done)
    high_lat.sort()
    return {"mode": mode, "urgent": urgent, "p50_s": statistics.median(high_lat),
            "p99_s": high_lat[min(len(high_lat) - 1, round(0.99 * (len(high_lat) - 1)))],
            "max_s": high_lat[-1], "low_completed": len(low_done), "preemptions": preempted,
            "low_request_s": low_steps * step_s}


# -- report ----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer trials (a smoke run)")
    ap.add_argument("--only", default="lost,cost,drain,priority")
    ap.add_argument("--step-s", type=float, default=0.25, help="seconds per DiT step")
    ap.add_argument("--steps", type=int, default=40, help="steps of a request")
    ap.add_argument("--every", type=int, default=5, help="checkpoint_every_steps (lost)")
    ap.add_argument("--low-steps", type=int, default=40,
                    help="steps of a low-priority request (priority; high ones take 2)")
    ap.add_argument("--seed", type=int, default=23)
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "bench_checkpoints")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    parts = set(args.only.split(","))
    trials = 3 if args.quick else 10
    results: dict[str, Any] = {}
    work = args.out / "work"
    if "lost" in parts:
        results["lost"] = [lost_work(work / f"lost-{on}", on, trials, args.steps, args.step_s,
                                     args.every, args.seed) for on in (False, True)]
    if "cost" in parts:
        results["cost"] = checkpoint_cost(work / "cost", 2 if args.quick else 5, 10, 0.5)
    if "drain" in parts:
        results["drain"] = [drain_time(work / f"drain-{on}", on, 2 if args.quick else 5,
                                       args.steps, args.step_s, args.seed)
                            for on in (True, False)]
    if "priority" in parts:
        results["priority"] = [priority_latency(work / f"prio-{m}", m,
                                                8 if args.quick else 30, args.low_steps,
                                                args.step_s, args.seed)
                               for m in ("none", "release", "preempt")]
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    print(report(results, args))
    return 0


def report(r: dict[str, Any], args: argparse.Namespace) -> str:
    lines = []
    if "lost" in r:
        lines += ["DiT work lost per DiT death at a random step "
                  f"({args.steps} steps x {args.step_s:g} s, kill at a uniform random step)",
                  "| checkpoints | kills | lost per death, mean | max | of a request |",
                  "| --- | --- | --- | --- | --- |"]
        for x in r["lost"]:
            what = f"every {args.every} steps" if x["checkpoints"] else "off (before)"
            lines.append(f"| {what} | {x['kills']} | {x['mean_lost_s']:.2f} s "
                         f"({statistics.mean(x['lost_steps']):.1f} steps) | {x['max_lost_s']:.2f} s"
                         f" | {x['request_s']:.1f} s |")
        lines.append("")
    if "cost" in r:
        c = r["cost"]
        lines += ["Cost of one checkpoint (Wan 480P-sized: latents + 3 history tensors, "
                  f"{c['bytes_per_send'] / 2**20:.1f} MiB per send on average, the first of a "
                  "request with the 8 MiB encoder outputs)",
                  "| on the DiT's path (copy) | sending (stage + call + pull) | controller "
                  "pull, total | checkpoints kept / final |", "| --- | --- | --- | --- |",
                  f"| {c['capture_ms']:.1f} ms | {c['send_ms']:.1f} ms | "
                  f"{c['controller_pull_s']:.2f} s | {c['kept']} / {c['final']} |", ""]
    if "drain" in r:
        lines += ["Drain: SIGTERM to exit of a DiT in the middle of a request",
                  "| checkpoints | trials | task handed back, median | exit, median | exit, "
                  "max | step time | a whole request |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for x in r["drain"]:
            back = (f"{x['handed_median_s']:.2f} s" if x["handed_median_s"] is not None
                    else "(finished it)")
            lines.append(f"| {'on' if x['checkpoints'] else 'off'} | {x['trials']} | {back} | "
                         f"{x['median_s']:.2f} s | {x['max_s']:.2f} s | {x['step_s']:g} s | "
                         f"{x['steps'] * x['step_s']:.0f} s |")
        lines.append("")
    if "priority" in r:
        lines += ["High-priority short requests (2 steps) among saturating low-priority long "
                  f"ones ({args.low_steps} steps x {args.step_s:g} s; 2 DiTs, 8 low unfinished)",
                  "| mode | urgent requests | p50 | p99 | low completed | "
                  "preemptions |", "| --- | --- | --- | --- | --- | --- |"]
        for x in r["priority"]:
            lines.append(f"| {x['mode']} | {x['urgent']} | {x['p50_s']:.2f} s | "
                         f"{x['p99_s']:.2f} s | {x['low_completed']} | {x['preemptions']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
