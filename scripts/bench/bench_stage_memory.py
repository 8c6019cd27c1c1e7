#!/usr/bin/env python3
"""One stage's GPU memory and time, loaded and run through its worker adapter.

    # the Wan2.1-I2V-14B encoder stage (UMT5-XXL + CLIP ViT-H/14 + VAE encoder) under 24 GiB
    python -m scripts.bench.bench_stage_memory --arch wan-14b-i2v --text-encoders full \\
        --stage encoder --set encoder.max_vram_gb=24 --device cuda:0 --out $OUT
    # several variants, one process each (a --set selector names the variant it is for)
    python -m scripts.bench.bench_stage_memory --arch qwen-image --text-encoders full \\
        --stage encoder --variants bf16,fp8 --set 'fp8:encoder.weight_storage="fp8"' \\
        --device cuda:0 --out $OUT
    # the code path on a CPU: a tiny model, a small request
    python -m scripts.bench.bench_stage_memory --pipeline wan_i2v --stage encoder \\
        --shape 32x32x9 --out out/stage

Each variant runs in a process of its own, so that its memory cap and its peak are its own.
Its stage adapter is made as a worker of that role makes it: from a service config (``--set``
takes a service file's keys, as ``bench_serving`` does: ``encoder.max_vram_gb=24``,
``'transformer.weight_storage="fp8"'``, ``attention_backend``, ...; see
``bench_serving_modes``) with the worker's adapter options. Then

1. load, timed: the budget check of a worker's start refuses here, naming its estimate;
2. ``--repeats`` requests of ``--shape`` (the first timed apart: allocator growth and kernel
   choice), each inside the worker's guard, which records the process's peak GPU memory over
   the request (``MemoryWatch``: what ``diffring_stage_peak_bytes`` reports) and turns an
   out-of-memory into the error a worker would report.

Inputs: encoder: the prompt (and ``--images`` generated pictures of the request's size for
image-conditioned tasks); transformer: the adapter's warm-up inputs (encoder outputs of the
right shapes), ``--steps`` steps with the task's default guidance; decoder: random latents of
the request's latent shape.

A row (``OUT/bench_stage_memory.json`` and ``.md``): the stage options that differ from the
defaults, the load check's estimate (weights under those options + working memory), load s,
resident GiB after load, peak GiB, first and median request s; or the error that refused or
failed the variant (the run then exits with status 1).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contracts.pipelines import TASK_SPECS, TASKS
from scripts.bench import bench_serving_modes as modes_
from scripts.bench.bench_models import add_model_args, arch_pipeline, model_folder

STAGES = ("encoder", "transformer", "decoder")
GIB = 2**30
# Default request size: the published one for --arch, a small one for the tiny models.
REAL_SHAPE = {"video": "480x832x81", "image": "1024x1024"}
TINY_SHAPE = {"video": "32x32x9", "image": "64x64"}


def log(msg: str) -> None:
    print(f"[stage {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Variant:
    """A variant's name, as ``--set`` selectors name it."""

    name: str

    def matches(self, selector: str) -> bool:
        return selector == self.name


# -- in the variant's process ------------------------------------------------------------

def request_for(task: str, shape: str, steps: int, **extra: Any) -> Any:
    """A request of ``task`` at ``shape`` ("HxWxF" / "HxW"), the task's defaults otherwise."""
    from contracts.request import GenerationRequest
    from workers.models.components import warmup_geometry

    return GenerationRequest(task=task, prompt="a benchmark request", infer_steps=steps, seed=3,
                             **warmup_geometry(shape, TASK_SPECS[task]), **extra)


def load_timed(adapter: Any) -> dict[str, float]:
    """Load the stage; its seconds and what it then holds on its GPU (0 on a CPU)."""
    t0 = time.perf_counter()
    adapter.load()
    return {"load_s": round(time.perf_counter() - t0, 2),
            "resident_gib": round(adapter.memory.resident_bytes / GIB, 2)}


def make_adapter(role: str, cfg: Any) -> Any:
    """The stage adapter a worker of ``role`` makes from its service config ``cfg``."""
    from workers.models import DecoderAdapter, EncoderAdapter, TransformerAdapter
    from workers.roles import transformer_options, video_settings

    cls: Any = {"encoder": EncoderAdapter, "transformer": TransformerAdapter,
                "decoder": DecoderAdapter}[role]
    options = {"encoder": lambda: {"options": cfg.encoder},
               "transformer": lambda: transformer_options(cfg),
               "decoder": lambda: {"video": video_settings(cfg), "options": cfg.decoder}}[role]()
    return cls.for_task(cfg.model_path, cfg.pipeline, cfg.device, cfg.dtype, **options)


def stage_inputs(role: str, adapter: Any, req: Any, images: int) -> Any:
    """What one request hands the stage: (args of its call)."""
    import torch

    if role == "encoder":
        image = None
        if TASK_SPECS[req.task].needs_image:
            from contracts.input_images import pack_images
            from scripts.bench.bench_inputs import input_images

            pics = input_images(images, req.height, req.width)
            pics = [pics] if isinstance(pics, str) else pics
            image = pack_images([base64.b64decode(p) for p in pics])
        return (req, image)
    if role == "transformer":
        return (req, adapter.warmup_inputs(req, 0))
    vae = adapter.vae.config
    frames = (req.num_frames - 1) // 2 ** sum(vae.temperal_downsample) + 1 \
        if TASK_SPECS[req.task].output == "video" else 1
    spatial = 2 ** len(vae.temperal_downsample)
    shape = (1, vae.z_dim, frames, req.height // spatial, req.width // spatial)
    return (req, {"latents": torch.randn(shape, generator=torch.Generator().manual_seed(5))})


def run_variant(args: argparse.Namespace) -> dict[str, Any]:
    """Load the stage with the variant's options and time ``--repeats`` requests."""
    from contracts.config import ServiceConfig
    from contracts.errors import DiffringError
    from contracts.stage_options import StageOptions
    from workers.models.components import STAGE_COMPONENTS, WEIGHTS
    from workers.models.memory import estimate_weights

    settings = [modes_.parse_set(item) for item in args.set]
    spec = TASK_SPECS[args.pipeline]
    base = {"model_cls": spec.model_cls, "task": spec.task, "model_path": str(args.folder),
            "device": args.device, "dtype": args.dtype}
    cfg = ServiceConfig.from_dict(modes_.settings_for(
        args.run_variant, Variant(args.run_variant).matches, settings, base))
    opts: StageOptions = cfg.stage_options(args.stage)
    defaults = StageOptions()
    row: dict[str, Any] = {
        "variant": args.run_variant, "stage": args.stage, "pipeline": args.pipeline,
        "shape": args.shape, "options": {k: v for k, v in vars(opts).items()
                                         if v != getattr(defaults, k)}}
    if cfg.torch_threads is not None:
        import torch

        torch.set_num_threads(cfg.torch_threads)
    fn = {"encoder": "encode", "transformer": "denoise", "decoder": "decode_pixels"}[args.stage]
    try:
        adapter = make_adapter(args.stage, cfg)
        row.update(load_timed(adapter))
        folders = [args.folder / c for c, kind in
                   STAGE_COMPONENTS[spec.name][args.stage].items() if kind == WEIGHTS]
        row["estimate_gib"] = round((estimate_weights(folders, adapter.dtype.itemsize)
                                     .bytes_for(opts) + adapter.working_bytes()) / GIB, 2)
        req = request_for(args.pipeline, args.shape, args.steps)
        times = []
        for _ in range(args.repeats):
            call_args = stage_inputs(args.stage, adapter, req, args.images)
            with adapter.guarded(args.shape):
                t0 = time.perf_counter()
                getattr(adapter, fn)(*call_args)  # each returns once its device finished
                times.append(time.perf_counter() - t0)
    except DiffringError as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
        return row
    row["first_request_s"] = round(times[0], 3)
    rest = sorted(times[1:] or times)
    row["request_s"] = round(rest[len(rest) // 2], 3)
    row["peak_gib"] = round(adapter.memory.max_peak_bytes / GIB, 2)
    return row


# -- the run --------------------------------------------------------------------------------

def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| variant | stage | shape | options | estimate GiB | load s | resident GiB | "
             "peak GiB | first request s | request s |", "|" + " --- |" * 10]
    for r in rows:
        options = ", ".join(f"{k}={json.dumps(v)}" for k, v in r["options"].items()) or "-"
        head = f"| {r['variant']} | {r['stage']} | {r['shape']} | {options} |"
        if "error" in r:
            lines.append(f"{head} {r['error'].splitlines()[0]} |" + " |" * 5)
            continue
        lines.append(f"{head} {r['estimate_gib']} | {r['load_s']} | {r['resident_gib']} | "
                     f"{r['peak_gib']} | {r['first_request_s']} | {r['request_s']} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pipeline", choices=[t for t in TASKS if t != "synthetic"],
                    help="default: the --arch's")
    add_model_args(ap)
    ap.add_argument("--stage", choices=STAGES, required=True)
    ap.add_argument("--variants", default="default",
                    help="comma-separated names, one process each (default: one, 'default')")
    ap.add_argument("--set", action="append", default=[], metavar="[VARIANT:]KEY=JSON",
                    help="service config field of every variant (or of VARIANT's), KEY dotted "
                         "for a section's: --set encoder.max_vram_gb=24")
    ap.add_argument("--shape", help="request geometry HxWxF / HxW (default: the published "
                    "480x832x81 / 1024x1024 with --arch, else 32x32x9 / 64x64)")
    ap.add_argument("--steps", type=int, default=2, help="transformer: denoising steps")
    ap.add_argument("--repeats", type=int, default=2, help="requests per variant")
    ap.add_argument("--images", type=int, default=1,
                    help="encoder of an image-conditioned task: input pictures")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", help="default: bfloat16 on cuda, else float32")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dry-run", action="store_true",
                    help="check each variant's config (as a service would) and stop")
    ap.add_argument("--run-variant", help=argparse.SUPPRESS)  # in the variant's process
    ap.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.arch:
        args.pipeline = args.pipeline or arch_pipeline(args.arch)
    if not args.pipeline:
        ap.error("give --pipeline or --arch")
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    output = TASK_SPECS[args.pipeline].output
    args.shape = args.shape or (REAL_SHAPE if args.arch else TINY_SHAPE)[output]
    if args.repeats < 1 or args.images < 1:
        ap.error("--repeats and --images must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.run_variant:
        row = run_variant(args)
        (args.out / "runs").mkdir(parents=True, exist_ok=True)
        (args.out / "runs" / f"{args.run_variant}.json").write_text(json.dumps(row, indent=1))
        return 0
    variants = [Variant(v.strip()) for v in args.variants.split(",") if v.strip()]
    if not variants or len({v.name for v in variants}) != len(variants):
        raise SystemExit("--variants: give each name once")
    settings = [modes_.parse_set(item) for item in args.set]
    modes_.check_selectors(settings, variants, "variant")
    if args.dry_run:
        return dry_run(args, variants, settings)
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder, built = model_folder(args, args.device, args.dtype, log)
    rows = []
    for v in variants:
        log(f"{v.name}: {args.stage} stage of {folder} at {args.shape}")
        proc = subprocess.run([sys.executable, "-m", "scripts.bench.bench_stage_memory", *argv,
                               "--run-variant", v.name, "--folder", str(folder)], check=False)
        path = args.out / "runs" / f"{v.name}.json"
        if proc.returncode != 0 or not path.is_file():
            rows.append({"variant": v.name, "stage": args.stage, "shape": args.shape,
                         "options": {}, "error": f"the variant's process exited with "
                         f"{proc.returncode} (its output is above)"})
        else:
            rows.append(json.loads(path.read_text()))
        log(f"{v.name}: {rows[-1]}")
    md = f"{args.arch or args.pipeline}, {args.stage} stage, {args.device} {args.dtype}\n\n" \
         f"{table(rows)}\n"
    (args.out / "bench_stage_memory.md").write_text(md)
    (args.out / "bench_stage_memory.json").write_text(json.dumps(
        {"command": " ".join(["bench_stage_memory", *argv]), "model": str(folder),
         "built": built, "rows": rows}, indent=1))
    print(md)
    return 1 if any("error" in r for r in rows) else 0


def dry_run(args: argparse.Namespace, variants: list[Variant],
            settings: list[modes_.Setting]) -> int:
    """Each variant's settings, checked by the services' own config parser."""
    spec = TASK_SPECS[args.pipeline]
    base = {"model_cls": spec.model_cls, "task": spec.task, "device": args.device,
            "dtype": args.dtype}
    for v in variants:
        fields = modes_.settings_for(v.name, v.matches, settings)
        modes_.check_service_config({**base, **fields}, v.name)
        print(f"{v.name}: {args.stage} {json.dumps(fields, sort_keys=True)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
