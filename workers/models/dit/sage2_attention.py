"""SageAttention2's Hopper kernel for the DiT stage (attention backend ``sage2``; lossy).

What it computes: softmax(Q K^T / sqrt(d)) V with Q and K in INT8 (one scale per thread's
slice of a 64-query / 128-key block, after the key mean over the sequence is subtracted:
softmax ignores a per-query constant shift) and P and V in FP8 e4m3 (V with one scale per
channel), accumulated in FP32 with a second FP32 buffer every few blocks (upstream's
``pv_accum_dtype="fp32+fp32"``). Upstream's ``sageattn_qk_int8_pv_fp8_cuda_sm90`` does the
quantisation (a Triton kernel for Q/K, a CUDA one for V) and the attention (wgmma, TMA),
built for ``sm_90a`` from SageAttention's public source by ``scripts/offline/build_sage2.py``
(PyPI has no SageAttention 2 wheel; the offline bundle's ``sage2`` extra carries the source).

Why this kernel: it is the one the peers run on Hopper (LightX2V's default), with INT8
rather than FP8 Q/K at a finer granularity than cuDNN's per-tensor FP8 graph
(``fp8_cudnn``). Measured on an H200 (BENCHMARKS.md, "Attention at Hopper's 8-bit rate"):
as fast as ``fp8_cudnn`` alone (28.0 ms against 27.7 ms for Wan2.1-14B's 480p
self-attention) with two thirds of its error (3.9 % against 5.9 % off float32); in an eager
Wan2.1-1.3B step 0.84x bf16 (``fp8_cudnn`` 0.89x), in the compiled Wan2.1-14B step with FP8
linear 1.04x ``fp8_cudnn``'s.

Which calls go to it: self-attention of at least :data:`SAGE2_MIN_TOKENS` tokens. Wan's
cross-attention to the 512 text tokens (and I2V's 257 image tokens) stays on SDPA, exact:
a few per cent of the work. The call is a ``torch.library`` custom op with a fake
implementation, so ``torch.compile`` keeps the DiT blocks in one graph around it.

The build carries one case of each of upstream's template switches (head size 128,
non-causal, per-thread granularity, no log-sum-exp, bf16): :func:`check_sage2_attention`
refuses anything else at load, so a request never meets an unsupported case.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from contracts.errors import ModelLoadError

__all__ = ["INSTALL_HINT", "SAGE2_MIN_TOKENS", "check_sage2_attention", "sage2_attention",
           "sage2_kernel"]

SAGE2_MIN_TOKENS = 16384
"""Shortest self-attention that goes to the kernel; shorter ones stay on SDPA. The
``fp8_cudnn`` threshold, whose quantisation passes cost more than they save below ~10k
tokens; to be set from this kernel's own row of ``bench_attn`` (Qwen-Image's 4,352 and
7,145 tokens are in it)."""
_CAPABILITY = (9, 0)
"""The kernel is built for sm_90a (wgmma, setmaxnreg): Hopper only, not later GPUs."""
_HEAD_DIM = 128
INSTALL_HINT = (
    "build it on this node from the offline bundle: on a machine with network, "
    "`bash scripts/offline/offline_bundle.sh --extras fp8,sage2 --out bundle/`, then here "
    "`bash bundle/install_offline.sh bundle/` (needs nvcc >= 12.3 of torch's CUDA major "
    "version; docs/offline.md)"
)
"""How to install the kernel, named in every refusal."""


def _kernel_installed() -> bool:
    """SageAttention with its sm90 extension (a PyPI 1.x install has none)."""
    if importlib.util.find_spec("sageattention") is None:
        return False
    try:
        return importlib.util.find_spec("sageattention._qattn_sm90") is not None
    except (ImportError, ValueError):  # a broken install: the package fails to import
        return False


def check_sage2_attention(device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    """Refuse, at load and saying what to do, what the built kernel cannot run."""
    option = "attention backend 'sage2'"
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ModelLoadError(
            f"{option} needs a Hopper GPU (compute capability 9.0); this stage runs on "
            f"{device}. Use attention_backend 'sdpa'."
        )
    capability = torch.cuda.get_device_capability(device)
    if capability != _CAPABILITY:
        raise ModelLoadError(
            f"{option} runs on Hopper GPUs (compute capability 9.0) only: its kernel is built "
            f"for sm_90a; {torch.cuda.get_device_name(device)} ({device}) has "
            f"{capability[0]}.{capability[1]}. Use attention_backend 'fp8_cudnn' or 'sdpa'."
        )
    if dtype != torch.bfloat16:
        raise ModelLoadError(f"{option} needs dtype bfloat16, got {str(dtype).split('.')[-1]}")
    if head_dim != _HEAD_DIM:
        raise ModelLoadError(
            f"{option} is built for head size {_HEAD_DIM}; this DiT has {head_dim}"
        )
    if not _kernel_installed():
        raise ModelLoadError(
            f"{option} needs SageAttention2's sm90 kernel (package sageattention with "
            f"sageattention._qattn_sm90), which is not installed: {INSTALL_HINT}"
        )


@torch.library.custom_op("diffring::sage2_sm90", mutates_args=())
def _sage2_sm90(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Upstream's sm90 path on bf16 (B, S, H, 128) tensors, quantisation included."""
    from sageattention import sageattn_qk_int8_pv_fp8_cuda_sm90

    out: torch.Tensor = sageattn_qk_int8_pv_fp8_cuda_sm90(
        q, k, v, tensor_layout="NHD", is_causal=False, qk_quant_gran="per_thread",
        pv_accum_dtype="fp32+fp32", smooth_k=True,
    )
    return out


@_sage2_sm90.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def sage2_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of (B, S, H, D) tensors: long self-attention through the kernel, the rest
    (cross-attention, short sequences) through SDPA (see the module doc)."""
    if k.shape[1] != q.shape[1] or q.shape[1] < SAGE2_MIN_TOKENS:
        from .kernels import sdpa_kernel

        return sdpa_kernel(q, k, v)
    return _sage2_sm90(q, k, v)


def sage2_kernel() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """:func:`sage2_attention` as a kernel for the kernel attention processors
    (:func:`workers.models.dit.kernels.install_kernel_processors`)."""
    return sage2_attention
