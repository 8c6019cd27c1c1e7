"""What a stage holds on its GPU: weight storage, offload, the budget, and what was used.

* :class:`Placement`: where and how a stage's models live (device, compute dtype, and the
  stage's :class:`contracts.stage_options.StageOptions`); :func:`place` applies it to one
  loaded model with diffusers' own hooks: layerwise casting for FP8 storage
  (``ModelMixin.enable_layerwise_casting``; for transformers models the same hook through
  ``diffusers.hooks.apply_layerwise_casting``) and group offloading
  (``ModelMixin.enable_group_offload`` / ``diffusers.hooks.apply_group_offloading``).
* :func:`estimate_weights` reads the safetensors headers of the components a stage loads
  (no weights are read) and says how many bytes each option would keep on the GPU;
  :func:`check_budget` refuses a stage that cannot fit ``max_vram_gb``, naming the estimate,
  the budget and the options that would fit.
* :class:`MemoryWatch`: resident bytes after load and the peak of each request, from
  torch's allocator (what the worker reports).
"""

from __future__ import annotations

import contextlib
import json
import re
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from contracts.errors import ModelLoadError, StageError
from contracts.stage_options import StageOptions

__all__ = [
    "MemoryWatch",
    "Placement",
    "WeightEstimate",
    "check_budget",
    "estimate_weights",
    "oom_guard",
    "place",
]

GIB = 1 << 30
# Layers whose weights layerwise casting leaves in the compute dtype: diffusers' default
# skip list (embeddings, norms, the input/output projections) plus what the text and image
# encoders call their embeddings.
_SKIP_CAST = ("pos_embed", "patch_embed", "norm", "^proj_in$", "^proj_out$", "embed",
              "shared", "lm_head")
_BLOCK = re.compile(r"(?:^|\.)(?:blocks|transformer_blocks|layers|block|down_blocks|"
                    r"up_blocks|mid_block)\.(\d+)\.")


@dataclass(frozen=True)
class Placement:
    """Device, compute dtype and memory options of one stage's models."""

    device: torch.device
    dtype: torch.dtype
    options: StageOptions = field(default_factory=StageOptions)
    before: Callable[[Any], None] | None = None
    """Work on a loaded model before its options are applied (the DiT's fused adapters,
    merged into the weights before FP8 storage or offload see them)."""
    resident: Callable[[Any], None] | None = None
    """Moves part of a model onto the device in its own way before the rest follows (the
    DiT's FP8 linear layers, converted one block at a time on the device: the
    full-precision model is never whole there)."""

    @property
    def load_device(self) -> torch.device:
        """Where a model is built: the host when it will be offloaded or cast (its GPU copy
        is then made by the hooks, never a full-precision one)."""
        if self.options.offload != "none" or self.options.weight_storage != "dtype":
            return torch.device("cpu")
        return self.device


def _is_diffusers(model: Any) -> bool:
    from diffusers import ModelMixin

    return isinstance(model, ModelMixin)


def place(model: Any, placement: Placement) -> Any:
    """Apply FP8 storage and offload to a model built on ``placement.load_device``, then put
    what stays resident on the stage's device. With every option off: ``model.to(device)``."""
    if placement.before is not None:
        placement.before(model)
    opts = placement.options
    if opts.weight_storage == "fp8":
        if _is_diffusers(model):
            model.enable_layerwise_casting(
                storage_dtype=torch.float8_e4m3fn, compute_dtype=placement.dtype
            )
        else:
            from diffusers.hooks import apply_layerwise_casting

            apply_layerwise_casting(
                model, storage_dtype=torch.float8_e4m3fn, compute_dtype=placement.dtype,
                skip_modules_pattern=_SKIP_CAST,
            )
    if opts.offload == "none":
        if placement.resident is not None:
            placement.resident(model)
        return model.to(placement.device)
    kwargs: dict[str, Any] = {
        "onload_device": placement.device,
        "offload_device": torch.device("cpu"),
        "offload_type": f"{opts.offload}_level",
        # A copy stream moves the next group in while this one computes (CUDA only).
        "use_stream": placement.device.type == "cuda",
    }
    if opts.offload == "block":
        kwargs["num_blocks_per_group"] = opts.offload_blocks
    try:
        if _is_diffusers(model):
            model.enable_group_offload(**kwargs)
        else:
            from diffusers.hooks import apply_group_offloading

            apply_group_offloading(model, **kwargs)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ModelLoadError(
            f"offload {opts.offload!r} is not possible for {type(model).__name__}: {exc}"
        ) from exc
    return model


# -- estimates -------------------------------------------------------------------------

_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
                      "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def _safetensors_header(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header: dict[str, Any] = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def _tensors(folder: Path) -> Iterator[tuple[str, int, int]]:
    """(name, number of elements, ndim) of every tensor of a component, from its headers (a
    view's component: the safetensors files its weights come from)."""
    from .layouts import source_of

    source = source_of(folder)
    files = (sorted(folder.glob("*.safetensors")) if source is None else
             [Path(f) for f in source["files"] if f.endswith(".safetensors")])
    for file in files:
        for name, info in _safetensors_header(file).items():
            n = 1
            for d in info["shape"]:
                n *= int(d)
            yield name, n, len(info["shape"])


@dataclass(frozen=True)
class WeightEstimate:
    """Bytes of one stage's weights on its GPU under each option."""

    full: int
    """Weights in the stage's dtype."""
    fp8: int
    """With FP8 storage (linear and conv weights in one byte; the rest as they are)."""
    offload_resident: int
    """With block offload of one block per group: what never leaves the GPU plus two
    groups (the one computing, the one arriving)."""
    offload_resident_fp8: int
    """Both."""

    def bytes_for(self, opts: StageOptions) -> int:
        fp8 = opts.weight_storage == "fp8" or opts.linear == "fp8"
        if opts.offload == "none":
            return self.fp8 if fp8 else self.full
        return self.offload_resident_fp8 if fp8 else self.offload_resident


def estimate_weights(folders: Iterable[Path], element_bytes: int) -> WeightEstimate:
    """Read the components' safetensors headers (no weights) into a :class:`WeightEstimate`.
    A component without safetensors files counts as nothing (it is small: tokenizers,
    schedulers, or configs the stage only reads)."""
    full = fp8 = 0
    blocks: dict[tuple[str, str], list[int]] = {}
    for folder in folders:
        for name, n, ndim in _tensors(folder):
            b = n * element_bytes
            castable = ndim >= 2 and not any(re.search(p, name) for p in _SKIP_CAST)
            b8 = n if castable else b
            full += b
            fp8 += b8
            m = _BLOCK.search(name)
            if m:
                key = (folder.name + ":" + name[: m.start(1)], m.group(1))
                acc = blocks.setdefault(key, [0, 0])
                acc[0] += b
                acc[1] += b8
    in_blocks = sum(v[0] for v in blocks.values())
    in_blocks8 = sum(v[1] for v in blocks.values())
    largest = max((v[0] for v in blocks.values()), default=0)
    largest8 = max((v[1] for v in blocks.values()), default=0)
    return WeightEstimate(
        full=full,
        fp8=fp8,
        offload_resident=full - in_blocks + 2 * largest,
        offload_resident_fp8=fp8 - in_blocks8 + 2 * largest8,
    )


def check_budget(
    stage: str, opts: StageOptions, weights: WeightEstimate, working_bytes: int,
) -> int:
    """The stage's estimated peak (weights under ``opts`` + ``working_bytes`` of
    activations and workspace); refuses a ``max_vram_gb`` it cannot fit, naming the
    options that would. Returns the estimate in bytes."""
    need = weights.bytes_for(opts) + working_bytes
    if opts.max_vram_gb is None:
        return need
    budget = int(opts.max_vram_gb * GIB)
    if need <= budget:
        return need
    fits = []
    for storage, offload in (("fp8", "none"), ("dtype", "block"), ("fp8", "block")):
        if storage == "fp8" and opts.linear == "fp8" and offload != "none":
            continue
        trial = StageOptions(weight_storage=storage if opts.linear != "fp8" else "dtype",
                             offload=offload, linear=opts.linear if offload == "none"
                             else "dtype")
        est = weights.bytes_for(trial) + working_bytes
        if est <= budget:
            fits.append(f"weight_storage={trial.weight_storage!r} offload={offload!r} "
                        f"(~{est / GIB:.1f} GiB)")
    hint = ("; options that would fit: " + ", ".join(fits)) if fits else (
        "; no weight storage or offload option fits: raise max_vram_gb or use a larger GPU")
    raise ModelLoadError(
        f"{stage} stage needs about {need / GIB:.1f} GiB of GPU memory (weights "
        f"{weights.bytes_for(opts) / GIB:.1f} GiB + working memory {working_bytes / GIB:.1f}"
        f" GiB) but max_vram_gb is {opts.max_vram_gb:g}{hint}"
    )


def apply_budget(device: torch.device, opts: StageOptions) -> None:
    """Cap this process's allocations on ``device`` at ``max_vram_gb`` (torch's per-process
    memory fraction): what the stage was promised is all it can take."""
    if opts.max_vram_gb is None or device.type != "cuda":
        return
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, opts.max_vram_gb * GIB / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)


# -- what was used ---------------------------------------------------------------------


@dataclass
class MemoryWatch:
    """Resident and peak GPU memory of a stage (zeros on the CPU)."""

    device: torch.device
    resident_bytes: int = 0
    """Allocated after load (weights and whatever stays): what this stage holds idle."""
    last_peak_bytes: int = 0
    """Peak allocated during the last request."""
    max_peak_bytes: int = 0
    """Largest request peak seen."""

    def loaded(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.resident_bytes = torch.cuda.memory_allocated(self.device)

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        if self.device.type != "cuda":
            yield
            return
        torch.cuda.reset_peak_memory_stats(self.device)
        try:
            yield
        finally:
            self.last_peak_bytes = torch.cuda.max_memory_allocated(self.device)
            self.max_peak_bytes = max(self.max_peak_bytes, self.last_peak_bytes)

    def report(self) -> dict[str, float]:
        """The figures as a worker's heartbeat carries them to the controller's status."""
        return {"resident_bytes": float(self.resident_bytes),
                "last_peak_bytes": float(self.last_peak_bytes),
                "max_peak_bytes": float(self.max_peak_bytes)}


@contextlib.contextmanager
def oom_guard(stage: str, what: str, device: torch.device, opts: StageOptions) -> Iterator[None]:
    """Turn a GPU out-of-memory into a :class:`StageError` that names the request's size and
    the budget, after freeing what the attempt took, so the worker serves the next one."""
    try:
        yield
    except torch.OutOfMemoryError as exc:
        detail = str(exc).split("\n", 1)[0]
        del exc  # its traceback holds the attempt's tensors
        import gc

        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        budget = f"max_vram_gb {opts.max_vram_gb:g}" if opts.max_vram_gb else "the whole GPU"
        raise StageError(
            f"{stage} stage ran out of GPU memory on {what} ({budget}; weight_storage "
            f"{opts.weight_storage!r}, offload {opts.offload!r}): {detail}. Use a smaller "
            "resolution or fewer frames, or a memory option (weight_storage 'fp8', offload "
            "'block')"
        ) from None


def dit_working_bytes(cfg: dict[str, Any], output: str, budget_shapes: tuple[str, ...],
                      cfg_batch: bool, itemsize: int) -> int:
    """GPU memory a DiT stage needs beside its weights: the activations of one forward at
    the largest of ``budget_shapes`` (the worker's ``warmup_shapes``; none: 480x832x81 for
    video, 1024x1024 for images): per token ``hidden x 8 + ffn`` elements in the stage's
    dtype, times two for a batch-2 CFG forward, plus 0.5 GiB of workspace. Calibrated on an
    H200 (peak minus resident): Wan2.1-14B at 480x832x81 3.55 GiB measured, 3.84 GiB
    estimated; Qwen-Image at 1024x1024 0.39 GiB measured, 0.78 GiB estimated."""
    from contracts.pipelines import parse_shape

    hidden = int(cfg.get("num_attention_heads", 24)) * int(cfg.get("attention_head_dim", 128))
    ffn = int(cfg.get("ffn_dim") or 4 * hidden)
    shapes = budget_shapes or (("480x832x81",) if output == "video" else ("1024x1024",))
    tokens = 0
    for shape in shapes:
        dims = parse_shape(shape)
        frames = (dims[2] - 1) // 4 + 1 if len(dims) == 3 else 1
        tokens = max(tokens, frames * (dims[0] // 16) * (dims[1] // 16))
    batch = 2 if cfg_batch else 1
    return tokens * (hidden * 8 + ffn) * itemsize * batch + (1 << 29)
