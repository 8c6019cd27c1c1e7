"""The DiT's speed options: FP8 linear layers (torchao) and the compile cache.

FP8 linear layers (``transformer.linear: "fp8"``): every ``nn.Linear`` inside the DiT's
repeated blocks (attention projections, feed-forward) becomes an FP8 matmul with rowwise
weight scales and rowwise *dynamic* activation scales (torchao's
``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``, the configuration
peers ship for these models). Eager, the activation quantisation is a separate pass and
costs more than the FP8 matmul saves (measured on an H200, Wan2.1-14B: 3.39 s per forward
against 3.26 s bf16); compiled, Inductor fuses it into the neighbouring kernels (1.91 s with
the FP8 attention too). So the option is meant with ``compile``.

Left in their dtype, as the model classes intend: the patch embedding and the condition
embedders (timestep, text, image: small, and their inputs are not activations of the
trained range), every norm (fp32 by design in Wan), the modulation tables and layers
(Wan's ``scale_shift_table``, Qwen's ``img_mod`` / ``txt_mod``: they scale every token of a
block and an error there is an error everywhere), and the final projection ``proj_out``
(the velocity itself). :func:`fp8_linear_targets` is the list, tested on CPU.

Also left in bf16: Qwen-Image's text stream (``txt_mlp`` and the attention's ``add_*_proj``
/ ``to_add_out``). Its rows are the prompt's tokens, as few as the prompt is short, and
cuBLASLt has no rowwise-scaled FP8 algorithm for a few rows against a long inner dimension:
``torch._scaled_mm`` raises CUBLAS_STATUS_NOT_SUPPORTED (measured on an H200, torch 2.11 /
CUDA 13.0: ``txt_mlp``'s 12288 -> 3072 projection fails for up to 42 rows). It is a few
per cent of a forward's matmul work. The image / video stream's rows are checked per
request (:func:`check_fp8_rows`).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

import torch

from contracts.errors import InvalidRequestError, ModelLoadError

__all__ = ["FP8_MIN_TOKENS", "PROMPT_ROW_LAYERS", "apply_fp8_linear", "check_fp8_linear",
           "check_fp8_rows", "configure_compile_cache", "fp8_linear_targets",
           "prompt_row_layers", "quantize_fp8"]

log = logging.getLogger(__name__)

_MIN_CAPABILITY = (8, 9)
"""FP8 tensor cores: Ada (8.9) and Hopper (9.0) onwards."""
_MODULATION = ("img_mod", "txt_mod", "norm", "modulation")
"""Names of the layers inside a block that produce modulation (scale / shift / gate)."""
_ALIGN = 16
"""torch._scaled_mm needs both matrix dimensions to be multiples of 16."""
PROMPT_ROW_LAYERS = {
    "QwenImageTransformerBlock": ("txt_mlp", "add_q_proj", "add_k_proj", "add_v_proj",
                                  "to_add_out"),
}
"""Per block class: the layers whose rows are the prompt's tokens (left in bf16)."""
FP8_MIN_TOKENS = 256
"""Fewest image / video tokens a request may give FP8 linear layers. cuBLASLt's FP8
rowwise matmul fails (CUBLAS_STATUS_NOT_SUPPORTED) for few rows at a long inner dimension;
measured on an H200 (torch 2.11, CUDA 13.0), for batch 1 and 2: up to 42 rows at 12288 -> 3072
(Qwen-Image), 25 at 13824 -> 5120 (Wan2.1-14B), 84 at 8960 -> 1536 (Wan2.1-1.3B), none at
3072 -> 12288 (``python -m scripts.bench.bench_dit rows`` measures it on the GPU at hand).
256 is three times the worst, and smaller than any published geometry."""


def _block_linears(model: Any) -> list[tuple[str, str, torch.nn.Linear, tuple[str, ...]]]:
    """Every linear layer inside the model's repeated blocks (diffusers'
    ``_repeated_blocks``): its block's qualified name, its name inside the block, the layer,
    and the block's :data:`PROMPT_ROW_LAYERS`."""
    blocks = set(getattr(model, "_repeated_blocks", ()) or ())
    if not blocks:
        raise ModelLoadError(f"{type(model).__name__} declares no repeated blocks for FP8")
    out: list[tuple[str, str, torch.nn.Linear, tuple[str, ...]]] = []
    for block_name, block in model.named_modules():
        if type(block).__name__ not in blocks:
            continue
        prompt_rows = PROMPT_ROW_LAYERS.get(type(block).__name__, ())
        for name, module in block.named_modules():
            if isinstance(module, torch.nn.Linear):
                out.append((block_name, name, module, prompt_rows))
    return out


def _fp8_targets_by_block(model: Any) -> dict[str, list[str]]:
    """:func:`fp8_linear_targets` by block, in model order: the block's qualified name ->
    the layers' names inside it."""
    out: dict[str, list[str]] = {}
    for block_name, name, module, prompt_rows in _block_linears(model):
        if not any(part in name for part in _MODULATION + prompt_rows) \
                and not module.in_features % _ALIGN and not module.out_features % _ALIGN:
            out.setdefault(block_name, []).append(name)
    return out


def fp8_linear_targets(model: Any) -> list[str]:
    """Qualified names of the linear layers :func:`apply_fp8_linear` converts: those inside
    the model's repeated blocks, minus modulation layers, the layers whose rows are the
    prompt's tokens (:func:`prompt_row_layers`) and layers whose sizes FP8 matmuls cannot
    take."""
    return [f"{block}.{name}" for block, names in _fp8_targets_by_block(model).items()
            for name in names]


def prompt_row_layers(model: Any) -> list[str]:
    """Qualified names of the block linear layers left in bf16 because their rows are the
    prompt's tokens (:data:`PROMPT_ROW_LAYERS`)."""
    return [f"{block}.{name}" for block, name, _, prompt_rows in _block_linears(model)
            if any(part in name for part in prompt_rows)]


def quantize_fp8(module: torch.nn.Module, chosen: Any = None) -> None:
    """torchao float8 with rowwise weight scales and rowwise dynamic activation scales, in
    place, on the linear layers of ``module`` that ``chosen(layer, fqn)`` picks (None: all):
    the one configuration the stage and ``bench_dit rows`` use."""
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        PerRow,
        quantize_,
    )

    quantize_(module, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()),
              filter_fn=chosen)


def check_fp8_rows(task: str, tokens: int) -> None:
    """Refuse a request whose image / video stream is too short for FP8 matmuls
    (:data:`FP8_MIN_TOKENS`), before its first step, naming the size and what to do."""
    if tokens < FP8_MIN_TOKENS:
        raise InvalidRequestError(
            f"{task} request is too small for transformer.linear 'fp8': {tokens} latent "
            f"tokens, FP8 matmuls need at least {FP8_MIN_TOKENS} (a larger height/width/"
            "num_frames, or a worker with linear 'dtype')"
        )


def check_fp8_device(device: torch.device, option: str, minimum: tuple[int, int], gpus: str,
                     instead: str, package: str, install: str) -> None:
    """Refuse (at load, saying what to do) a device or install the FP8 ``option`` cannot use:
    a CUDA GPU of compute capability ``minimum`` or newer (``gpus`` names them), with
    ``package`` importable (``install`` says how); ``instead`` is the option to use else."""
    need = f"{minimum[0]}.{minimum[1]}"
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ModelLoadError(
            f"{option} needs a CUDA GPU of compute capability {need} or newer ({gpus}); this "
            f"stage runs on {device}. {instead}"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < minimum:
        raise ModelLoadError(
            f"{option} needs compute capability {need} or newer; "
            f"{torch.cuda.get_device_name(device)} ({device}) has "
            f"{capability[0]}.{capability[1]}. {instead}"
        )
    if importlib.util.find_spec(package) is None:
        raise ModelLoadError(
            f"{option} needs {install} (the offline bundle's `fp8` extra carries it)"
        )


def check_fp8_linear(device: torch.device) -> None:
    """Refuse (at load) a device or install FP8 matmuls cannot use, saying what to do."""
    check_fp8_device(device, "transformer.linear 'fp8'", _MIN_CAPABILITY, "Ada, Hopper",
                     "Use linear 'dtype'.", "torchao", "torchao: pip install torchao==0.18.0")


def apply_fp8_linear(model: Any, device: torch.device) -> int:
    """Convert :func:`fp8_linear_targets` to torchao float8 (rowwise, dynamic activations)
    in place, on ``device``; returns how many layers were converted.

    The model may still be on the host: its repeated blocks are moved to ``device`` and
    converted one block at a time, so the full-precision DiT is never whole on the device
    (Wan2.1-14B: 26.6 GiB in bf16 against 13.4 GiB converted; whole, it could not load
    under a 24 GiB budget). What stays outside the blocks follows with the caller's
    ``model.to(device)``. Each layer is converted from the same values on the same device
    as a whole-model conversion would, so the FP8 weights are the same."""
    check_fp8_linear(device)
    by_block = _fp8_targets_by_block(model)
    for block_name, names in by_block.items():
        block = model.get_submodule(block_name)
        block.to(device)
        targets = set(names)

        def chosen(_module: torch.nn.Module, fqn: str, targets: set[str] = targets) -> bool:
            return fqn in targets

        quantize_fp8(block, chosen)
    count = sum(len(names) for names in by_block.values())
    log.info("FP8 linear layers: %d of the DiT's linear layers converted", count)
    return count


def configure_compile_cache(folder: str | Path) -> Path:
    """Point torch's compile caches at ``folder`` (created if missing) and make sure they
    are on, so that a second start of a worker finds the first start's compiled graphs
    (Inductor's FX graph cache, AOTAutograd's cache, Triton's kernels).

    Torch reads the folder from ``TORCHINDUCTOR_CACHE_DIR`` / ``TRITON_CACHE_DIR`` when it
    first compiles, and offers no other switch for its local cache: setting them here, from
    the stage's config, before the first compile, is the one place they are set.
    """
    path = Path(folder).expanduser().resolve()
    try:
        (path / "triton").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelLoadError(f"compile_cache_dir {path} cannot be created: {exc}") from exc
    if not os.access(path, os.W_OK):
        raise ModelLoadError(f"compile_cache_dir {path} is not writable")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    os.environ["TRITON_CACHE_DIR"] = str(path / "triton")
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    return path
