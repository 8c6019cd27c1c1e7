#!/usr/bin/env python3
"""The DiT stage's speed and memory options on a GPU, through the transformer adapter.

    python -m scripts.bench.bench_dit suite --arch wan-14b --out out/dit \\
        [--variants bf16,fp8_compiled,...] [--steps 2] [--models /dev/shm/diffring-models]
    python -m scripts.bench.bench_dit attn --out out/dit
    python -m scripts.bench.bench_dit report --out out/dit
    python -m scripts.bench.bench_dit rows --out out/dit

``suite`` builds a DiT-stage folder of the published architecture with random weights
(transformer + scheduler + VAE config: what the DiT stage reads; nothing is downloaded),
then

1. *cold start*: every compiled variant loads and warms up once (``warm_up``: the compile),
   in parallel processes (compilation is CPU-bound; their steady state is not timed), which
   fills the compile cache (``transformer.compile_cache_dir``) and records the first start;
2. *measure*: each variant in its own process, one after another: load (timed), warm-up
   (timed: for a compiled variant this is the second start, from the cache), one forward on
   fixed inputs, a ``--steps``-step denoise with CFG (Wan: guidance 5, two forwards a step;
   Qwen-Image: one forward a step) timed ``--repeats`` times, peak and resident memory.
   ``--cap-gib`` caps each process with ``torch.cuda.set_per_process_memory_fraction``
   (the variants' ``max_vram_gb``).

``report`` prints the table: time per step and its ratio to the ``bf16`` variant of the
same run, the relative L2 of the one forward and of the final latents against ``bf16``,
peak and resident GiB, time to ready (load + warm-up) first and second start.
``attn`` times the FP8 attention kernel against bf16 cuDNN SDPA at the DiTs' self-attention
shapes and states its error against a float32 reference.
``hooks`` (any machine, no GPU, no weights) counts what ``weight_storage: "fp8"`` (layerwise
casting, placed by the stage's own ``place``) hooks in the published DiT, and times the host
side of those hooks for one forward: every hooked module's weights cast to the compute dtype
and back, on meta tensors, so what is timed is Python and dispatch alone, which a forward
whose GPU work is short cannot hide.
``rows`` (a GPU with FP8) finds, for every linear shape of the published DiTs' blocks, the
row counts for which the FP8 rowwise matmul is not supported by cuBLASLt: what
``FP8_MIN_TOKENS`` and the bf16 text stream of Qwen-Image rest on.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from scripts.bench.bench_stage_memory import load_timed, request_for

VARIANTS: dict[str, dict[str, Any]] = {
    "bf16": {},
    "bf16_compiled": {"compile": True},
    "fp8_attention": {"attention": "fp8_cudnn"},
    "fp8_linear_compiled": {"compile": True, "stage": {"linear": "fp8"}},
    "fp8_compiled": {"compile": True, "attention": "fp8_cudnn", "stage": {"linear": "fp8"}},
    "sage2_attention": {"attention": "sage2"},
    "sage2_compiled": {"compile": True, "attention": "sage2", "stage": {"linear": "fp8"}},
    "fp8_storage": {"stage": {"weight_storage": "fp8"}},
    "offload_block": {"stage": {"offload": "block"}},
    "fp8_storage_offload": {"stage": {"weight_storage": "fp8", "offload": "block"}},
}
"""Name -> adapter options (``stage``: the transformer section's StageOptions fields)."""
SHAPES = {"wan-14b": "480x832x81", "wan-1.3b": "480x832x81", "qwen-image": "1024x1024"}
TASKS = {"wan-14b": "wan_t2v", "wan-1.3b": "wan_t2v", "qwen-image": "qwen_t2i"}
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[dit {time.monotonic() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


# -- the folder --------------------------------------------------------------------------

def build_folder(arch: str, dest: Path, device: str, layers: int | None = None
                 ) -> dict[str, Any]:
    """transformer (random bf16, the published config), scheduler and VAE of ``arch``: what
    the DiT stage loads. Kept when a folder of the same recipe is there."""
    import diffusers
    import torch

    from modelkit import components, real

    recipe = {"arch": arch, "diffusers": diffusers.__version__, "seed": 0, "kind": "dit-only",
              "layers": layers}
    marker = dest / "bench_dit.json"
    if marker.is_file() and json.loads(marker.read_text()).get("recipe") == recipe:
        return {"reused": True}
    t0 = time.perf_counter()
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: no float32 copy of 20B params
    try:
        with torch.no_grad(), torch.device(device):
            dit: Any = real.wan_dit(arch, layers) if arch.startswith("wan") else \
                real.qwen_dit(layers)
    finally:
        torch.set_default_dtype(previous)
    built = time.perf_counter() - t0
    if dest.exists():
        shutil.rmtree(dest)
    dit.save_pretrained(dest / "transformer", safe_serialization=True)
    params = sum(p.numel() for p in dit.parameters())
    del dit
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if arch.startswith("wan"):
        components.wan_scheduler().save_pretrained(dest / "scheduler")
        vae: Any = diffusers.AutoencoderKLWan()  # its defaults are Wan2.1's VAE
    else:
        components.qwen_scheduler().save_pretrained(dest / "scheduler")
        vae = diffusers.AutoencoderKLQwenImage()  # defaults: Qwen-Image's VAE
    vae.save_config(dest / "vae")  # the DiT stage reads the VAE's geometry only
    info = {"recipe": recipe, "dit_params": params, "build_s": round(built, 1),
            "save_s": round(time.perf_counter() - t0 - built, 1)}
    marker.write_text(json.dumps(info))
    return info


# -- one variant in this process ------------------------------------------------------------

def _request(arch: str, steps: int, shape: str | None = None) -> Any:
    guidance: dict[str, Any] = (
        {"guidance_scale": 5.0} if arch.startswith("wan") else {"true_cfg_scale": 1.0})
    return request_for(TASKS[arch], shape or SHAPES[arch], steps, **guidance)


def run_variant(args: argparse.Namespace) -> int:
    """Load one variant, warm it up, time it; write ``<variant>.json`` and its tensors."""
    import torch

    from contracts.stage_options import StageOptions
    from workers.models import TransformerAdapter

    spec = dict(VARIANTS[args.variant])
    stage = dict(spec.pop("stage", {}))
    if args.cap_gib:
        stage["max_vram_gb"] = args.cap_gib
    if spec.get("compile"):
        stage["compile_cache_dir"] = str(args.compile_cache)
    req = _request(args.arch, args.steps)
    row: dict[str, Any] = {"variant": args.variant, "arch": args.arch, "shape": SHAPES[args.arch],
                           "steps": args.steps, "phase": args.phase, "cap_gib": args.cap_gib}
    adapter = TransformerAdapter.for_task(
        args.folder, TASKS[args.arch], args.device, "bfloat16",
        options=StageOptions(**stage), budget_shapes=(SHAPES[args.arch],), **spec,
    )
    row.update(load_timed(adapter))
    t0 = time.perf_counter()
    adapter.warm_up([SHAPES[args.arch]], steps=2 if args.arch.startswith("qwen") else 1)
    row["warmup_s"] = round(time.perf_counter() - t0, 2)
    row["ready_s"] = round(row["load_s"] + row["warmup_s"], 2)
    if spec.get("compile"):
        row["compile"] = compile_counters()
    log(f"{args.variant} [{args.phase}]: load {row['load_s']} s, warm-up {row['warmup_s']} s"
        + (f", compile {row['compile']}" if "compile" in row else ""))
    if args.phase == "cold":
        _write(args, row)
        return 0
    inputs = adapter.warmup_inputs(req, 0)
    # One forward on fixed inputs (the fidelity of one DiT call; Wan: the conditional one).
    forward = None
    if args.arch.startswith("wan"):
        dit: Any = adapter.transformer
        noise = torch.randn(_latent_shape(adapter, req), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            forward = dit(
                hidden_states=noise.to(args.device, torch.bfloat16),
                timestep=torch.tensor([500.0], device=args.device),
                encoder_hidden_states=inputs["prompt_embeds"].to(args.device, torch.bfloat16),
                return_dict=False,
            )[0]
    times = []
    latents = None
    for _ in range(args.repeats):
        with adapter.guarded("bench"):
            t0 = time.perf_counter()
            latents = adapter.denoise(req, inputs)["latents"]
            times.append(time.perf_counter() - t0)
    times.sort()
    row["step_s"] = round(times[len(times) // 2] / args.steps, 4)
    row["forwards_per_step"] = 2 if args.arch.startswith("wan") else 1
    row["peak_gib"] = round(adapter.memory.max_peak_bytes / 2**30, 2)
    row["finite"] = bool(latents is not None and torch.isfinite(latents).all())
    tensors = {"latents": latents.float().cpu()} if latents is not None else {}
    if forward is not None:
        tensors["forward"] = forward.float().cpu()
    torch.save(tensors, args.work / f"{args.variant}{_suffix(args)}.pt")
    _write(args, row)
    log(f"{args.variant}: {row}")
    return 0


_COMPILE_COUNTERS = {
    ("stats", "unique_graphs"): "graphs",
    ("inductor", "fxgraph_cache_hit"): "fx_hit",
    ("inductor", "fxgraph_cache_miss"): "fx_miss",
    ("inductor", "fxgraph_cache_bypass"): "fx_bypass",
    ("aot_autograd", "autograd_cache_hit"): "aot_hit",
    ("aot_autograd", "autograd_cache_miss"): "aot_miss",
    ("aot_autograd", "autograd_cache_bypass"): "aot_bypass",
}
"""Dynamo's counters a warm-up's row reports: how many graphs it compiled and whether
Inductor's FX graph cache and AOTAutograd's cache answered (a second start that misses
them compiles again)."""


def compile_counters() -> dict[str, int]:
    """This process's compile counters so far (:data:`_COMPILE_COUNTERS`), zeros left out."""
    from torch._dynamo.utils import counters

    return {name: counters[group][key] for (group, key), name in _COMPILE_COUNTERS.items()
            if counters[group][key]}


def _latent_shape(adapter: Any, req: Any) -> tuple[int, ...]:
    frames, h, w = adapter._check_geometry(req)
    return (1, adapter.transformer.config.in_channels, frames, h, w)


def _suffix(args: argparse.Namespace) -> str:
    return f"-cap{args.cap_gib:g}" if args.cap_gib else ""


def _write(args: argparse.Namespace, row: dict[str, Any]) -> None:
    path = args.work / f"{args.variant}{_suffix(args)}.{args.phase}.json"
    path.write_text(json.dumps(row, indent=1))


# -- the suite ------------------------------------------------------------------------------

def suite(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    folder = args.models / f"{args.arch}-dit{f'-l{args.layers}' if args.layers else ''}"
    info = build_folder(args.arch, folder, args.device, args.layers)
    log(f"folder {folder}: {info}")
    variants = [v for v in args.variants.split(",") if v]
    capped = [v for v in (args.capped or "").split(",") if v]
    unknown = [v for v in variants + capped if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    if capped and not args.cap_gib:
        raise SystemExit("--capped needs --cap-gib")
    base = [sys.executable, "-m", "scripts.bench.bench_dit", "run", "--arch", args.arch,
            "--folder", str(folder), "--out", str(args.out), "--work", str(args.work),
            "--device", args.device,
            "--steps", str(args.steps), "--repeats", str(args.repeats),
            "--compile-cache", str(args.models / "compile-cache")]
    if args.shape:
        base += ["--shape", args.shape]
    runs = [(v, None) for v in variants] + [(v, args.cap_gib) for v in capped]
    # 1. cold starts of the compiled variants, in parallel: they fill the compile cache. A
    # variant whose cold start is already recorded in --work (an earlier --cold-only call,
    # same --models, so the same cache) keeps that record: starting it again would be a
    # second start, not a first.
    compiled = sorted({v for v, _ in runs if VARIANTS[v].get("compile")})

    def unrecorded() -> list[str]:
        return [v for v in compiled if not (args.work / f"{v}.cold.json").is_file()]

    cold = unrecorded()
    for v in sorted(set(compiled) - set(cold)):
        log(f"{v}: cold start already recorded in {args.work}; not started again")
    procs = [subprocess.Popen([*base, "--variant", v, "--phase", "cold"]) for v in cold]
    for p in procs:
        p.wait()
    if args.cold_only:
        missing = unrecorded()
        log(f"cold starts done, folder kept at {folder}" +
            (f"; no record from {missing}" if missing else ""))
        return 1 if missing else 0
    # 2. measured, one at a time (a compiled variant's warm-up is now its second start).
    for v, cap in runs:
        extra = [] if cap is None else ["--cap-gib", str(cap)]
        subprocess.run([*base, "--variant", v, "--phase", "warm", *extra], check=False)
    if not args.keep_folder:
        shutil.rmtree(folder, ignore_errors=True)
    return report(args)


def report(args: argparse.Namespace) -> int:
    import torch

    rows = [json.loads(p.read_text()) for p in sorted(args.work.glob("*.warm.json"))]
    cold = {(json.loads(p.read_text())["variant"]): json.loads(p.read_text())
            for p in args.work.glob("*.cold.json")}
    ref_row = next((r for r in rows if r["variant"] == "bf16" and not r.get("cap_gib")), None)
    ref: dict[str, Any] = torch.load(args.work / "bf16.pt") if ref_row else {}

    def rel(a: Any, b: Any) -> float:
        return float((a - b).norm() / b.norm())

    lines = ["| variant | cap GiB | s/step | step / bf16 step | rel L2 forward | rel L2 latents | "
             "peak GiB | resident GiB | ready s (1st / 2nd start) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        suffix = f"-cap{r['cap_gib']:g}" if r.get("cap_gib") else ""
        name = r["variant"] + suffix
        ratio = rel_f = rel_l = "-"
        tensors = args.work / f"{name}.pt"
        if ref_row and tensors.is_file():
            ratio = f"{r['step_s'] / ref_row['step_s']:.2f}"
            mine = torch.load(tensors)
            if "forward" in mine and "forward" in ref:
                rel_f = f"{rel(mine['forward'], ref['forward']):.4f}"
            rel_l = f"{rel(mine['latents'], ref['latents']):.4f}"
        first = cold.get(r["variant"], {}).get("ready_s")
        ready = f"{first} / {r['ready_s']}" if first else f"{r['ready_s']}"
        lines.append(f"| {r['variant']} | {r.get('cap_gib') or '-'} | {r['step_s']} | {ratio} "
                     f"| {rel_f} | {rel_l} | {r['peak_gib']} | {r['resident_gib']} | {ready} |")
    table = "\n".join(lines)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_dit.md").write_text(table + "\n")
    (args.out / "bench_dit.json").write_text(json.dumps({"warm": rows, "cold": cold}, indent=1))
    print(table)
    return 0


# -- the attention kernel -----------------------------------------------------------------------

ATTN_SHAPES = {
    "Wan2.1-14B 480p (1, 40, 32760, 128)": (1, 32760, 40, 128),
    "Wan2.1-1.3B 480p (1, 12, 32760, 128)": (1, 32760, 12, 128),
    "Wan2.1-14B / Wan2.2-A14B 720p (1, 40, 75600, 128)": (1, 75600, 40, 128),
    "Qwen-Image 1024 (1, 24, 4096+256, 128)": (1, 4352, 24, 128),
    "Qwen-Image 1328 (1, 24, 6889+256, 128)": (1, 7145, 24, 128),
}


def timed(fn: Any, reps: int = 10) -> float:
    """Milliseconds per call of ``fn``, CUDA events over ``reps`` calls after 3 warm-ups."""
    import torch

    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / reps


def attn(args: argparse.Namespace) -> int:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from workers.models.dit.fp8_attention import fp8_attention

    args.out.mkdir(parents=True, exist_ok=True)

    def sdpa(q: Any, k: Any, v: Any, backend: Any = SDPBackend.CUDNN_ATTENTION) -> Any:
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    compiled = torch.compile(fp8_attention)
    lines = ["| shape | bf16 cuDNN ms | FP8 ms (compiled, incl. quantisation) | speed-up | "
             "FP8 TFLOP/s | rel L2 bf16 vs fp32 | rel L2 FP8 vs fp32 |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    rows = {}
    for name, (b, s, h, d) in ATTN_SHAPES.items():
        g = torch.Generator(args.device).manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, device=args.device, dtype=torch.bfloat16, generator=g)
                   for _ in range(3))
        bf16_ms = timed(lambda q=q, k=k, v=v: sdpa(q, k, v))
        fp8_ms = timed(lambda q=q, k=k, v=v: compiled(q, k, v))
        row = {"bf16_ms": round(bf16_ms, 2), "fp8_ms": round(fp8_ms, 2),
               "speedup": round(bf16_ms / fp8_ms, 2),
               "fp8_tflops": round(4 * b * h * s * s * d / fp8_ms / 1e9)}
        if s <= 33000:  # float32 reference (memory-efficient kernel) where it fits quickly
            ref = sdpa(q.float(), k.float(), v.float(), SDPBackend.EFFICIENT_ATTENTION).float()
            row["bf16_rel"] = round(float((sdpa(q, k, v).float() - ref).norm() / ref.norm()), 4)
            row["fp8_rel"] = round(float((compiled(q, k, v).float() - ref).norm() / ref.norm()),
                                   4)
            del ref
        rows[name] = row
        lines.append(f"| {name} | {row['bf16_ms']} | {row['fp8_ms']} | {row['speedup']}x | "
                     f"{row['fp8_tflops']} | {row.get('bf16_rel', '-')} | "
                     f"{row.get('fp8_rel', '-')} |")
        log(f"attention {name}: {row}")
        del q, k, v
        torch.cuda.empty_cache()
    (args.out / "attention.json").write_text(json.dumps(rows, indent=1))
    table = "\n".join(lines)
    (args.out / "attention.md").write_text(table + "\n")
    print(table)
    return 0


def hooks(args: argparse.Namespace) -> int:
    import statistics

    import torch

    from contracts.stage_options import StageOptions
    from modelkit.real import qwen_dit, wan_dit
    from workers.models.memory import Placement, place

    args.out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for arch in args.archs.split(","):
        with torch.device("meta"):
            model = qwen_dit() if arch == "qwen-image" else wan_dit(arch)
        place(model, Placement(torch.device("meta"), torch.bfloat16,
                               StageOptions(weight_storage="fp8")))
        hooked = [(m, list(reg.hooks.values())) for m in model.modules()
                  if (reg := getattr(m, "_diffusers_hook", None)) is not None and reg.hooks]
        tensors = sum(1 for m, _ in hooked for _ in m.parameters(recurse=False))

        def one_forward(hooked: list[Any] = hooked) -> float:
            t0 = time.perf_counter()
            for module, hs in hooked:
                for h in hs:
                    h.pre_forward(module)
                for h in hs:
                    h.post_forward(module, None)
            return time.perf_counter() - t0

        one_forward()
        times = [one_forward() for _ in range(args.repeats)]
        rows[arch] = {"modules": len(hooked), "tensors": tensors,
                      "ms_median": round(statistics.median(times) * 1e3, 1),
                      "ms_min": round(min(times) * 1e3, 1)}
        log(f"hooks {arch}: {rows[arch]}")
    lines = ["| DiT | modules hooked | weight tensors cast (each way) | host ms per forward, "
             "median (min) |", "| --- | --- | --- | --- |"]
    lines += [f"| {a} | {r['modules']} | {r['tensors']} | {r['ms_median']} ({r['ms_min']}) |"
              for a, r in rows.items()]
    (args.out / "hooks.json").write_text(json.dumps(rows, indent=1))
    (args.out / "hooks.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def fp8_row_shapes(arch: str) -> list[dict[str, Any]]:
    """The distinct (in, out) shapes of the linear layers in one block of the published DiT
    (built on meta tensors) that FP8 linear converts, and of those it leaves in bf16 because
    their rows are the prompt's tokens; each with the first layer that has it."""
    import torch

    from modelkit.real import qwen_dit, wan_dit
    from workers.models.dit.dit_options import fp8_linear_targets, prompt_row_layers

    with torch.device("meta"):
        model = qwen_dit(1) if arch == "qwen-image" else wan_dit(arch, 1)
    kinds = [(name, "fp8") for name in fp8_linear_targets(model)] + \
        [(name, "bf16 (prompt rows)") for name in prompt_row_layers(model)]
    shapes: dict[tuple[int, int, str], dict[str, Any]] = {}
    for name, kind in kinds:
        module = model.get_submodule(name)
        key = (module.in_features, module.out_features, kind)
        if key not in shapes:
            shapes[key] = {"arch": arch, "layer": name, "in": key[0], "out": key[1],
                           "kind": kind}
    return list(shapes.values())


def rows(args: argparse.Namespace) -> int:
    """For each linear shape of :func:`fp8_row_shapes`: the row counts (batch 1, 1..128 and
    ``FP8_MIN_TOKENS``) for which torchao's FP8 rowwise matmul raises
    CUBLAS_STATUS_NOT_SUPPORTED on this GPU. What ``FP8_MIN_TOKENS`` and the text stream's
    exclusion rest on; a converted shape failing at the minimum exits 1."""
    import torch

    from contracts.errors import ModelLoadError
    from workers.models.dit.dit_options import FP8_MIN_TOKENS, check_fp8_linear, quantize_fp8

    try:
        check_fp8_linear(torch.device(args.device))
    except ModelLoadError as exc:
        raise SystemExit(f"bench_dit rows: {exc}") from None

    args.out.mkdir(parents=True, exist_ok=True)
    counts = [*range(1, 129), FP8_MIN_TOKENS]
    table = []
    for arch in args.archs.split(","):
        for shape in fp8_row_shapes(arch):
            lin = torch.nn.Linear(shape["in"], shape["out"], device=args.device,
                                  dtype=torch.bfloat16)
            quantize_fp8(lin)
            failing = []
            for n in counts:
                x = torch.randn(1, n, shape["in"], device=args.device, dtype=torch.bfloat16)
                try:
                    with torch.no_grad():
                        lin(x)
                    torch.cuda.synchronize(args.device)
                except RuntimeError as exc:
                    if "CUBLAS_STATUS_NOT_SUPPORTED" not in str(exc):
                        raise
                    failing.append(n)
            shape["failing_rows"] = failing
            table.append(shape)
            log(f"rows {arch} {shape['layer']}: {len(failing)} failing, up to "
                f"{max(failing, default=0)}")
    lines = [f"| DiT | layer | in -> out | FP8 or bf16 | rows failing (of 1..128 and "
             f"{FP8_MIN_TOKENS}) |", "| --- | --- | --- | --- | --- |"]
    for r in table:
        f = r["failing_rows"]
        span = f"{len(f)}, from {min(f)} to {max(f)}" if f else "none"
        lines.append(f"| {r['arch']} | {r['layer']} | {r['in']} -> {r['out']} | {r['kind']} | "
                     f"{span} |")
    env = {"gpu": torch.cuda.get_device_name(args.device), "torch": torch.__version__,
           "cuda": torch.version.cuda}
    (args.out / "rows.json").write_text(json.dumps({"environment": env, "shapes": table},
                                                   indent=1))
    (args.out / "rows.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    bad = [r for r in table if r["kind"] == "fp8" and FP8_MIN_TOKENS in r["failing_rows"]]
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    hk = sub.add_parser("hooks")
    hk.add_argument("--out", type=Path, required=True, help="where the tables go")
    hk.add_argument("--archs", default="qwen-image,wan-14b")
    hk.add_argument("--repeats", type=int, default=10)
    rw = sub.add_parser("rows")
    rw.add_argument("--out", type=Path, required=True, help="where the tables go")
    rw.add_argument("--archs", default="wan-1.3b,wan-14b,qwen-image")
    rw.add_argument("--device", default="cuda:0")
    for name in ("suite", "run", "report", "attn"):
        p = sub.add_parser(name)
        p.add_argument("--out", type=Path, required=True, help="where the tables go")
        p.add_argument("--device", default="cuda:0")
        if name in ("suite", "run", "report"):
            p.add_argument("--work", type=Path, help="rows and tensors of each run "
                           "(default: OUT/runs)")
        if name in ("suite", "run"):
            p.add_argument("--arch", choices=sorted(SHAPES), required=True)
            p.add_argument("--steps", type=int, default=2)
            p.add_argument("--repeats", type=int, default=2)
            p.add_argument("--shape", help="geometry instead of the published default "
                           "(HxWxF / HxW; quick checks)")
            p.add_argument("--layers", type=int, help="DiT depth (quick checks)")
        if name == "suite":
            p.add_argument("--variants", default="bf16,fp8_attention,fp8_compiled")
            p.add_argument("--models", type=Path,
                           default=Path(os.environ.get("TMPDIR", "/tmp")) / "diffring-models")
            p.add_argument("--capped", default="",
                           help="variants to run again under --cap-gib (one process each)")
            p.add_argument("--cap-gib", type=float,
                           help="GPU memory cap of each --capped process (max_vram_gb)")
            p.add_argument("--keep-folder", action="store_true")
            p.add_argument("--cold-only", action="store_true",
                           help="build the folder and run the compiled variants' cold starts "
                           "(filling the compile cache), keep both, measure nothing; a later "
                           "suite with the same --models and --work measures")
        if name == "run":
            p.add_argument("--variant", choices=sorted(VARIANTS), required=True)
            p.add_argument("--folder", type=Path, required=True)
            p.add_argument("--phase", choices=("cold", "warm"), default="warm")
            p.add_argument("--cap-gib", type=float)
            p.add_argument("--compile-cache", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.cmd == "hooks":
        return hooks(args)
    if args.cmd == "rows":
        return rows(args)
    if getattr(args, "shape", None):
        SHAPES[args.arch] = args.shape
    if args.cmd != "attn" and args.work is None:
        args.work = args.out / "runs"
    if args.cmd != "attn":
        args.work.mkdir(parents=True, exist_ok=True)
    if args.cmd == "attn":
        return attn(args)
    if args.cmd == "report":
        return report(args)
    if args.cmd == "run":
        args.out.mkdir(parents=True, exist_ok=True)
        return run_variant(args)
    return suite(args)


if __name__ == "__main__":
    sys.exit(main())
