#!/usr/bin/env python
"""Throughput and latency of a disaggregated group against the one-process baseline.

    python -m scripts.bench.bench_e2e --pipeline qwen_t2i --requests 24 --concurrency 8 \
        [--models out/tiny-models] [--encoders 1 --transformers 2 --decoders 1]

Both runs happen in this one invocation, on the same machine, with the same requests: the
baseline (``--service all``) first, then the group. Prints QPS, p50/p95 latency and the
disaggregated/baseline ratios. On a CPU-only machine the stages compete for the same cores,
so read the ratio as the overhead of disaggregation, not its benefit.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from contracts.pipelines import task_spec
from launcher import LocalGroup, group_config, submit
from scripts import ROOT

SIZES: dict[str, dict[str, Any]] = {
    "wan_t2v": {"height": 32, "width": 32, "target_video_length": 9, "infer_steps": 8},
    "qwen_t2i": {"height": 64, "width": 64, "infer_steps": 8},
}


def drive(url: str, kind: str, body: dict[str, Any], n: int, conc: int) -> dict[str, float]:
    def one(i: int) -> float:
        t0 = time.monotonic()
        st = submit(url, kind, {**body, "prompt": f"bench {i}", "seed": i}, timeout=1800)
        if st["status"] != "completed":
            raise RuntimeError(f"request {i}: {st['status']}: {st['error']}")
        return time.monotonic() - t0

    one(n + 1000)  # warm-up: first request pays lazy initialisation everywhere
    t0 = time.monotonic()
    with ThreadPoolExecutor(conc) as pool:
        lat = sorted(pool.map(one, range(n)))
    wall = time.monotonic() - t0
    return {"qps": n / wall, "p50": statistics.median(lat),
            "p95": lat[max(0, int(0.95 * len(lat)) - 1)], "wall": wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--pipeline", choices=sorted(SIZES), default="qwen_t2i")
    ap.add_argument("--models", default=str(ROOT / "out" / "tiny-models"))
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--encoders", type=int, default=1)
    ap.add_argument("--transformers", type=int, default=1)
    ap.add_argument("--decoders", type=int, default=1)
    args = ap.parse_args()
    kind, body = task_spec(args.pipeline).output, SIZES[args.pipeline]
    model = str(Path(args.models) / args.pipeline)
    rows = []
    for label in ("baseline (all)", "disaggregated"):
        with tempfile.TemporaryDirectory() as tmp:
            group = LocalGroup(group_config(args.pipeline, model, Path(tmp)), Path(tmp))
            try:
                if label.startswith("baseline"):
                    group.start("all")
                    group.wait_http(timeout=300)
                else:
                    group.start_all(args.encoders, args.transformers, args.decoders)
                rows.append((label, drive(group.url, kind, body, args.requests,
                                          args.concurrency)))
            finally:
                group.stop()
    print(f"pipeline={args.pipeline} requests={args.requests} concurrency={args.concurrency} "
          f"workers={args.encoders}/{args.transformers}/{args.decoders}")
    print(f"{'run':<16} {'QPS':>8} {'p50 s':>8} {'p95 s':>8}")
    for label, r in rows:
        print(f"{label:<16} {r['qps']:>8.3f} {r['p50']:>8.3f} {r['p95']:>8.3f}")
    base, dis = rows[0][1], rows[1][1]
    print(f"{'ratio dis/base':<16} {dis['qps'] / base['qps']:>8.2f} "
          f"{dis['p50'] / base['p50']:>8.2f} {dis['p95'] / base['p95']:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
