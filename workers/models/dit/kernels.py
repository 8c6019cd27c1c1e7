"""The DiT's attention as a swappable kernel: Wan's and Qwen-Image's attention processors
with the attention call itself left to an :data:`AttentionKernel` (``(B, S, H, D)`` query, key,
value -> output), and :func:`install_kernel_processors`, which puts them into a DiT.

The processors compute exactly what diffusers' ``WanAttnProcessor`` and
``QwenDoubleStreamAttnProcessor2_0`` compute around the attention call (projections, norms,
RoPE, the joint text/image split), so with :func:`sdpa_kernel` the DiT's output is
bit-identical to diffusers'. The quantised backends (``fp8_cudnn``, ``sage2``, and
sageattention 1.x's ``sage_attn``) are kernels for them; the backend dispatch is
:mod:`workers.models.dit.attention`, which imports this module as the kernels do: nothing here
imports a backend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from contracts.errors import ModelLoadError

__all__ = [
    "AttentionKernel",
    "KernelAttnProcessor",
    "KernelQwenAttnProcessor",
    "KernelWanAttnProcessor",
    "install_kernel_processors",
    "sdpa_kernel",
]

# (B, S, H, D) query, key, value -> (B, S, H, D) output; no mask, default softmax scale.
AttentionKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


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
