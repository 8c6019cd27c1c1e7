"""Build tiny random-weight models of the real diffusers architectures, offline.

    python -m modelkit.tiny --out DIR [--seed N] [--tasks wan_t2v,qwen_t2i] [--force]

or from Python, ``modelkit.tiny.build_task(out, task)`` / ``build_all(out)``.

For each task this writes ``DIR/<task>/``, a diffusers-format folder (``model_index.json`` plus
one sub-folder per component, written with ``save_pretrained``) that the stock diffusers
pipelines and our stage adapters load with ``from_pretrained``:

* ``wan_t2v``  - Wan2.1 text-to-video: UMT5 text encoder + T5 tokenizer, WanTransformer3DModel,
  AutoencoderKLWan, UniPC scheduler with Wan's flow-matching settings.
* ``wan_i2v``  - Wan2.1 image-to-video: the above + CLIP vision encoder and image processor; the
  DiT has ``image_dim`` / ``added_kv_proj_dim`` set as real I2V checkpoints do.
* ``wan22_a14b_t2v`` / ``wan22_a14b_i2v`` - Wan2.2-A14B: two tiny experts of one shape
  (``transformer`` high-noise, ``transformer_2`` low-noise) and ``boundary_ratio`` in the
  model index (0.875 / 0.9, with the published scheduler shifts 12 / 5: the boundary falls
  inside three steps, so both experts run); the I2V has no CLIP.
* ``wan22_5b_t2v`` / ``wan22_5b_i2v`` - Wan2.2-TI2V-5B: one DiT over a tiny Wan2.2 VAE (48
  latent channels, 16x spatial compression), ``expand_timesteps`` in the model index; the two
  folders are the same checkpoint (one per task, as every task has its folder).
* ``qwen_t2i`` - Qwen-Image: Qwen2.5-VL text encoder + byte-level BPE Qwen2 tokenizer,
  QwenImageTransformer2DModel, AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler.
* ``qwen_i2i`` - Qwen-Image-Edit: the above + a ``processor`` folder (image processor +
  tokenizer) for the vision-language prompt.
* ``qwen_i2i_plus`` - Qwen-Image-Edit-2511 style (QwenImageEditPlusPipeline): the Edit
  folder with ``zero_cond_t`` set in the DiT's config.
* ``synthetic`` - no model: ``synthetic.json`` with the synthetic pipeline's default stage
  times and tensor shapes (``workers/models/families/synthetic.py``); needs no torch.

Nothing is downloaded: the tokenizers are built here from a few sentences, the weights are
random (seeded, so a build is reproducible with the same torch version). The sizes are chosen
so that a whole request runs in about a second on one CPU core, while every code path of the
real models (cross attention, I2V image attention, multimodal RoPE, VAE temporal causality)
is still exercised.

A build is idempotent: ``DIR/<task>/diffring_tiny.json`` records the build parameters, and a
folder whose marker matches is left alone. Folders are built in a temporary sibling and moved
into place, so a concurrent or interrupted build never leaves a half-written model behind.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from contracts.pipelines import TASKS
from modelkit import components as c
from modelkit.tokenizers import build_qwen_tokenizer, build_t5_tokenizer

# Bump whenever a config, a tokenizer rule or an initialisation below changes, so that old
# folders are rebuilt instead of silently reused.
RECIPE_VERSION = 2
WAN22_BOUNDARY = {"t2v": 0.875, "i2v": 0.9}
"""Wan2.2-A14B's published boundary ratios."""
WAN22_SHIFT = {"t2v": 12.0, "i2v": 5.0}
"""Wan2.2-A14B's published sample shifts (TI2V-5B: 5.0)."""
MARKER_NAME = "diffring_tiny.json"


def _log(msg: str) -> None:
    print(f"[modelkit.tiny] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Folders
# ---------------------------------------------------------------------------------------------
def _build_wan(dest: Path, seed: int, i2v: bool, published: bool = False) -> None:
    """``published``: the VAE with the published two residual blocks per level and the CLIP
    with 80-wide heads, as the original Wan2.1 files imply (modelkit/original.py)."""
    from diffusers import WanImageToVideoPipeline, WanPipeline

    tokenizer = build_t5_tokenizer()
    clip = {"hidden": 160, "heads": 2} if published else {}
    common: dict[str, Any] = {
        "tokenizer": tokenizer,
        "text_encoder": c.wan_text_encoder(seed, c.round_up(len(tokenizer), 64)),
        "vae": c.wan_vae(seed, num_res_blocks=2 if published else 1),
        "scheduler": c.wan_scheduler(),
        "transformer": c.wan_transformer(seed, i2v, **(
            {"image_dim": clip["hidden"]} if published else {})),
    }
    pipe: Any
    if i2v:
        image_encoder, image_processor = c.clip_vision(seed, **clip)
        pipe = WanImageToVideoPipeline(
            image_encoder=image_encoder, image_processor=image_processor, **common
        )
    else:
        pipe = WanPipeline(**common)
    pipe.save_pretrained(dest, safe_serialization=True)
    if i2v:
        # Name the image processor as the published checkpoint does. save_pretrained records
        # the PIL class used here, which would pin loaders to the PIL backend even where
        # torchvision is installed (diffusers and our stage would then resize differently).
        c.patch_model_index(dest, image_processor=["transformers", "CLIPImageProcessor"])


def _build_wan22_a14b(dest: Path, seed: int, i2v: bool, published: bool = False) -> None:
    """``published``: the VAE with the published two residual blocks per level, as the
    original Wan2.1_VAE.pth that the original Wan2.2-A14B folders ship implies."""
    from diffusers import WanImageToVideoPipeline, WanPipeline

    tokenizer = build_t5_tokenizer()
    task = "i2v" if i2v else "t2v"
    channels = 36 if i2v else 16
    common: dict[str, Any] = {
        "tokenizer": tokenizer,
        "text_encoder": c.wan_text_encoder(seed, c.round_up(len(tokenizer), 64)),
        "vae": c.wan_vae(seed, num_res_blocks=2 if published else 1),
        "scheduler": c.wan_scheduler(WAN22_SHIFT[task]),
        "transformer": c.wan22_transformer(seed, f"{task}.high", channels, 16),
        "transformer_2": c.wan22_transformer(seed, f"{task}.low", channels, 16),
        "boundary_ratio": WAN22_BOUNDARY[task],
    }
    pipe: Any = WanImageToVideoPipeline(**common) if i2v else WanPipeline(**common)
    pipe.save_pretrained(dest, safe_serialization=True)


def _build_wan22_5b(dest: Path, seed: int, published: bool = False) -> None:
    """``published``: the VAE as an original ``Wan2.2_VAE.pth`` implies
    (:func:`modelkit.components.wan22_vae`)."""
    from diffusers import WanPipeline

    tokenizer = build_t5_tokenizer()
    pipe: Any = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=c.wan_text_encoder(seed, c.round_up(len(tokenizer), 64)),
        vae=c.wan22_vae(seed, published),
        scheduler=c.wan_scheduler(5.0),
        transformer=c.wan22_transformer(seed, "5b", 48, 48),
        expand_timesteps=True,
    )
    pipe.save_pretrained(dest, safe_serialization=True)


def build_published_wan(dest: Path, seed: int, i2v: bool) -> Path:
    """A tiny Wan2.1 folder (diffusers' layout) whose VAE and CLIP keep the structure of the
    published original files (see :func:`_build_wan`), built in place."""
    import torch

    with _in_place(dest, dest.name, keep=lambda: (dest / "model_index.json").is_file()) as tmp, \
            torch.no_grad():
        _build_wan(tmp, seed, i2v, published=True)
    return dest


def build_published_wan22(dest: Path, seed: int, task: str) -> Path:
    """A tiny Wan2.2 folder (diffusers' layout) of ``task`` whose VAE keeps the structure of
    the published original file (A14B: ``Wan2.1_VAE.pth``, :func:`_build_wan22_a14b`;
    TI2V-5B: ``Wan2.2_VAE.pth``, :func:`_build_wan22_5b`), built in place."""
    import torch

    with _in_place(dest, dest.name, keep=lambda: (dest / "model_index.json").is_file()) as tmp, \
            torch.no_grad():
        if task.startswith("wan22_5b"):
            _build_wan22_5b(tmp, seed, published=True)
        else:
            _build_wan22_a14b(tmp, seed, task.endswith("i2v"), published=True)
    return dest


def _build_qwen(dest: Path, seed: int, edit: bool, zero_cond_t: bool = False) -> None:
    from diffusers import QwenImagePipeline

    tokenizer = build_qwen_tokenizer()
    pipe: Any = QwenImagePipeline(
        scheduler=c.qwen_scheduler(),
        vae=c.qwen_vae(seed),
        text_encoder=c.qwen_text_encoder(seed, tokenizer),
        tokenizer=tokenizer,
        transformer=c.qwen_transformer(seed, zero_cond_t=zero_cond_t),
    )
    pipe.save_pretrained(dest, safe_serialization=True)
    if not edit:
        return
    # Qwen-Image-Edit shares every component with Qwen-Image and adds a vision-language
    # processor (saved as its parts, as the real checkpoint's).
    c.save_edit_processor(dest, c.qwen_vl_image_processor(), tokenizer)
    c.patch_model_index(dest, _class_name="QwenImageEditPipeline")


def _build_qwen_edit_plus(dest: Path, seed: int) -> None:
    """Qwen-Image-Edit-2511 style: the Edit folder (same components, the same weights) whose
    model index names QwenImageEditPlusPipeline and whose DiT sets ``zero_cond_t``, as the
    published 2511 checkpoint's does (2509's leaves it off; a test builds that variant from
    this folder by its config alone: the flag adds no weights)."""
    _build_qwen(dest, seed, edit=True, zero_cond_t=True)
    c.patch_model_index(dest, _class_name="QwenImageEditPlusPipeline")


def _marker(task: str, seed: int) -> dict[str, Any]:
    return {"format": "diffring-tiny", "recipe_version": RECIPE_VERSION, "task": task, "seed": seed}


def _read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((folder / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _marker_matches(folder: Path, task: str, seed: int) -> bool:
    found = _read_marker(folder)
    if found is None:
        return False
    want = _marker(task, seed)
    return all(found.get(k) == v for k, v in want.items())


def build_task(out: Path, task: str, seed: int = 0, force: bool = False) -> Path:
    """Build ``out/<task>`` unless a folder with the same build parameters is already there."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")
    dest = out / task
    if not force and _marker_matches(dest, task, seed):
        _log(f"{dest}: up to date, skipped")
        return dest
    if task == "synthetic":
        return _build_synthetic(dest, task, seed)

    import diffusers
    import torch
    import transformers

    started = time.monotonic()
    # Another process may finish the same build first: then its folder is kept.
    with _in_place(dest, task, keep=lambda: not force and _marker_matches(dest, task, seed)) \
            as tmp, torch.no_grad(), _quiet_transformers():
        if task.startswith("wan_"):
            _build_wan(tmp, seed, i2v=task == "wan_i2v")
        elif task.startswith("wan22_a14b_"):
            _build_wan22_a14b(tmp, seed, i2v=task.endswith("i2v"))
        elif task.startswith("wan22_5b_"):
            _build_wan22_5b(tmp, seed)
        elif task == "qwen_i2i_plus":
            _build_qwen_edit_plus(tmp, seed)
        else:
            _build_qwen(tmp, seed, edit=task == "qwen_i2i")
        marker = {
            **_marker(task, seed),
            "built_with": {
                "torch": torch.__version__,
                "diffusers": diffusers.__version__,
                "transformers": transformers.__version__,
            },
        }
        (tmp / MARKER_NAME).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
    _log(f"{dest}: built in {time.monotonic() - started:.1f} s")
    return dest


def _build_synthetic(dest: Path, task: str, seed: int) -> Path:
    """The synthetic pipeline's folder: its default config and the marker (no weights)."""
    from workers.models.families.synthetic import write_config

    with _in_place(dest, task, keep=lambda: False) as tmp:
        write_config(tmp)
        (tmp / MARKER_NAME).write_text(json.dumps(_marker(task, seed), indent=2) + "\n")
    _log(f"{dest}: written")
    return dest


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' chatter while a tiny model is built: a "Writing model shards" bar per
    component, and a warning that CLIPImageProcessor falls back to its PIL backend without
    torchvision (which is what we want: PyPI's torchvision does not import beside the CPU
    torch). Nothing a reader of the demo can act on; errors still show."""
    from transformers.utils import logging as hf_logging

    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _in_place(dest: Path, task: str, keep: Callable[[], bool]) -> Iterator[Path]:
    """A temporary sibling of ``dest`` to build in, moved into place when the block ends, so
    a concurrent or interrupted build never leaves a half-written folder; removed instead
    when the block raises, or when ``keep()`` says the folder now at ``dest`` stays."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{task}.", dir=dest.parent))
    try:
        yield tmp
        if dest.exists():
            if keep():
                shutil.rmtree(tmp)
                return
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def build_all(out: Path, seed: int = 0, tasks: Sequence[str] = TASKS, force: bool = False) -> None:
    """Build every task in ``tasks`` under ``out``."""
    for task in tasks:
        build_task(out, task, seed, force=force)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder to write <task>/ into")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument(
        "--tasks",
        default=",".join(TASKS),
        help=f"comma-separated subset of {','.join(TASKS)} (default: all)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args(argv)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        parser.error(f"unknown task(s) {', '.join(unknown)}; expected {', '.join(TASKS)}")
    if args.seed < 0:
        parser.error("--seed must be >= 0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    build_all(args.out, args.seed, tasks, force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())

