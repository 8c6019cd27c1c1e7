"""Attention backends of the DiT stage: ``sdpa`` (default), ``sdpa_cudnn``, ``sdpa_flash``,
``flash_attn``, ``sage_attn``, ``fp8_cudnn``, ``sage2``.

* ``fp8_cudnn`` (lossy, Hopper and newer): the self-attention through cuDNN's FP8 graph
  (:mod:`workers.models.dit.fp8_attention`) in the kernel processors below; cross-attention
  stays on SDPA.
* ``sage2`` (lossy, Hopper only): the self-attention through SageAttention2's sm90 kernel
  (INT8 QK, FP8 PV; :mod:`workers.models.dit.sage2_attention`), built from source on the node by
  the offline bundle, in the same kernel processors.

* ``sdpa``, ``sdpa_cudnn``, ``sdpa_flash`` and ``flash_attn`` go through diffusers' own
  attention dispatch (``ModelMixin.set_attention_backend``): "native" is torch SDPA with
  torch's choice of kernel, "_native_cudnn" / "_native_flash" pin SDPA to its cuDNN /
  FlashAttention-2 kernel (CUDA, bf16 only), "flash" is the flash-attn 2 package.
* ``sage_attn`` uses diffusers' "sage" backend when sageattention >= 2.1.1 is installed. PyPI
  only has 1.0.6 (Triton kernels, INT8 QK / FP16 PV), which diffusers refuses; for it this
  module installs its own attention processors for the two DiTs we serve. They compute
  exactly what diffusers' ``WanAttnProcessor`` and ``QwenDoubleStreamAttnProcessor2_0``
  compute, except that the softmax(QK^T)V core is a pluggable *kernel*. The tests run these
  processors on CPU with an SDPA kernel and check that the DiT output is bit-identical to
  diffusers' processors.

A missing package or an unusable device/dtype is reported at ``load()`` time with the
package to install, never at the first request.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import torch

from contracts.errors import ModelLoadError
from contracts.pipelines import ATTENTION_BACKENDS

from ..components import check_backend_name
from .kernels import (
    AttentionKernel,
    KernelAttnProcessor,
    KernelQwenAttnProcessor,
    KernelWanAttnProcessor,
    install_kernel_processors,
    sdpa_kernel,
)

logger = logging.getLogger(__name__)

__all__ = [
    "ATTENTION_BACKENDS",
    "KernelAttnProcessor",
    "KernelQwenAttnProcessor",
    "KernelWanAttnProcessor",
    "apply_attention_backend",
    "install_kernel_processors",
    "sage_kernel",
    "sdpa_kernel",
]

# torch SDPA pinned to one of its kernels (diffusers' backend names).
_PINNED_SDPA = {"sdpa_cudnn": "_native_cudnn", "sdpa_flash": "_native_flash"}
# sageattention 1.x has Triton kernels for these head sizes only.
_SAGE_HEAD_DIMS = (64, 96, 128)
# Key block of sageattention 1.x's kernel, and the first release diffusers' backend accepts.
_SAGE1_BLOCK_N = 64
_SAGE_DIFFUSERS_MIN = (2, 1, 1)


def _require_package(module: str, pip_name: str, backend: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ModelLoadError(
            f"attention backend {backend!r} needs the {pip_name!r} package, which is not "
            f"installed: pip install {pip_name}"
        )


def _require_cuda_half(device: torch.device, dtype: torch.dtype, backend: str) -> None:
    if device.type != "cuda":
        raise ModelLoadError(
            f"attention backend {backend!r} runs on CUDA devices only, not {device}"
        )
    if dtype not in (torch.float16, torch.bfloat16):
        raise ModelLoadError(
            f"attention backend {backend!r} needs dtype bfloat16, got {str(dtype).split('.')[-1]}"
        )


def _quiet_set_backend(model: Any, name: str) -> None:
    # diffusers logs an "experimental feature" warning on every call; once per worker is noise.
    dlog = logging.getLogger("diffusers.models.modeling_utils")
    level = dlog.level
    dlog.setLevel(logging.ERROR)
    try:
        model.set_attention_backend(name)
    finally:
        dlog.setLevel(level)


def apply_attention_backend(
    model: Any, backend: str, device: torch.device, dtype: torch.dtype, head_dim: int,
    fallback: str | None = None,
) -> str:
    """Switch every attention module of a loaded DiT to ``backend`` and return it; where
    ``backend`` cannot run here (its package or a CUDA GPU missing, a head size it lacks),
    to ``fallback`` with a warning (None: the error)."""
    try:
        _apply(model, backend, device, dtype, head_dim)
        return backend
    except ModelLoadError as exc:
        if fallback is None or fallback == backend:
            raise
        logger.warning("attention backend %r cannot run here (%s); running %r instead "
                       "(attention_fallback)", backend, exc, fallback)
    _apply(model, fallback, device, dtype, head_dim)
    return fallback


def _apply(model: Any, backend: str, device: torch.device, dtype: torch.dtype,
           head_dim: int) -> None:
    check_backend_name(backend)
    if backend == "sdpa":
        # Explicit, so a DIFFUSERS_ATTN_BACKEND in the environment cannot change the kernel.
        _quiet_set_backend(model, "native")
        return
    if backend in _PINNED_SDPA:
        _require_cuda_half(device, dtype, backend)
        _quiet_set_backend(model, _PINNED_SDPA[backend])
        return
    if backend == "fp8_cudnn":
        from .fp8_attention import check_fp8_attention, cudnn_fp8_kernel

        check_fp8_attention(device)
        if dtype != torch.bfloat16:
            raise ModelLoadError("attention backend 'fp8_cudnn' needs dtype bfloat16")
        install_kernel_processors(model, cudnn_fp8_kernel())
        return
    if backend == "sage2":
        from .sage2_attention import check_sage2_attention, sage2_kernel

        check_sage2_attention(device, dtype, head_dim)
        install_kernel_processors(model, sage2_kernel())
        return
    if backend == "flash_attn":
        _require_package("flash_attn", "flash-attn", backend)
        _require_cuda_half(device, dtype, backend)
        try:
            _quiet_set_backend(model, "flash")
        except (RuntimeError, ValueError) as e:  # e.g. flash-attn too old for diffusers
            raise ModelLoadError(f"attention backend 'flash_attn' is not usable: {e}") from e
        return
    # sage_attn
    _require_package("sageattention", "sageattention", backend)
    _require_cuda_half(device, dtype, backend)
    if head_dim not in _SAGE_HEAD_DIMS:
        raise ModelLoadError(
            f"attention backend 'sage_attn' supports head sizes {_SAGE_HEAD_DIMS}; this DiT "
            f"has {head_dim}"
        )
    if _sage_version() >= _SAGE_DIFFUSERS_MIN:
        try:
            _quiet_set_backend(model, "sage")
        except (RuntimeError, ValueError) as e:
            raise ModelLoadError(f"attention backend 'sage_attn' is not usable: {e}") from e
        return
    install_kernel_processors(model, sage_kernel())


def _sage_version() -> tuple[int, ...]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        text = version("sageattention")
    except PackageNotFoundError:
        return (0,)
    parts: list[int] = []
    for piece in text.split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def sage_kernel() -> AttentionKernel:
    """sageattention 1.x's ``sageattn`` as an :data:`AttentionKernel`.

    Its Triton kernel does not mask the partial last block of keys: when the key length is
    not a multiple of 64, the missing keys join the softmax with score 0 and dilute every
    output (measured on an H200 against SDPA: 13% relative error with 257 keys, 62% with 17,
    against 1.3% for whole blocks). Such calls go to SDPA instead. This makes sage a partial
    speed-up with 1.x (e.g. Wan 480p's 32760-token self-attention is not a whole number of
    blocks); sageattention >= 2.1.1 goes through diffusers' backend and has no such limit.
    Measured on an H200, 1.0.6 was also slower than torch SDPA for whole blocks (15.6 vs
    9.6 ms for 32768 tokens, 12 heads of 128, bf16): it is here for GPUs and builds where it
    pays, not as a default.
    """
    from sageattention import sageattn

    def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if k.shape[1] % _SAGE1_BLOCK_N:
            return sdpa_kernel(q, k, v)
        # sageattn subtracts the key mean from k in place ("smooth_k"); the processors below
        # build k fresh for each call and never read it afterwards, so no copy is needed.
        out: torch.Tensor = sageattn(q, k, v, tensor_layout="NHD", is_causal=False)
        return out

    return kernel
