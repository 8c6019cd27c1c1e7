#!/usr/bin/env python
"""K-scaling: does a group with K transformers serve K times the requests of one?

    python -m scripts.bench.bench_scale [--ks 1,2,4,8,16,32] [--step-s 0.1 --steps 5] [--waves 6] \
        [--encoders 1 --decoders 1] [--md FILE] [--json FILE] [--plot FILE.png]

The synthetic pipeline (``workers/models/families/synthetic.py``), 1 encoder : K transformers :
1 decoder (``--encoders`` / ``--decoders`` change the edges). A transformer takes
t = steps x step_s per request (reporting each step), the encoder and decoder take
``--edge-s`` each (t >> edge), and the stages sleep, so the two cores of a small machine
are not the limit: the runtime is. One group is started; for each
K, transformers are added until there are K, a warm-up round runs, then ``waves`` x K tasks
are posted at once. Throughput is measured on the controller's own completion times in the
steady state, between the first wave (which fills the pipeline) and the last (which drains
it): QPS = (n - 2K) / (T_(n-K) - T_K), T_i the i-th completion of n. Ideal: K / t.
Efficiency: QPS / ideal.

Also shown per K: the transformer's time per task (its claim to its handoff, controller
clock) against t: what the runtime adds to each request on the DiT's critical path.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from launcher import LocalGroup, group_config
from workers.models.families.synthetic import write_config

COLUMNS = ("K", "tasks", "QPS", "ideal K/t", "efficiency", "DiT s/task", "added ms/task")


def post_tasks(client: httpx.Client, url: str, ids: list[str], steps: int) -> None:
    for i, task_id in enumerate(ids):
        r = client.post(f"{url}/v1/tasks/image/", json={
            "task_id": task_id, "prompt": f"scale {task_id}", "seed": i, "infer_steps": steps,
        })
        r.raise_for_status()


def finished_count(client: httpx.Client, url: str) -> int:
    counts = client.get(f"{url}/v1/service/status").json()["counts"]
    return int(counts["completed"] + counts["failed"] + counts["cancelled"])


def wait_done(client: httpx.Client, url: str, ids: list[str], before: int, timeout: float
              ) -> list[dict[str, Any]]:
    """Statuses of ``ids`` once all are finished (``before``: finished tasks before they were
    posted); raises on one that did not complete, or at the timeout. Polls the service's
    counts, not the task list: listing every task each time would load the controller
    with the benchmark's own requests."""
    deadline = time.monotonic() + timeout
    while finished_count(client, url) < before + len(ids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"tasks still running after {timeout:.0f} s")
        time.sleep(0.2)
    statuses = [client.get(f"{url}/v1/tasks/{i}/status").json() for i in ids]
    bad = [st for st in statuses if st["status"] != "completed"]
    if bad:
        raise RuntimeError(f"{len(bad)} task(s) did not complete, e.g. {bad[0]}")
    return statuses


def measure(statuses: list[dict[str, Any]], k: int, t: float) -> dict[str, Any]:
    ends = sorted(st["stage_times"]["completed"] for st in statuses)
    n = len(ends)
    qps = (n - 2 * k) / (ends[n - k - 1] - ends[k - 1])
    dit = [st["stage_times"]["phase2"] - st["stage_times"]["denoising"] for st in statuses]
    ideal = k / t
    return {
        "K": k, "tasks": n, "QPS": qps, "ideal K/t": ideal, "efficiency": qps / ideal,
        "DiT s/task": statistics.mean(dit), "added ms/task": (statistics.mean(dit) - t) * 1e3,
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    fmt = {"K": "{}", "tasks": "{}", "QPS": "{:.2f}", "ideal K/t": "{:.2f}",
           "efficiency": "{:.3f}", "DiT s/task": "{:.3f}", "added ms/task": "{:.1f}"}
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(fmt[c].format(row[c]) for c in COLUMNS) + " |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    ks = [r["K"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(ks, [r["ideal K/t"] for r in rows], "--", color="grey", label="ideal K/t")
    ax.plot(ks, [r["QPS"] for r in rows], "o-", label="measured QPS")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("transformers K")
    ax.set_ylabel("requests / s")
    eff = ax.twinx()
    eff.plot(ks, [r["efficiency"] for r in rows], "s:", color="tab:red", label="efficiency")
    eff.set_ylim(0, 1.1)
    eff.set_ylabel("efficiency (QPS / ideal)")
    lines = ax.get_legend_handles_labels()[0] + eff.get_legend_handles_labels()[0]
    ax.legend(lines, [str(h.get_label()) for h in lines], loc="upper left")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ks", default="1,2,4,8,16,32", help="transformer counts, increasing")
    ap.add_argument("--steps", type=int, default=5, help="denoising steps per request")
    ap.add_argument("--step-s", type=float, default=0.1, help="seconds per step (t = steps x this)")
    ap.add_argument("--edge-s", type=float, default=0.002, help="encoder and decoder seconds")
    ap.add_argument("--encoders", type=int, default=1)
    ap.add_argument("--decoders", type=int, default=1)
    ap.add_argument("--waves", type=int, default=6, help="tasks per K run = waves x K (>= 3)")
    ap.add_argument("--md", type=Path, help="write the markdown table here")
    ap.add_argument("--json", type=Path, help="write the rows as JSON here")
    ap.add_argument("--plot", type=Path, help="write a PNG plot here")
    args = ap.parse_args(argv)
    ks = [int(k) for k in args.ks.split(",")]
    if (ks != sorted(set(ks)) or ks[0] < 1 or args.waves < 3 or args.steps < 1
            or min(args.encoders, args.decoders) < 1):
        ap.error("--ks must be increasing positive integers; --waves >= 3; --steps, "
                 "--encoders, --decoders >= 1")
    t = args.steps * args.step_s
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        wd = Path(tmp)
        model = wd / "synthetic"
        write_config(model, encoder_s=args.edge_s, decoder_s=args.edge_s, step_s=args.step_s,
                     phase1={"prompt_embeds": {"shape": [1, 16, 256], "dtype": "float32"}},
                     phase2={"latents": {"shape": [1, 16, 8, 8], "dtype": "float32"}})
        cap = max(256, 2 * args.waves * ks[-1])
        cfg = group_config("synthetic", str(model), wd, staging_pool_mb=32,
                           max_pending_tasks=4 * cap,
                           disagg_config={"rdma_buffer_slots": cap})
        group = LocalGroup(cfg, wd)
        try:
            group.start("controller")
            group.wait_http()
            for _ in range(args.encoders):
                group.start("encoder")
            for _ in range(args.decoders):
                group.start("decoder")
            have = 0
            # Generous: on a shared 2-core machine the controller may stall for seconds.
            with httpx.Client(timeout=120) as client:
                for k in ks:
                    for _ in range(k - have):
                        group.start("transformer")
                    have = k
                    group.wait_workers({"encoder": args.encoders, "transformer": k,
                                        "decoder": args.decoders}, timeout=120 + 5 * k)
                    # Warm-up: every new worker's first pull opens its Mooncake connections.
                    warm = [f"warm-{k}-{i}" for i in range(2 * k)]
                    before = finished_count(client, group.url)
                    post_tasks(client, group.url, warm, args.steps)
                    wait_done(client, group.url, warm, before, timeout=120 + 4 * t * k)
                    ids = [f"k{k}-{i}" for i in range(args.waves * k)]
                    before = finished_count(client, group.url)
                    post_tasks(client, group.url, ids, args.steps)
                    statuses = wait_done(client, group.url, ids, before,
                                         timeout=120 + 4 * t * args.waves)
                    rows.append(measure(statuses, k, t))
                    print(markdown(rows[-1:]).splitlines()[-1], flush=True)
        finally:
            group.stop()
    load_after = os.getloadavg()
    title = (f"synthetic {args.encoders}:K:{args.decoders}, t={t:g} s "
             f"({args.steps} x {args.step_s:g} s), edges {args.edge_s * 1e3:g} ms, "
             f"{args.waves} waves")
    table = markdown(rows)
    load = (f"load average before {load_before[0]:.2f} {load_before[1]:.2f} "
            f"{load_before[2]:.2f}, after {load_after[0]:.2f} {load_after[1]:.2f} "
            f"{load_after[2]:.2f}; {os.cpu_count()} cores")
    print(f"\n{title}\n\n{table}\n\n{load}")
    if args.md:
        args.md.write_text(f"{title}\n\n{table}\n\n{load}\n")
    if args.json:
        args.json.write_text(json.dumps({"title": title, "t": t, "rows": rows,
                                         "loadavg_before": load_before,
                                         "loadavg_after": load_after}, indent=2))
    if args.plot:
        plot(rows, args.plot, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
