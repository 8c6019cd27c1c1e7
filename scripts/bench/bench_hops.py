#!/usr/bin/env python3
"""Per-request cost of disaggregation: rings + control channel + two tensor hops, at N=1.

    python -m scripts.bench.bench_hops [--device cpu|cuda:0] [--requests 40] [--out DIR]

Uses the synthetic pipeline (``model_cls: synthetic``: stages that sleep a configured time
and produce tensors of configured shapes, no model library), so whatever a request takes
beyond its stages' own time is the runtime's. For each tensor size it runs the same requests
one at a time through the one-process baseline (``--service all``: no rings, no Mooncake)
and through a controller + 1 encoder + 1 transformer + 1 decoder group, and reports the
median server-side latency (accepted -> completed) of each. The difference is what the
rings, the control messages and the two Mooncake hops (Phase1, Phase2) add per request.

Target (issue "Throughput on GPUs"): at most 5 ms + bytes / link bandwidth. The fixed part
is read off the small tensors (64 KiB + 4 KiB: their bytes cost ~0.05 ms); the large ones
(8 MiB + 8 MiB, Wan-sized) show the bytes term, reported as the bandwidth it implies. With
``--device cuda:0`` the tensors are made on the GPU and the staging pools are GPU memory, so
Mooncake moves GPU memory to GPU memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from launcher import group_config
from scripts import ROOT
from scripts.bench.bench_serving import log, post, running
from workers.models.families.synthetic import write_config

ENCODER_S, STEP_S, STEPS, DECODER_S = 0.005, 0.010, 4, 0.005
SIZES: dict[str, dict[str, Any]] = {
    "small": {"phase1": {"prompt_embeds": {"shape": [1, 64, 256], "dtype": "float32"}},
              "phase2": {"latents": {"shape": [1, 16, 8, 8], "dtype": "float32"}}},
    "large": {"phase1": {"prompt_embeds": {"shape": [1, 512, 4096], "dtype": "float32"}},
              "phase2": {"latents": {"shape": [1, 16, 21, 60, 104], "dtype": "float32"}}},
}


def nbytes(spec: dict[str, Any]) -> int:
    total = 0
    for phase in ("phase1", "phase2"):
        for t in spec[phase].values():
            n = 1
            for d in t["shape"]:
                n *= d
            total += n * {"float32": 4, "bfloat16": 2, "float16": 2}.get(t["dtype"], 1)
    return total


def measure(mode: str, cfg: dict[str, Any], workdir: Path, requests: int) -> dict[str, Any]:
    lat = []
    workers = [("encoder", 0), ("transformer", 0), ("decoder", 0)]
    with running(mode, cfg, workdir, workers, [cfg["device"]], timeout=300) as group:
        body = {"prompt": "hop", "height": 64, "width": 64, "infer_steps": STEPS}
        for i in range(3):  # warm-up: first transfers, first kernels, connections
            post(group.url, "image", {**body, "seed": 10_000 + i}, 120)
        for i in range(requests):
            st = post(group.url, "image", {**body, "seed": i}, 120)
            lat.append(st["end_time"] - st["created_at"])
    return {"median_s": statistics.median(lat), "p90_s": sorted(lat)[int(0.9 * len(lat))],
            "min_s": min(lat), "n": len(lat)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--sizes", default="small,large")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "bench_hops")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    stages_s = ENCODER_S + STEPS * STEP_S + DECODER_S
    rows = []
    for size in args.sizes.split(","):
        spec = SIZES[size]
        work = Path(tempfile.mkdtemp(prefix=f"hops-{size}-"))
        model = work / "synthetic"
        write_config(model, encoder_s=ENCODER_S, step_s=STEP_S, decoder_s=DECODER_S,
                     mode="sleep", **spec)
        cfg = group_config("synthetic", str(model), work, device=args.device)
        res = {}
        for mode in ("baseline", "disagg"):
            log(f"{size}: {mode}")
            res[mode] = measure(mode, cfg, Path(tempfile.mkdtemp(dir=work)), args.requests)
        added = res["disagg"]["median_s"] - res["baseline"]["median_s"]
        rows.append({"size": size, "bytes": nbytes(spec), "stages_s": stages_s, **res,
                     "added_s": added})
        log(f"{size}: baseline {res['baseline']['median_s'] * 1e3:.1f} ms, disagg "
            f"{res['disagg']['median_s'] * 1e3:.1f} ms, added {added * 1e3:.2f} ms")
    small = next((r for r in rows if r["size"] == "small"), None)
    lines = [f"synthetic pipeline, {args.device}, N=1, stages {stages_s * 1e3:.0f} ms "
             f"({ENCODER_S * 1e3:.0f} + {STEPS} x {STEP_S * 1e3:.0f} + {DECODER_S * 1e3:.0f})",
             "", "| tensors (Phase1 + Phase2) | bytes | baseline median ms | disagg median ms "
             "| added ms | disagg p90 ms | implied MB/s for the bytes |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        implied = ""
        if small is not None and r is not small and r["added_s"] > small["added_s"]:
            rate = (r["bytes"] - small["bytes"]) / (r["added_s"] - small["added_s"])
            implied = f"{rate / 1e6:.0f}"
        lines.append(f"| {r['size']} | {r['bytes']:,} | {r['baseline']['median_s'] * 1e3:.1f} | "
                     f"{r['disagg']['median_s'] * 1e3:.1f} | **{r['added_s'] * 1e3:.2f}** | "
                     f"{r['disagg']['p90_s'] * 1e3:.1f} | {implied} |")
    md = "\n".join(lines)
    (args.out / "bench_hops.md").write_text(md + "\n")
    (args.out / "bench_hops.json").write_text(json.dumps(
        {"device": args.device, "rows": rows, "loadavg": Path("/proc/loadavg").read_text(),
         "time": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
