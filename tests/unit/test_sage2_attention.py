"""The ``sage2`` attention backend (SageAttention2's Hopper kernel) on CPU: the option parses,
the stage refuses it at load with the install command where the kernel cannot run, and the
processors it runs compute exactly what diffusers' processors compute when the kernel is
SDPA (a stand-in ``sageattention`` module), compiled into one graph around the custom op.

Its speed and error are GPU measurements: scripts/bench/bench_attn.py (BENCHMARKS.md).
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

from contracts.config import ServiceConfig
from contracts.errors import ConfigError, ModelLoadError
from workers.models.dit import sage2_attention as sage2
from workers.models.dit.attention import (
    KernelWanAttnProcessor,
    apply_attention_backend,
    install_kernel_processors,
    sdpa_kernel,
)

BF16 = torch.bfloat16


def test_the_option_parses() -> None:
    assert ServiceConfig.from_dict({"attention_backend": "sage2"}).attention_backend == "sage2"
    with pytest.raises(ConfigError, match="attention_backend must be one of"):
        ServiceConfig.from_dict({"attention_backend": "sage3"})


def _pretend_gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU")


def test_refused_on_cpu() -> None:
    with pytest.raises(ModelLoadError, match=r"needs a Hopper GPU .* runs on cpu"):
        sage2.check_sage2_attention(torch.device("cpu"), BF16, 128)


@pytest.mark.parametrize("capability", [(8, 9), (10, 0), (12, 0)])
def test_refused_on_gpus_other_than_hopper(monkeypatch: pytest.MonkeyPatch,
                                           capability: tuple[int, int]) -> None:
    _pretend_gpu(monkeypatch, capability)
    with pytest.raises(ModelLoadError, match=r"Hopper GPUs \(compute capability 9\.0\) only"):
        sage2.check_sage2_attention(torch.device("cuda:0"), BF16, 128)


def test_refused_for_what_the_build_does_not_carry(monkeypatch: pytest.MonkeyPatch) -> None:
    _pretend_gpu(monkeypatch, (9, 0))
    with pytest.raises(ModelLoadError, match="needs dtype bfloat16, got float32"):
        sage2.check_sage2_attention(torch.device("cuda:0"), torch.float32, 128)
    with pytest.raises(ModelLoadError, match="built for head size 128; this DiT has 64"):
        sage2.check_sage2_attention(torch.device("cuda:0"), BF16, 64)


def test_refused_without_the_kernel_naming_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a Hopper GPU without the built kernel (this machine has no sageattention, like a
    node with PyPI's 1.x has no sm90 extension), load stops with the install command."""
    _pretend_gpu(monkeypatch, (9, 0))
    with pytest.raises(ModelLoadError) as info:
        sage2.check_sage2_attention(torch.device("cuda:0"), BF16, 128)
    text = str(info.value)
    assert "sageattention._qattn_sm90" in text and "not installed" in text
    assert "offline_bundle.sh --extras fp8,sage2" in text
    assert "install_offline.sh bundle/" in text


def test_a_stage_refuses_it_at_load_and_keeps_its_processors() -> None:
    model = _wan_dit()
    before = [type(m.processor) for m in model.modules() if hasattr(m, "processor")]
    with pytest.raises(ModelLoadError, match="needs a Hopper GPU"):
        apply_attention_backend(model, "sage2", torch.device("cpu"), BF16, 16)
    assert [type(m.processor) for m in model.modules() if hasattr(m, "processor")] == before


# -- the processors' math, with SDPA standing in for the kernel ---------------------------

@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """A ``sageattention`` module whose sm90 entry point is SDPA; records each call's
    options. Every self-attention goes to the kernel (no minimum length)."""
    calls: list[dict[str, Any]] = []

    def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        calls.append({"q": tuple(q.shape), "k": tuple(k.shape), **kw})
        return sdpa_kernel(q, k, v).contiguous()

    module = types.ModuleType("sageattention")
    module.sageattn_qk_int8_pv_fp8_cuda_sm90 = kernel  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sageattention", module)
    monkeypatch.setattr(sage2, "SAGE2_MIN_TOKENS", 1)
    return calls


def _wan_dit() -> Any:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=16,
        out_channels=16, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads").eval()


def _wan_inputs() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    return {"hidden_states": torch.randn(1, 16, 3, 4, 4, generator=gen),
            "timestep": torch.tensor([500.0]),
            "encoder_hidden_states": torch.randn(1, 7, 32, generator=gen)}


def test_wan_processors_match_diffusers_bit_for_bit(stand_in: list[dict[str, Any]]) -> None:
    model = _wan_dit()
    inputs = _wan_inputs()
    with torch.no_grad():
        reference = model(**inputs, return_dict=False)[0]
        assert install_kernel_processors(model, sage2.sage2_kernel()) == 4
        ours = model(**inputs, return_dict=False)[0]
    assert torch.equal(ours, reference)
    # Self-attention (12 tokens, 2 layers) went to the kernel, with the options the build
    # carries; cross-attention to the 7 text tokens stayed on SDPA.
    assert [c["q"] for c in stand_in] == [(1, 12, 2, 16)] * 2
    assert all(c["k"] == c["q"] for c in stand_in)
    assert {(c["tensor_layout"], c["is_causal"], c["qk_quant_gran"], c["pv_accum_dtype"],
             c["smooth_k"]) for c in stand_in} == {("NHD", False, "per_thread", "fp32+fp32",
                                                    True)}


def test_qwen_processors_match_diffusers_bit_for_bit(stand_in: list[dict[str, Any]]) -> None:
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6)).eval()
    gen = torch.Generator().manual_seed(0)
    inputs = {"hidden_states": torch.randn(1, 8, 64, generator=gen),
              "timestep": torch.tensor([0.5]),
              "encoder_hidden_states": torch.randn(1, 6, 32, generator=gen),
              "encoder_hidden_states_mask": None, "img_shapes": [[(1, 2, 2), (1, 2, 2)]]}
    with torch.no_grad():
        reference = model(**inputs, return_dict=False)[0]
        install_kernel_processors(model, sage2.sage2_kernel())
        ours = model(**inputs, return_dict=False)[0]
    assert torch.equal(ours, reference)
    assert [c["q"] for c in stand_in] == [(1, 14, 2, 16)] * 2  # text + image tokens


def test_the_kernel_is_one_op_with_a_fake(stand_in: list[dict[str, Any]]) -> None:
    """torch's own check of the custom op (schema, fake implementation against the real
    one), and a compiled DiT block with the kernel processors traces into one graph."""
    q, k, v = (torch.randn(1, 12, 2, 16) for _ in range(3))
    torch.library.opcheck(sage2._sage2_sm90, (q, k, v))

    from torch._dynamo.testing import CompileCounterWithBackend

    model = _wan_dit()
    install_kernel_processors(model, sage2.sage2_kernel())
    block = model.blocks[0]
    assert isinstance(block.attn1.processor, KernelWanAttnProcessor)
    hidden = torch.randn(1, 12, 32)
    text = torch.randn(1, 7, 32)
    temb = torch.randn(1, 6, 32)
    rope = model.rope(torch.randn(1, 16, 3, 4, 4))
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, backend=counter, fullgraph=True)
    torch._dynamo.reset()
    with torch.no_grad():
        expected = block(hidden, text, temb, rope)
        got = compiled(hidden, text, temb, rope)
    assert counter.frame_count == 1
    assert torch.equal(got, expected)
