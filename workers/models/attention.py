"""Attention backends of the DiT stage: ``sdpa`` (default), ``sdpa_cudnn``, ``sdpa_flash``,
``flash_attn``, ``sage_attn``, ``fp8_cudnn``.

* ``fp8_cudnn`` (lossy, Hopper and newer): the self-attention through cuDNN's FP8 graph
  (:mod:`workers.models.fp8_attention`) in the kernel processors below; cross-attention
  stays on SDPA.

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
from collections.abc import Callable
from typing import Any

import torch

from contracts.errors import ModelLoadError
from contracts.pipelines import ATTENTION_BACKENDS

from .components import check_backend_name

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

# (B, S, H, D) query, key, value -> (B, S, H, D) output; no mask, default softmax scale.
AttentionKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

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


def sdpa_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """torch SDPA with the same layout handling as diffusers' "native" backend; the reference
    kernel for testing the processors below."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
    )
    return out.permute(0, 2, 1, 3)


def install_kernel_processors(model: Any, kernel: AttentionKernel) -> int:
    """Replace the attention processors of a Wan or Qwen-Image DiT by kernel processors;
    returns how many were replaced."""
    from diffusers.models.transformers.transformer_qwenimage import (
        QwenDoubleStreamAttnProcessor2_0,
    )
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    replaced = 0
    for name, module in model.named_modules():
        processor = getattr(module, "processor", None)
        if processor is None or not hasattr(module, "set_processor"):
            continue
        new: Any
        if isinstance(processor, WanAttnProcessor | KernelWanAttnProcessor):
            new = KernelWanAttnProcessor(kernel)
        elif isinstance(processor, QwenDoubleStreamAttnProcessor2_0 | KernelQwenAttnProcessor):
            new = KernelQwenAttnProcessor(kernel)
        else:
            raise ModelLoadError(
                f"no kernel attention processor for {type(processor).__name__} (module {name})"
            )
        module.set_processor(new)
        replaced += 1
    if replaced == 0:
        raise ModelLoadError(f"{type(model).__name__} has no attention modules to switch")
    return replaced


def _rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's RoPE: rotate consecutive (even, odd) channel pairs. ``cos``/``sin`` hold each
    pair's angle twice; the even copy of cos and the odd copy of sin are used."""
    even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)
    c = cos[..., 0::2]
    s = sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * c - odd * s
    out[..., 1::2] = even * s + odd * c
    return out.type_as(x)


# Text context length of Wan2.1's I2V DiT: image tokens come first, then exactly 512 text
# tokens (diffusers hard-codes the same split).
_WAN_TEXT_CONTEXT = 512


class KernelAttnProcessor:
    """An attention processor of diffusers' that runs its attention through ``kernel``."""

    def __init__(self, kernel: AttentionKernel) -> None:
        self.kernel = kernel


class KernelWanAttnProcessor(KernelAttnProcessor):
    """Wan self/cross attention (incl. the I2V image branch) with a pluggable kernel."""

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        from diffusers.models.transformers.transformer_wan import (
            _get_added_kv_projections,
            _get_qkv_projections,
        )

        if attention_mask is not None:
            raise ValueError("Wan attention got an attention mask; kernels take none")
        image_context = None
        if attn.add_k_proj is not None:
            assert encoder_hidden_states is not None
            split = encoder_hidden_states.shape[1] - _WAN_TEXT_CONTEXT
            image_context = encoder_hidden_states[:, :split]
            encoder_hidden_states = encoder_hidden_states[:, split:]

        # None (self-attention) is what diffusers passes here too; its annotation is narrower.
        query, key, value = _get_qkv_projections(
            attn,
            hidden_states,
            encoder_hidden_states,  # type: ignore[arg-type]
        )
        query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query = _rope_interleaved(query, *rotary_emb)
            key = _rope_interleaved(key, *rotary_emb)

        image_out = None
        if image_context is not None:
            key_img, value_img = _get_added_kv_projections(attn, image_context)
            key_img = attn.norm_added_k(key_img).unflatten(2, (attn.heads, -1))
            value_img = value_img.unflatten(2, (attn.heads, -1))
            image_out = self.kernel(query, key_img, value_img).flatten(2, 3).type_as(query)

        out = self.kernel(query, key, value).flatten(2, 3).type_as(query)
        if image_out is not None:
            out = out + image_out
        out = attn.to_out[0](out)
        return attn.to_out[1](out)


class KernelQwenAttnProcessor(KernelAttnProcessor):
    """Qwen-Image joint (text + image stream) attention with a pluggable kernel.

    A text padding mask cannot go to a mask-less kernel; those (rare: batch > 1 with prompts
    of different lengths) calls use diffusers' default dispatch instead.
    """

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_hidden_states_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        from diffusers.models.transformers import transformer_qwenimage

        # Annotated as returning a pair upstream; with use_real=False it returns one tensor.
        rope: Any = transformer_qwenimage.apply_rotary_emb_qwen

        if encoder_hidden_states is None:
            raise ValueError("Qwen joint attention needs the text stream")
        if attention_mask is not None:
            raise ValueError("Qwen joint attention builds its own mask; pass none")

        head_dim = attn.inner_dim // attn.heads

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.unflatten(-1, (-1, head_dim))

        img_q, img_k, img_v = (
            heads(attn.to_q(hidden_states)),
            heads(attn.to_k(hidden_states)),
            heads(attn.to_v(hidden_states)),
        )
        txt_q, txt_k, txt_v = (
            heads(attn.add_q_proj(encoder_hidden_states)),
            heads(attn.add_k_proj(encoder_hidden_states)),
            heads(attn.add_v_proj(encoder_hidden_states)),
        )
        if attn.norm_q is not None:
            img_q = attn.norm_q(img_q)
        if attn.norm_k is not None:
            img_k = attn.norm_k(img_k)
        if attn.norm_added_q is not None:
            txt_q = attn.norm_added_q(txt_q)
        if attn.norm_added_k is not None:
            txt_k = attn.norm_added_k(txt_k)
        if image_rotary_emb is not None:
            img_freqs, txt_freqs = image_rotary_emb
            img_q = rope(img_q, img_freqs, use_real=False)
            img_k = rope(img_k, img_freqs, use_real=False)
            txt_q = rope(txt_q, txt_freqs, use_real=False)
            txt_k = rope(txt_k, txt_freqs, use_real=False)

        # Joint sequence: text tokens first, then image tokens.
        q = torch.cat([txt_q, img_q], dim=1)
        k = torch.cat([txt_k, img_k], dim=1)
        v = torch.cat([txt_v, img_v], dim=1)
        if encoder_hidden_states_mask is None:
            out = self.kernel(q, k, v)
        else:
            image_mask = torch.ones(
                hidden_states.shape[:2], dtype=torch.bool, device=hidden_states.device
            )
            mask = torch.cat([encoder_hidden_states_mask, image_mask], dim=1)[:, None, None, :]
            out = dispatch_attention_fn(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)
        out = out.flatten(2, 3).to(q.dtype)

        seq_txt = encoder_hidden_states.shape[1]
        img_out = attn.to_out[0](out[:, seq_txt:, :].contiguous())
        if len(attn.to_out) > 1:
            img_out = attn.to_out[1](img_out)
        txt_out = attn.to_add_out(out[:, :seq_txt, :].contiguous())
        return img_out, txt_out
