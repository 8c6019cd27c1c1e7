"""Where a benchmark's model folder comes from (``bench_serving``, ``bench_stage_memory``):
a folder as it is (``--model-path``), a tiny model of the pipeline (built if missing), or a
real-size random-weight architecture built on the fly (``--arch``: :mod:`modelkit.real`, in
a child process, so that its GPU memory is gone before anything is measured; a folder of the
same recipe under ``--arch-dir`` is reused)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from modelkit.real import ARCHS, PIPELINE, TEXT_ENCODERS
from scripts import ROOT


def add_model_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--models", type=Path, default=ROOT / "out" / "tiny-models",
                    help="tiny-model root (built there if missing); ignored with --arch")
    ap.add_argument("--model-path", type=Path, help="a model folder to use as is")
    ap.add_argument("--arch", choices=ARCHS,
                    help="build a real-size random-weight model of this architecture")
    ap.add_argument("--arch-dir", type=Path, default=Path("/tmp/diffring-real"),
                    help="--arch: where its folder is built (and reused)")
    ap.add_argument("--clean-arch-dir", action="store_true",
                    help="--arch: first remove the other folders in --arch-dir (in /dev/shm "
                         "they hold host memory the services need)")
    ap.add_argument("--layers", type=int, help="--arch: DiT depth (default: the published)")
    ap.add_argument("--text-encoders", choices=TEXT_ENCODERS, default="stub",
                    help="--arch: stub (real width, 2 layers; default) or full (the published "
                         "UMT5-XXL / Qwen2.5-VL-7B)")
    ap.add_argument("--image-layers", type=int,
                    help="--arch: CLIP image encoder depth, I2V (default: the published)")


def arch_folder(args: argparse.Namespace) -> Path:
    """The folder ``--arch`` builds into: one per recipe that changes the weights' shapes."""
    name = args.arch + (f"-l{args.layers}" if args.layers else "")
    name += "-full" if args.text_encoders == "full" else ""
    name += f"-img{args.image_layers}" if args.image_layers else ""
    return Path(args.arch_dir) / name


def model_folder(args: argparse.Namespace, device: str, dtype: str,
                 log: Callable[[str], None]) -> tuple[Path, dict[str, Any] | None]:
    """The folder to serve and, when built now (or reused), what modelkit.real reported."""
    if args.model_path is not None:
        return args.model_path, None
    if not args.arch:
        from modelkit.tiny import build_task

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        return build_task(args.models, args.pipeline, seed=0), None
    model = arch_folder(args)
    if args.clean_arch_dir:
        remove_others(model, log)
    log(f"building {args.arch} in {model} on {device} ({dtype})")
    cmd = [sys.executable, "-m", "modelkit.real", "--arch", args.arch, "--out", str(model),
           "--device", device, "--dtype", dtype, "--text-encoders", args.text_encoders]
    cmd += ["--layers", str(args.layers)] if args.layers else []
    cmd += ["--image-layers", str(args.image_layers)] if args.image_layers else []
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"building {args.arch} failed:\n{proc.stderr[-3000:]}")
    built: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    log(f"built: {built}")
    return model, built


def remove_others(model: Path, log: Callable[[str], None]) -> None:
    """Everything beside ``model`` in its folder (other architectures, interrupted builds)."""
    for other in model.parent.iterdir() if model.parent.is_dir() else []:
        if other != model:
            log(f"removing {other} (--clean-arch-dir)")
            if other.is_dir():
                shutil.rmtree(other)
            else:
                other.unlink()


def arch_pipeline(arch: str) -> str:
    """The pipeline an ``--arch`` folder serves."""
    return PIPELINE[arch]
