"""The ``fa3_fp8`` attention backend (FlashAttention-3's FP8 forward) on CPU: the option
parses, the stage refuses it at load where it cannot run, and the math around the kernel
(smoothing, FP8 quantisation with one scale per batch and head, the value mean added back)
stays close to SDPA with SDPA standing in for the kernel, compiled into one graph.

Its speed and error on a GPU: scripts/bench/bench_attn.py (BENCHMARKS.md).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from contracts.config import ServiceConfig
from contracts.errors import ModelLoadError
from workers.models import fa3_attention as fa3
from workers.models.attention import sdpa_kernel


def test_the_option_parses_and_is_refused_without_a_hopper_gpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert ServiceConfig.from_dict({"attention_backend": "fa3_fp8"}).attention_backend == \
        "fa3_fp8"
    with pytest.raises(ModelLoadError, match="needs a Hopper GPU; this stage runs on cpu"):
        fa3.check_fa3_attention(torch.device("cpu"), torch.bfloat16, 128)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(ModelLoadError, match="not installed and which the offline bundle"):
        fa3.check_fa3_attention(torch.device("cuda:0"), torch.bfloat16, 128)


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """SDPA on the dequantised FP8 inputs in place of the kernel; every self-attention goes
    to it. Records the descales' shapes."""
    seen: list[tuple[int, ...]] = []

    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dq: torch.Tensor,
                dk: torch.Tensor, dv: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(dq.shape))

        def back(x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
            return x.float() * d[:, None, :, None]

        return sdpa_kernel(back(q, dq), back(k, dk), back(v, dv)).to(torch.bfloat16)

    monkeypatch.setattr(fa3, "_fa3_forward", forward)
    monkeypatch.setattr(fa3, "FA3_MIN_TOKENS", 1)
    return seen


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_quantised_attention_is_close_to_sdpa_and_smoothing_keeps_offsets_exact(
        stand_in: list[tuple[int, ...]]) -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 64, 3, 32, generator=gen).to(torch.bfloat16) for _ in range(3))
    ref = sdpa_kernel(q.float(), k.float(), v.float())
    assert _rel(fa3.fa3_fp8_attention(q, k, v), ref) < 0.08
    assert stand_in == [(2, 3)]
    # Keys + 3 and values + 2: without the means taken out, FP8's scales would be spent on
    # the offsets.
    shifted = sdpa_kernel(q.float(), k.float() + 3, v.float() + 2)
    assert _rel(fa3.fa3_fp8_attention(q, k + 3, v + 2), shifted) < 0.01
    # Cross-attention (other key length) is SDPA, exactly.
    kv = torch.randn(2, 7, 3, 32, generator=gen).to(torch.bfloat16)
    assert torch.equal(fa3.fa3_fp8_attention(q, kv, kv), sdpa_kernel(q, kv, kv))


def test_compiled_it_is_one_graph(stand_in: list[tuple[int, ...]]) -> None:
    from torch._dynamo.testing import CompileCounterWithBackend

    q, k, v = (torch.randn(1, 32, 2, 16).to(torch.bfloat16) for _ in range(3))
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    compiled: Any = torch.compile(fa3.fa3_fp8_attention, backend=counter, fullgraph=True)
    assert torch.equal(compiled(q, k, v), fa3.fa3_fp8_attention(q, k, v))
    assert counter.frame_count == 1
