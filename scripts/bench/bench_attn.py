#!/usr/bin/env python3
"""The DiT's quantised self-attention kernels side by side, on one GPU.

    python3 -m scripts.bench.bench_attn --out out/attn [--kernels fp8_cudnn,sage2]

For each self-attention shape of the served DiTs (``bench_dit.ATTN_SHAPES``: Wan2.1-14B and
1.3B at 480p, Wan2.1-14B / Wan2.2-A14B at 720p, Qwen-Image at 1024 and 1328), on random
bf16 (B, S, H, D) inputs: the time of bf16 cuDNN SDPA and of each quantised backend's
kernel function as the DiT calls it (quantisation included; ``fp8_cudnn`` compiled, so its
quantisation is fused as in a compiled DiT; ``sage2`` quantises in its own kernels), and,
where a float32 reference is quick (up to 33k tokens), the relative L2 error of each against
float32 SDPA. One more row per kernel: the same error on offset
inputs (keys + 3, values + 2, the case smoothing exists for).

A kernel whose package or GPU is missing is reported as skipped, with the refusal the DiT
stage would give at load. Writes ``attn.json`` and ``attn.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from scripts.bench.bench_dit import ATTN_SHAPES, timed

KERNELS = ("fp8_cudnn", "sage2")
_FP32_MAX_TOKENS = 33000
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[attn {time.monotonic() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def kernel_function(name: str, device: Any) -> tuple[Callable[..., Any] | None, str]:
    """(the backend's kernel as the processors call it, why not) for ``name`` on ``device``;
    the function bypasses the backends' minimum length so every shape is measured."""
    import torch

    from contracts.errors import ModelLoadError

    try:
        if name == "fp8_cudnn":
            from workers.models.dit import fp8_attention as fp8

            fp8.check_fp8_attention(device)
            fp8.FP8_MIN_TOKENS = 0
            return torch.compile(fp8.fp8_attention), ""
        from workers.models.dit import sage2_attention as sage2

        sage2.check_sage2_attention(device, torch.bfloat16, 128)
        sage2.SAGE2_MIN_TOKENS = 0
        return sage2.sage2_attention, ""
    except ModelLoadError as exc:
        return None, str(exc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--shapes", default="", help="substrings of the shape names to keep")
    args = ap.parse_args(argv)
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    kernels: dict[str, Callable[..., Any]] = {}
    skipped: dict[str, str] = {}
    for name in [k for k in args.kernels.split(",") if k]:
        if name not in KERNELS:
            raise SystemExit(f"unknown kernel {name!r}; choose from {', '.join(KERNELS)}")
        fn, why = kernel_function(name, device)
        if fn is None:
            skipped[name] = why
            log(f"{name}: skipped: {why}")
        else:
            kernels[name] = fn

    def sdpa(q: Any, k: Any, v: Any, backend: Any = SDPBackend.CUDNN_ATTENTION) -> Any:
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    def rel(a: Any, ref: Any) -> float:
        return round(float((a.float() - ref).norm() / ref.norm()), 4)

    rows: dict[str, dict[str, Any]] = {}
    shapes = {n: s for n, s in ATTN_SHAPES.items()
              if not args.shapes or any(p in n for p in args.shapes.split(","))}
    for name, (b, s, h, d) in shapes.items():
        g = torch.Generator(device).manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, device=device, dtype=torch.bfloat16, generator=g)
                   for _ in range(3))
        flop = 4 * b * h * s * s * d
        row: dict[str, Any] = {"shape": [b, h, s, d],
                               "bf16_ms": round(timed(partial(sdpa, q, k, v)), 2)}
        for kname, fn in kernels.items():
            ms = timed(partial(fn, q, k, v))
            row[kname] = {"ms": round(ms, 2), "tflops": round(flop / ms / 1e9),
                          "speedup": round(row["bf16_ms"] / ms, 2)}
        if s <= _FP32_MAX_TOKENS:
            for offset in (False, True):
                qq, kk, vv = (q, k + 3, v + 2) if offset else (q, k, v)
                ref = sdpa(qq.float(), kk.float(), vv.float(),
                           SDPBackend.EFFICIENT_ATTENTION).float()
                tag = "rel_offset" if offset else "rel"
                row[f"bf16_{tag}"] = rel(sdpa(qq, kk, vv), ref)
                for kname, fn in kernels.items():
                    row[kname][tag] = rel(fn(qq, kk, vv), ref)
                del ref
        rows[name] = row
        log(f"{name}: {row}")
        del q, k, v
        torch.cuda.empty_cache()

    env = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
           "cuda": torch.version.cuda}
    (args.out / "attn.json").write_text(json.dumps(
        {"environment": env, "skipped": skipped, "rows": rows}, indent=1))
    head = ["shape", "bf16 cuDNN ms"]
    for kname in kernels:
        head += [f"{kname} ms", f"{kname} TFLOP/s", f"{kname} x bf16"]
    head += ["rel L2 vs fp32: bf16", *kernels, "offset inputs: bf16", *kernels]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name, row in rows.items():
        cells = [name, str(row["bf16_ms"])]
        for kname in kernels:
            r = row[kname]
            cells += [str(r["ms"]), str(r["tflops"]), f"{r['speedup']}x"]
        for tag in ("rel", "rel_offset"):
            cells.append(str(row.get(f"bf16_{tag}", "-")))
            cells += [str(row[kname].get(tag, "-")) for kname in kernels]
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    (args.out / "attn.md").write_text(table + "\n" + "".join(
        f"\n{k}: skipped: {why}\n" for k, why in skipped.items()))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
