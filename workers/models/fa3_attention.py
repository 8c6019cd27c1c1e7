"""FlashAttention-3's FP8 forward for the DiT stage (attention backend ``fa3_fp8``; lossy).

What it computes: the key mean over the sequence is subtracted from every key and the value
mean from every value (added back to the output: softmax ignores a per-query shift and every
output row is a convex combination of values), Q, K and V are quantised to FP8 e4m3 with one
scale per (batch, head), and FlashAttention-3's Hopper kernel (``hopper/`` of the
flash-attention repository, built for sm_90a) computes softmax(Q K^T / sqrt(d)) V from them
with FP32 accumulation and a bf16 output. The quantisation is plain torch, which
``torch.compile`` fuses into the neighbouring kernels; the kernel call is a custom op with a
fake implementation so the compiled DiT stays one graph.

Only self-attention of at least :data:`FA3_MIN_TOKENS` tokens goes to it; the rest stays on
SDPA, exact. Measured on an H200 (BENCHMARKS.md, "Attention at Hopper's 8-bit rate"): 24.2 ms
for Wan2.1-14B's (1, 40, 32760, 128), 1.56x bf16 cuDNN, 6.2 % off float32 on random inputs.
The offline bundle does not carry it (its source is the flash-attention repository plus
CUTLASS, built by hand as that section shows); ``sage2`` is the packaged backend.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from contracts.errors import ModelLoadError

__all__ = ["FA3_MIN_TOKENS", "check_fa3_attention", "fa3_fp8_attention", "fa3_kernel"]

FA3_MIN_TOKENS = 16384
"""Shortest self-attention that goes to the kernel; shorter ones stay on SDPA (the
``fp8_cudnn`` threshold: Qwen-Image's lengths were not measured with this kernel)."""
_E4M3_MAX = 448.0


def check_fa3_attention(device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    """Refuse, at load and saying what to do, what the built kernel cannot run."""
    option = "attention backend 'fa3_fp8'"
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ModelLoadError(f"{option} needs a Hopper GPU; this stage runs on {device}")
    if torch.cuda.get_device_capability(device) != (9, 0):
        raise ModelLoadError(f"{option} runs on Hopper GPUs (compute capability 9.0) only")
    if dtype != torch.bfloat16 or head_dim != 128:
        raise ModelLoadError(f"{option} is built for bfloat16 and head size 128")
    if importlib.util.find_spec("flash_attn_3") is None:
        raise ModelLoadError(
            f"{option} needs FlashAttention-3 (package flash_attn_3), which is not installed "
            "and which the offline bundle does not carry: build the flash-attention "
            "repository's hopper/ folder on this node (BENCHMARKS.md, \"Attention at Hopper's "
            "8-bit rate\", gives the command), or use attention_backend 'sage2'")


def _fa3_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, descale_q: torch.Tensor,
                 descale_k: torch.Tensor, descale_v: torch.Tensor) -> torch.Tensor:
    """FlashAttention-3's own forward (the tests stand SDPA in for it)."""
    import flash_attn_3._C  # noqa: F401  (registers torch.ops.flash_attn_3)

    out = torch.ops.flash_attn_3.fwd(
        q, k, v, q_descale=descale_q, k_descale=descale_k, v_descale=descale_v,
        softmax_scale=q.shape[-1] ** -0.5, is_causal=False, num_splits=1)
    result: torch.Tensor = out[0]
    return result


@torch.library.custom_op("diffring::fa3_fp8", mutates_args=())
def _fa3_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, descale_q: torch.Tensor,
             descale_k: torch.Tensor, descale_v: torch.Tensor) -> torch.Tensor:
    """FlashAttention-3 on FP8 (B, S, H, D) tensors with (B, H) descales; bf16 output."""
    return _fa3_forward(q, k, v, descale_q, descale_k, descale_v)


@_fa3_fp8.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
    return torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 with one scale per (batch, head): (x8, descale of shape (B, H))."""
    amax = x.abs().amax(dim=(1, 3)).float().clamp(min=1e-12)
    scale = _E4M3_MAX / amax
    x8 = (x.float() * scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return x8, torch.reciprocal(scale)


def fa3_fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of (B, S, H, D) tensors (see the module doc)."""
    if k.shape[1] != q.shape[1] or q.shape[1] < FA3_MIN_TOKENS:
        from .attention import sdpa_kernel

        return sdpa_kernel(q, k, v)
    k = k - k.mean(dim=1, keepdim=True)
    v_mean = v.mean(dim=1, keepdim=True)
    v = v - v_mean
    q8, dq = _quantize(q)
    k8, dk = _quantize(k)
    v8, dv = _quantize(v)
    out = _fa3_fp8(q8, k8, v8, dq, dk, dv)
    return (out.float() + v_mean.float()).to(q.dtype)


def fa3_kernel() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """:func:`fa3_fp8_attention` for the kernel attention processors."""
    return fa3_fp8_attention
