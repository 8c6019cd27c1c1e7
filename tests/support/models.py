"""The stage adapters on the tiny models, and what they are checked against: diffusers' own
pipelines on the same folders (with adapters or a step cache set up the way a diffusers user
writes it), small requests of each task, and what a transfer does to a tensor. The tiny
models themselves are the session fixture ``tiny_models`` (``tests/conftest.py``)."""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Tiny ops on a busy 2-core machine get hundreds of times slower with extra threads.
torch.set_num_threads(1)

from contracts.request import GenerationRequest  # noqa: E402  (after the thread setting)
from workers.models import (  # noqa: E402
    DecoderAdapter,
    EncoderAdapter,
    TransformerAdapter,
    get_family,
)

WAN22_TASKS = ("wan22_a14b_t2v", "wan22_a14b_i2v", "wan22_5b_t2v", "wan22_5b_i2v")
VIDEO_TASKS = ("wan_t2v", "wan_i2v", *WAN22_TASKS)
IMAGE_INPUT_TASKS = ("wan_i2v", "wan22_a14b_i2v", "wan22_5b_i2v", "qwen_i2i", "qwen_i2i_plus")
EDIT_TASKS = ("qwen_i2i", "qwen_i2i_plus")

# Small but not degenerate: 2x2 DiT patches over a 4x4 latent, 3 latent frames for Wan, CFG on.
# Wan2.2-A14B: its boundary falls inside the 3 steps (high, high, low: both experts run); the
# TI2V-5B VAE compresses 16 times, so 64x64 for the same latent.
_WAN = {"height": 32, "width": 32, "num_frames": 9, "infer_steps": 3, "fps": 8}
SMALL: dict[str, dict[str, Any]] = {
    "wan_t2v": _WAN,
    "wan_i2v": _WAN,
    "wan22_a14b_t2v": _WAN,
    "wan22_a14b_i2v": _WAN,
    "wan22_5b_t2v": {**_WAN, "height": 64, "width": 64},
    "wan22_5b_i2v": {**_WAN, "height": 64, "width": 64},
    "qwen_t2i": {"height": 32, "width": 48, "infer_steps": 3},
    "qwen_i2i": {"height": 32, "width": 32, "infer_steps": 2},
    "qwen_i2i_plus": {"height": 32, "width": 32, "infer_steps": 2},
}
PROMPT = "A red fox running through fresh snow"
NEGATIVE = "blurred details, low quality"
SEED = 1234


def small_request(task: str, **changes: Any) -> GenerationRequest:
    fields: dict[str, Any] = {
        "task": task,
        "prompt": PROMPT,
        "negative_prompt": NEGATIVE,
        "seed": SEED,
    }
    fields.update(SMALL[task])
    fields.update(changes)
    return GenerationRequest(**fields)


STAGES: dict[tuple[str, str, str], Any] = {}
"""Loaded stages by (kind, task, dtype), shared by the modules that run them (test_models.py
empties it when it is done)."""
ADAPTERS: dict[str, Any] = {
    "encoder": EncoderAdapter, "transformer": TransformerAdapter, "decoder": DecoderAdapter
}


def stage(kind: str, models: Path, task: str, dtype: str = "float32") -> Any:
    """Loaded stages, cached for the session (loading is the slow part of small tests)."""
    key = (kind, task, dtype)
    if key not in STAGES:
        obj = ADAPTERS[kind].for_task(models / task, task, device="cpu", dtype=dtype)
        obj.load()
        STAGES[key] = obj
    return STAGES[key]


def wire(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a transfer does: tensor -> (dtype, shape, raw bytes) -> a new tensor. bfloat16 has
    no numpy type, so the bytes are taken through a uint8 view."""
    out = {}
    for name, tensor in tensors.items():
        assert tensor.is_contiguous(), f"{name} is not contiguous"
        raw = tensor.detach().cpu().view(torch.uint8).numpy().tobytes()
        assert len(raw) == tensor.numel() * tensor.element_size()
        rebuilt = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        out[name] = rebuilt.view(tensor.dtype).reshape(tensor.shape)
        assert torch.equal(out[name], tensor.cpu())
    return out


def diffusers_reference(
    models: Path, req: GenerationRequest, image_png: bytes | list[bytes] | None, dtype: str,
    setup: Callable[[Any], None] | None = None, folder: Path | None = None,
) -> np.ndarray:
    """diffusers' own one-process pipeline on the same folder (``models / task``, or
    ``folder``), seed and sizes; a list of images goes to the pipeline as a list.
    ``setup(pipe)`` may change the pipeline first (load adapters, enable a cache)."""
    import diffusers
    from PIL import Image

    task = req.task
    folder = folder or models / task
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    extra: dict[str, Any] = {}
    if task in EDIT_TASKS:
        from workers.models.families.qwen_text import QwenEditProcessor

        extra["processor"] = QwenEditProcessor.from_pretrained(folder / "processor")
    pipeline_class = get_family(task).pipeline_class
    assert pipeline_class is not None
    pipe = getattr(diffusers, pipeline_class).from_pretrained(folder, dtype=torch_dtype, **extra)
    pipe.set_progress_bar_config(disable=True)
    if setup is not None:
        setup(pipe)
    kwargs: dict[str, Any] = {
        "prompt": req.prompt,
        "negative_prompt": req.negative_prompt,
        "height": req.height,
        "width": req.width,
        "num_inference_steps": req.infer_steps,
        "generator": torch.Generator("cpu").manual_seed(req.seed),
        "output_type": "np",
    }
    if isinstance(image_png, list):
        kwargs["image"] = [Image.open(io.BytesIO(i)).convert("RGB") for i in image_png]
    elif image_png is not None:
        kwargs["image"] = Image.open(io.BytesIO(image_png)).convert("RGB")
    if task in VIDEO_TASKS:
        kwargs.update(num_frames=req.num_frames, guidance_scale=req.guidance_scale)
        if req.guidance_scale_2 is not None:
            kwargs["guidance_scale_2"] = req.guidance_scale_2
        return np.asarray(pipe(**kwargs).frames[0])
    kwargs.update(true_cfg_scale=req.true_cfg_scale)
    return np.asarray(pipe(**kwargs).images[0])


def with_adapters(folder: Path, loras: list[tuple[str, float]]) -> Callable[[Any], None]:
    """A diffusers pipeline's set-up that loads ``loras`` (name, strength) from ``folder``."""

    def setup(pipe: Any) -> None:
        for name, _ in loras:
            pipe.load_lora_weights(str(folder / f"{name}.safetensors"), adapter_name=name)
        pipe.set_adapters([n for n, _ in loras], adapter_weights=[w for _, w in loras])

    return setup


def reference_cache(cache: dict[str, Any], steps: int) -> Callable[[Any], None]:
    """The same cache as a diffusers user writes it (not through the worker's builder)."""
    import diffusers.hooks as hooks

    params = {k: v for k, v in cache.items() if k != "kind"}
    if "taylor_factors_dtype" in params:
        params["taylor_factors_dtype"] = getattr(torch, params["taylor_factors_dtype"])
    for k, v in params.items():
        if k.endswith("_range") and isinstance(v, list):
            params[k] = tuple(v)

    def setup(pipe: Any) -> None:
        if cache["kind"] == "mag_cache":
            params.setdefault("num_inference_steps", steps)
        if cache["kind"] == "pyramid_attention_broadcast":
            params["current_timestep_callback"] = lambda: pipe.current_timestep
        cls = {"first_block_cache": hooks.FirstBlockCacheConfig,
               "mag_cache": hooks.MagCacheConfig,
               "taylorseer_cache": hooks.TaylorSeerCacheConfig,
               "pyramid_attention_broadcast": hooks.PyramidAttentionBroadcastConfig}
        pipe.transformer.enable_cache(cls[cache["kind"]](**params))

    return setup
