#!/usr/bin/env python3
"""LoRA adapters and step caches on the DiT stage: what they cost, through the adapter.

    python -m scripts.bench.bench_lora --arch wan-14b --out out/lora \\
        [--rank 64] [--steps 4] [--cache-steps 10] [--repeats 3] [--compile] \\
        [--models /dev/shm/diffring-models] [--device cuda:0]

Builds (or reuses) a DiT-stage folder of the published architecture with random bf16
weights (:func:`scripts.bench.bench_dit.build_folder`; nothing is downloaded), makes three
random adapters of ``--rank`` over the attention projections and feed-forwards of every
block (PEFT, :mod:`scripts.bench.lora_kit`), then measures on one worker's DiT:

1. *switch cost*: an adapter's first use (read from disk, convert, load into the DiT) and
   a switch between loaded ones (activate with strengths, disable after); with
   ``--compile``, the hot-swap into a compiled slot instead;
2. *request time*: a ``--steps``-step denoise with CFG (Wan) without an adapter (on the
   pristine DiT and on the DiT once adapters were loaded and disabled), with one adapter
   and with two;
3. *cache kinds*: a ``--cache-steps``-step denoise with each step cache the model runs, at
   settings whose skipping follows a fixed schedule (random weights make any
   data-dependent skip meaningless; the settings are in the table).

Writes ``bench_lora.json`` and ``bench_lora.md`` into ``--out``. On a CPU at a toy size
(``--layers 1 --shape 16x16x5 --device cpu``) it runs in the test-suite; its figures mean
nothing there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from scripts.bench.bench_dit import SHAPES, TASKS, _request, build_folder

T0 = time.monotonic()
TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2",  # Wan
           "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")  # + Qwen's text stream


def fixed_caches(steps: int) -> dict[str, dict[str, Any]]:
    """Each cache kind at settings whose skips do not depend on the weights."""
    return {
        # threshold 0: never skips; the hooks' own cost
        "first_block_cache/never": {"kind": "first_block_cache", "threshold": 0.0},
        # threshold beyond any residual: every step after the first skips the other blocks
        "first_block_cache/always": {"kind": "first_block_cache", "threshold": 1e9},
        # flat ratios, unbounded error budget: every other step skipped after the first 20%
        "mag_cache/every_other": {"kind": "mag_cache", "mag_ratios": [1.0] * steps,
                                  "threshold": 1e9, "max_skip_steps": 1,
                                  "retention_ratio": 0.2},
        "taylorseer_cache/interval_2": {"kind": "taylorseer_cache", "cache_interval": 2,
                                        "disable_cache_before_step": 1},
        "pyramid_attention_broadcast/2": {
            "kind": "pyramid_attention_broadcast", "spatial_attention_block_skip_range": 2,
            "spatial_attention_timestep_skip_range": [0, 1000]},
    }


def log(msg: str) -> None:
    print(f"[lora {time.monotonic() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def _timed(device: str, fn: Any, repeats: int = 1) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from contracts.stage_options import StageOptions
    from scripts.bench.lora_kit import make_adapter
    from workers.models import TransformerAdapter

    shape = args.shape or SHAPES[args.arch]
    folder = args.models / f"{args.arch}{f'-{args.layers}l' if args.layers else ''}"
    log(f"folder {folder}: {build_folder(args.arch, folder, args.device, args.layers)}")
    loras = args.out / "adapters"
    loras.mkdir(parents=True, exist_ok=True)
    opts = StageOptions(lora_dir=str(loras), lora_max_loaded=3)
    dit = TransformerAdapter.for_task(folder, TASKS[args.arch], args.device, "bfloat16",
                                      options=opts, budget_shapes=(shape,))
    dit.load()
    dit.warm_up([shape], steps=1)
    req = _request(args.arch, args.steps, shape)
    inputs = dit.warmup_inputs(req, 0)
    out: dict[str, Any] = {"arch": args.arch, "shape": shape, "steps": args.steps,
                           "rank": args.rank, "device": args.device, "layers": args.layers}

    def denoise(r: Any) -> None:
        dit.denoise(r, inputs)

    out["plain_pristine_s"] = _timed(args.device, lambda: denoise(req), args.repeats)
    # Not single letters: diffusers' load warning matches adapter names as substrings.
    names = ["first", "second", "third"]
    for i, name in enumerate(names):
        make_adapter(dit.transformer, loras / f"{name}.safetensors", rank=args.rank,
                     seed=i + 1, targets=TARGETS)
    out["adapter_mib"] = round((loras / "first.safetensors").stat().st_size / 2**20, 1)
    library: Any = dit.requests.loras if dit.requests is not None else None
    # First use of each: read, convert, load into the DiT (then activated and disabled).
    first = []
    for name in names:
        ref = [{"name": name, "strength": 1.0}]
        first.append(_timed(args.device, lambda ref=ref: _enter_exit(library, ref)))
    out["first_use_s"] = statistics.median(first)
    switch = [_timed(args.device, lambda ref=[{"name": n, "strength": 0.8}]:
                     _enter_exit(library, ref)) for n in names * 2]
    out["switch_loaded_s"] = statistics.median(switch)
    out["plain_s"] = _timed(args.device, lambda: denoise(req), args.repeats)
    out["one_adapter_s"] = _timed(args.device, lambda: denoise(req.replace(
        loras=[{"name": "first", "strength": 0.8}])), args.repeats)
    out["two_adapters_s"] = _timed(args.device, lambda: denoise(req.replace(
        loras=[{"name": "first", "strength": 0.8}, {"name": "second", "strength": 0.5}])),
        args.repeats)
    caches = {}
    creq = _request(args.arch, args.cache_steps, shape)
    kinds = dit.offers()["caches"]
    caches["none"] = {"step_s": _timed(args.device, lambda: denoise(creq), args.repeats)
                      / args.cache_steps, "settings": None}
    for label, cache in fixed_caches(args.cache_steps).items():
        if cache["kind"] not in kinds:
            continue
        r = creq.replace(cache=cache)
        caches[label] = {"step_s": _timed(args.device, lambda r=r: denoise(r), args.repeats)
                         / args.cache_steps, "settings": cache}
    out["caches"] = caches
    if args.compile:
        out["compiled"] = _compiled(args, folder, loras, shape, req)
    return out


def _enter_exit(library: Any, refs: list[dict[str, Any]]) -> None:
    from contracts.dit_request import parse_loras

    with library.applied(parse_loras(refs)):
        pass


def _compiled(args: argparse.Namespace, folder: Path, loras: Path, shape: str, req: Any
              ) -> dict[str, Any]:
    """Hot-swap into compiled slots: the swap itself and a request after it."""
    from contracts.stage_options import StageOptions
    from workers.models import TransformerAdapter

    dit = TransformerAdapter.for_task(
        folder, TASKS[args.arch], args.device, "bfloat16", compile=True,
        options=StageOptions(lora_dir=str(loras), lora_max_loaded=2), budget_shapes=(shape,))
    dit.load()
    t0 = time.perf_counter()
    dit.warm_up([shape], steps=1)
    out: dict[str, Any] = {"warmup_s": round(time.perf_counter() - t0, 1)}
    library: Any = dit.requests.loras if dit.requests is not None else None
    inputs = dit.warmup_inputs(req, 0)
    swaps = [_timed(args.device, lambda n=n: _enter_exit(library, [{"name": n}]))
             for n in ("first", "second", "third", "first")]
    out["hotswap_s"] = statistics.median(swaps)
    out["plain_s"] = _timed(args.device, lambda: dit.denoise(req, inputs), args.repeats)
    out["one_adapter_s"] = _timed(args.device, lambda: dit.denoise(
        req.replace(loras=[{"name": "first"}]), inputs), args.repeats)
    return out


def markdown(r: dict[str, Any]) -> str:
    lines = [f"LoRA and step caches, {r['arch']} ({r['layers'] or 'all'} layers), {r['shape']},"
             f" {r['device']}, random bf16, adapters of rank {r['rank']} "
             f"({r['adapter_mib']} MiB each)", "",
             "| what | seconds |", "| --- | --- |"]
    for key, what in [("first_use_s", "first use of an adapter (disk, convert, load)"),
                      ("switch_loaded_s", "switch to a loaded adapter (activate, disable)"),
                      ("plain_pristine_s", f"{r['steps']}-step request, DiT never adapted"),
                      ("plain_s", f"{r['steps']}-step request, no adapter"),
                      ("one_adapter_s", f"{r['steps']}-step request, one adapter"),
                      ("two_adapters_s", f"{r['steps']}-step request, two adapters")]:
        lines.append(f"| {what} | {r[key]:.4f} |")
    lines += ["", "| cache (fixed schedule) | step s | ratio | settings |",
              "| --- | --- | --- | --- |"]
    base = r["caches"]["none"]["step_s"]
    for label, c in r["caches"].items():
        lines.append(f"| {label} | {c['step_s']:.4f} | {c['step_s'] / base:.2f} | "
                     f"{json.dumps(c['settings']) if c['settings'] else '-'} |")
    if "compiled" in r:
        c = r["compiled"]
        lines += ["", f"compiled: warm-up {c['warmup_s']} s, hot-swap {c['hotswap_s']:.4f} s, "
                      f"request {c['plain_s']:.4f} s plain / {c['one_adapter_s']:.4f} s "
                      "with one adapter"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", choices=sorted(SHAPES), default="wan-1.3b")
    ap.add_argument("--out", type=Path, default=Path("out/lora"))
    ap.add_argument("--models", type=Path, default=Path("out/bench-models"))
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--shape", default=None, help="HxW or HxWxF (default: the arch's)")
    ap.add_argument("--layers", type=int, default=None, help="fewer blocks (toy runs)")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--cache-steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="also the compiled hot-swap")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    result = measure(args)
    (args.out / "bench_lora.json").write_text(json.dumps(result, indent=2))
    (args.out / "bench_lora.md").write_text(markdown(result))
    log(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
