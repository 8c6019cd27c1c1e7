"""Encoder time per request with the prompt-embedding cache at 0 % and ~90 % hit rate.

    python -m scripts.bench.bench_prompt_cache [--models out/tiny-models] [--requests 200]
                                         [--pipelines wan_t2v,qwen_t2i] [--device cpu]

For each pipeline, one encoder stage (the adapter the encoder worker runs) encodes the same
number of requests three ways, in this order, in one process:

* cache off                 — the reference (every request runs the text encoder)
* cache on, 0 % hits        — every prompt new (the cost of a miss: encode + store a copy)
* cache on, ~90 % hits      — 10 % distinct prompts, each repeated ten times
* cache off again           — the drift of the run (its gap to the first row is the noise)

and prints a table of milliseconds per request (mean and median) with the ratio against
cache off measured in the same run. Guidance is on (negative prompt encoded too), as in the
published defaults. Tiny random-weight models are built first when ``--models`` has none.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from scripts import ROOT


def prompts(n: int, distinct: int) -> list[str]:
    return [f"prompt number {i % distinct} of a benchmark, with some words" for i in range(n)]


def time_requests(enc: object, reqs: list[object]) -> list[float]:
    out = []
    for req in reqs:
        t0 = time.perf_counter()
        enc.encode(req)  # type: ignore[attr-defined]
        out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=Path, default=ROOT / "out" / "tiny-models")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--pipelines", default="wan_t2v,qwen_t2i")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)

    import torch

    from contracts.request import GenerationRequest
    from workers.models import EncoderAdapter
    from workers.models.prompt_cache import PromptCache

    torch.set_num_threads(args.threads)
    pipelines = args.pipelines.split(",")
    if not all((args.models / p / "model_index.json").exists() for p in pipelines):
        from modelkit.tiny import build_all

        build_all(args.models, seed=0, tasks=pipelines)

    n = args.requests
    print(f"{n} requests per row, device {args.device}, {args.threads} torch thread(s)")
    print(f"{'pipeline':<10} {'case':<22} {'hits':>6} {'mean ms':>9} {'median ms':>10} "
          f"{'vs off':>7}")
    for pipeline in pipelines:
        enc = EncoderAdapter.for_task(args.models / pipeline, pipeline, args.device)
        enc.load()

        def requests(distinct: int, pipeline: str = pipeline) -> list[object]:
            return [GenerationRequest.from_dict({"task": pipeline, "prompt": p})
                    for p in prompts(n, distinct)]

        time_requests(enc, requests(n)[:5])  # warm-up (allocator, first-call paths)
        rows = []
        enc.cache = None
        rows.append(("cache off", 0.0, time_requests(enc, requests(n))))
        for label, distinct in (("cache on, 0 % hits", n), ("cache on, ~90 % hits", n // 10)):
            cache = PromptCache(1 << 30)
            enc.cache = cache
            times = time_requests(enc, requests(distinct))
            st = cache.stats()
            rows.append((label, st.hits / max(1, st.hits + st.misses), times))
        # Off again at the end: the gap between the two off rows is the drift of the run
        # (machine load, allocator warm-up), the noise floor of every ratio above it.
        enc.cache = None
        rows.append(("cache off (again)", 0.0, time_requests(enc, requests(n))))
        ref = statistics.mean(rows[0][2])
        for label, hit_rate, times in rows:
            mean = statistics.mean(times)
            print(f"{pipeline:<10} {label:<22} {hit_rate:>6.0%} {mean * 1e3:>9.2f} "
                  f"{statistics.median(times) * 1e3:>10.2f} {mean / ref:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
