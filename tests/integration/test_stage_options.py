"""Per-stage options (contracts/stage_options.py) on CPU: parsing and refusal, the memory
estimate and budget, FP8 weight storage equal to diffusers' own layerwise casting, offload
exact, the layers FP8 matmuls leave alone, and the GPU-only options refused with what to do.

The speed and memory figures are GPU measurements: scripts/bench/bench_dit.py (BENCHMARKS.md).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

torch.set_num_threads(1)

from contracts.config import ServiceConfig  # noqa: E402
from contracts.errors import ConfigError, ModelLoadError, StageError  # noqa: E402
from contracts.stage_options import StageOptions  # noqa: E402
from tests.support.models import diffusers_reference, small_request, wire  # noqa: E402
from tests.support.paths import ROOT  # noqa: E402
from workers.models import DecoderAdapter, EncoderAdapter, TransformerAdapter  # noqa: E402
from workers.models.memory import (  # noqa: E402
    check_budget,
    estimate_weights,
    oom_guard,
)

pytestmark = pytest.mark.integration  # starts processes or servers

FP8 = torch.float8_e4m3fn


# -- configuration ---------------------------------------------------------------------------

def test_stage_sections_parse_and_default_to_exact() -> None:
    cfg = ServiceConfig.from_dict({
        "dtype": "bfloat16", "compile": True, "warmup_shapes": ["480x832x81"],
        "transformer": {"linear": "fp8", "max_vram_gb": 24, "compile_cache_dir": "/tmp/cc"},
        "encoder": {"weight_storage": "fp8", "offload": "block"},
        "decoder": {"vae_tiling": True},
    })
    assert cfg.transformer == StageOptions(linear="fp8", max_vram_gb=24.0,
                                           compile_cache_dir="/tmp/cc")
    assert cfg.stage_options("encoder").offload == "block"
    assert cfg.decoder.vae_tiling and not cfg.decoder.exact
    assert ServiceConfig().transformer.exact and ServiceConfig().encoder == StageOptions()


@pytest.mark.parametrize(("data", "message"), [
    ({"transformer": {"weight_storage": "fp4"}}, "weight_storage must be one of dtype, fp8"),
    ({"transformer": {"offload": "disk"}}, "offload must be one of none, block, leaf"),
    ({"transformer": {"max_vram_gb": 0}}, "max_vram_gb must be positive"),
    ({"transformer": {"vram": 24}}, "unknown config key transformer.vram"),
    ({"encoder": {"linear": "fp8"}}, "encoder: linear apply to the transformer stage only"),
    ({"transformer": {"vae_tiling": True}}, "vae_tiling apply to the decoder stage only"),
    ({"dtype": "bfloat16", "transformer": {"linear": "fp8", "weight_storage": "fp8"}},
     "already stores the DiT's linear weights in FP8"),
    ({"dtype": "bfloat16", "transformer": {"linear": "fp8", "offload": "block"}},
     "cannot be combined with offload"),
    ({"transformer": {"linear": "fp8"}}, "needs dtype 'bfloat16'"),
    ({"transformer": {"compile_cache_dir": "/tmp/x"}}, "compile_cache_dir needs compile"),
    ({"attention_backend": "fp8"}, "attention_backend must be one of"),
])
def test_bad_stage_options_are_refused_by_name(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ServiceConfig.from_dict(data)


# -- GPU-only options refused on a CPU, at load ---------------------------------------------------

def test_fp8_options_need_a_recent_cuda_gpu(tiny_models: Path) -> None:
    linear = TransformerAdapter.for_task(
        tiny_models / "wan_t2v", "wan_t2v", "cpu", "bfloat16",
        options=StageOptions(linear="fp8"))
    with pytest.raises(ModelLoadError, match=r"compute capability 8\.9 or newer .* runs on cpu"):
        linear.load()
    attention = TransformerAdapter.for_task(
        tiny_models / "qwen_t2i", "qwen_t2i", "cpu", "bfloat16", attention="fp8_cudnn")
    with pytest.raises(ModelLoadError, match=r"compute capability 9\.0 or newer \(Hopper\)"):
        attention.load()


def test_options_of_another_stage_are_refused_by_the_adapter(tiny_models: Path) -> None:
    with pytest.raises(ModelLoadError, match="apply to the transformer stage only"):
        EncoderAdapter.for_task(tiny_models / "wan_t2v", "wan_t2v",
                                options=StageOptions(linear="fp8"))


# -- the layers FP8 matmuls convert ----------------------------------------------------------------

def _wan_dit() -> Any:
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=16,
        out_channels=16, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", image_dim=32,
        added_kv_proj_dim=32)


def _qwen_dit() -> Any:
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))


def test_fp8_linear_converts_block_projections_only() -> None:
    from workers.models.dit.dit_options import fp8_linear_targets

    wan = fp8_linear_targets(_wan_dit())
    per_block = {n.split(".", 2)[2] for n in wan}
    assert per_block == {
        "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
        "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0",
        "attn2.add_k_proj", "attn2.add_v_proj", "ffn.net.0.proj", "ffn.net.2",
    }
    assert {n.split(".", 2)[1] for n in wan} == {"0", "1"} and len(wan) == 24
    qwen = fp8_linear_targets(_qwen_dit())
    assert qwen and all(n.startswith("transformer_blocks.") for n in qwen)
    # Qwen-Image: the image stream only; the text stream's rows are the prompt's tokens.
    assert {n.split(".", 2)[2] for n in qwen} == {
        "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
        "img_mlp.net.0.proj", "img_mlp.net.2",
    }
    # Left alone: modulation (img_mod / txt_mod), embeddings, norms, the final projection.
    assert not [n for n in qwen if "_mod" in n or "norm" in n]
    for names in (wan, qwen):
        assert not [n for n in names if n.startswith(("proj_out", "patch_embedding", "img_in",
                                                      "txt_in", "condition_embedder",
                                                      "time_text_embed", "norm_out"))]


@pytest.mark.parametrize("task", ["wan_t2v", "qwen_t2i"])
def test_fp8_linear_refuses_a_request_of_too_few_tokens(tiny_models: Path, task: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """cuBLASLt has no FP8 rowwise matmul for a few rows at a long inner dimension (measured
    on an H200, ``dit_options.FP8_MIN_TOKENS``): a request of fewer image / video tokens is
    refused before its first step, naming its count; one of exactly the minimum runs. The
    conversion itself needs a GPU, so here it is left out: what is checked is the count."""
    from workers.models.dit import dit_options

    monkeypatch.setattr(dit_options, "apply_fp8_linear", lambda model, device: 0)
    req = small_request(task)
    enc = EncoderAdapter.for_task(tiny_models / task, task)
    enc.load()
    cond = wire(enc.encode(req))
    dit = TransformerAdapter.for_task(tiny_models / task, task,
                                      options=StageOptions(linear="fp8"))
    dit.load()
    # The tokens as the model sees them: the output of its patch embedding.
    seen: list[int] = []
    embed = dit.transformer.patch_embedding if task == "wan_t2v" else dit.transformer.img_in
    handle = embed.register_forward_hook(
        lambda _m, _i, out: seen.append(out[0, 0].numel() if task == "wan_t2v"
                                        else out.shape[1]))
    monkeypatch.setattr(dit_options, "FP8_MIN_TOKENS", 1)
    dit.denoise(req, cond)
    handle.remove()
    tokens = seen[0]
    monkeypatch.setattr(dit_options, "FP8_MIN_TOKENS", tokens + 1)
    with pytest.raises(StageError, match=re.escape(
            f"{task} request is too small for transformer.linear 'fp8': {tokens} latent "
            f"tokens, FP8 matmuls need at least {tokens + 1}")):
        dit.denoise(req, cond)
    monkeypatch.setattr(dit_options, "FP8_MIN_TOKENS", tokens)
    assert torch.isfinite(dit.denoise(req, cond)["latents"]).all()


def test_fp8_rows_probe_lists_each_block_shape_and_needs_a_gpu(tmp_path: Path) -> None:
    """``bench_dit rows`` (the GPU probe FP8_MIN_TOKENS rests on) covers the published DiTs'
    feed-forward shapes, converted, and Qwen-Image's text stream, left in bf16; without an
    FP8 GPU it stops with the reason instead of a traceback."""
    from scripts.bench import bench_dit

    shapes = {(r["arch"], r["in"], r["out"], r["kind"])
              for arch in ("wan-1.3b", "wan-14b", "qwen-image")
              for r in bench_dit.fp8_row_shapes(arch)}
    assert {("wan-1.3b", 8960, 1536, "fp8"), ("wan-14b", 13824, 5120, "fp8"),
            ("qwen-image", 12288, 3072, "fp8"),
            ("qwen-image", 12288, 3072, "bf16 (prompt rows)")} <= shapes
    assert not [s for s in shapes if s[0] != "qwen-image" and s[3] != "fp8"]
    with pytest.raises(SystemExit, match=r"compute capability 8\.9 or newer"):
        bench_dit.main(["rows", "--out", str(tmp_path), "--device", "cpu"])


# -- the memory estimate and the budget ------------------------------------------------------------

def test_estimate_reads_the_weights_the_stage_loads(tiny_models: Path) -> None:
    folder = tiny_models / "wan_t2v" / "transformer"
    est = estimate_weights([folder], element_bytes=4)
    dit = TransformerAdapter.for_task(tiny_models / "wan_t2v", "wan_t2v")
    dit.load()
    params = sum(p.numel() for p in dit.transformer.parameters())
    buffers = sum(b.numel() for b in dit.transformer.buffers() if b.is_floating_point())
    assert est.full >= params * 4 and est.full <= (params + buffers) * 4
    # FP8 storage: within 10 % of what the stage really holds once cast.
    cast = TransformerAdapter.for_task(tiny_models / "wan_t2v", "wan_t2v",
                                       options=StageOptions(weight_storage="fp8"))
    cast.load()
    held = sum(p.numel() * p.element_size() for p in cast.transformer.parameters())
    assert est.fp8 < est.full and abs(est.fp8 - held) <= 0.1 * held
    assert est.offload_resident <= est.full  # the tiny DiT has only two blocks
    assert est.bytes_for(StageOptions(weight_storage="fp8", offload="block")) == \
        est.offload_resident_fp8 < est.offload_resident


def test_budget_refusal_names_estimate_budget_and_what_fits(tiny_models: Path) -> None:
    est = estimate_weights([tiny_models / "qwen_t2i" / "transformer"], element_bytes=2)
    gib = 1 << 30
    # A budget between the FP8 estimate and the full one: FP8 storage and offload would fit.
    budget = (est.full + est.fp8) / 2 / gib
    opts = StageOptions(max_vram_gb=budget)
    with pytest.raises(ModelLoadError) as info:
        check_budget("transformer", opts, est, working_bytes=0)
    text = str(info.value)
    assert f"max_vram_gb is {budget:g}" in text
    assert "weights" in text and "options that would fit: weight_storage='fp8'" in text
    assert check_budget("transformer", StageOptions(max_vram_gb=budget, weight_storage="fp8"),
                        est, 0) == est.fp8
    with pytest.raises(ModelLoadError, match="no weight storage or offload option fits"):
        check_budget("transformer", StageOptions(max_vram_gb=1e-9), est, 0)


def test_dit_refuses_a_budget_at_load_before_reading_weights(tiny_models: Path,
                                                              tmp_path: Path) -> None:
    # A folder whose weights cannot be read: the refusal comes from the headers alone.
    src = tiny_models / "wan_t2v"
    dst = tmp_path / "wan"
    for part in ("scheduler", "vae"):
        (dst / part).parent.mkdir(parents=True, exist_ok=True)
        (dst / part).symlink_to(src / part)
    (dst / "transformer").mkdir()
    for f in (src / "transformer").iterdir():
        target = dst / "transformer" / f.name
        if f.suffix == ".safetensors":  # header kept, tensors cut off
            raw = f.read_bytes()
            size = int.from_bytes(raw[:8], "little")
            target.write_bytes(raw[: 8 + size])
        else:
            target.symlink_to(f)
    dit = TransformerAdapter.for_task(dst, "wan_t2v", options=StageOptions(max_vram_gb=0.5),
                                      budget_shapes=("1280x1280x81",))
    with pytest.raises(ModelLoadError, match=r"working memory .* but max_vram_gb is 0\.5"):
        dit.load()


def test_out_of_memory_fails_the_attempt_with_its_size() -> None:
    with pytest.raises(StageError, match=r"ran out of GPU memory on 832x480 x 81 frames "
                                         r"\(max_vram_gb 24;.*offload 'none'\)"):
        with oom_guard("transformer", "832x480 x 81 frames", torch.device("cpu"),
                       StageOptions(max_vram_gb=24)):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


# -- FP8 storage is diffusers' layerwise casting; offload is exact --------------------

@pytest.mark.parametrize("task", ["wan_t2v", "qwen_t2i"])
def test_fp8_storage_equals_diffusers_layerwise_casting(tiny_models: Path, task: str) -> None:
    import diffusers

    req = small_request(task)
    enc = EncoderAdapter.for_task(tiny_models / task, task)
    dit = TransformerAdapter.for_task(tiny_models / task, task,
                                      options=StageOptions(weight_storage="fp8"))
    dec = DecoderAdapter.for_task(tiny_models / task, task)
    for s in (enc, dit, dec):
        s.load()
    assert {p.dtype for p in dit.transformer.parameters()} >= {FP8}
    ours = dec.decode_float(req, wire(dit.denoise(req, wire(enc.encode(req)))))

    cls = getattr(diffusers, {"wan_t2v": "WanPipeline", "qwen_t2i": "QwenImagePipeline"}[task])
    original = cls.from_pretrained

    def cast_pipeline(*args: Any, **kwargs: Any) -> Any:
        pipe = original(*args, **kwargs)
        pipe.transformer.enable_layerwise_casting(storage_dtype=FP8,
                                                  compute_dtype=torch.float32)
        return pipe

    with pytest.MonkeyPatch.context() as mp:  # the reference pipeline, cast as diffusers does
        mp.setattr(cls, "from_pretrained", cast_pipeline)
        reference = diffusers_reference(tiny_models, req, None, "float32")
    assert float(np.abs(ours - reference).max()) == 0.0
    plain = diffusers_reference(tiny_models, req, None, "float32")
    assert float(np.abs(ours - plain).max()) > 0.0  # FP8 storage is lossy: the test can fail


@pytest.mark.parametrize("offload", ["block", "leaf"])
def test_offload_is_exact(tiny_models: Path, offload: str) -> None:
    task = "wan_t2v"
    req = small_request(task)
    tensors = EncoderAdapter.for_task(tiny_models / task, task)
    tensors.load()
    cond = tensors.encode(req)
    plain = TransformerAdapter.for_task(tiny_models / task, task)
    moved = TransformerAdapter.for_task(tiny_models / task, task,
                                        options=StageOptions(offload=offload))
    plain.load()
    moved.load()
    a = plain.denoise(req, wire(cond))["latents"]
    b = moved.denoise(req, wire(cond))["latents"]
    assert torch.equal(a, b)


def test_vae_tiling_is_applied(tiny_models: Path) -> None:
    dec = DecoderAdapter.for_task(tiny_models / "qwen_t2i", "qwen_t2i",
                                  options=StageOptions(vae_tiling=True))
    dec.load()
    assert getattr(dec, "vae").use_tiling  # noqa: B009  (a family attribute)


def test_memory_watch_reports_nothing_on_cpu_and_gauges_exist(tiny_models: Path) -> None:
    from prometheus_client import generate_latest

    from workers.metrics import WorkerMetrics

    dec = DecoderAdapter.for_task(tiny_models / "qwen_t2i", "qwen_t2i")
    dec.load()
    metrics = WorkerMetrics("decoder")
    metrics.watch_memory(dec)
    with dec.guarded("32x48"):
        pass
    text = generate_latest(metrics.registry).decode()
    for name in ("diffring_stage_resident_bytes", "diffring_stage_peak_bytes",
                 "diffring_stage_peak_max_bytes"):
        assert f'{name}{{role="decoder"}} 0.0' in text


def test_bench_dit_runs_on_cpu(tmp_path: Path) -> None:
    """The GPU benchmark's code path, at a toy size on the CPU (its figures mean nothing here)."""
    import subprocess
    import sys

    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.bench.bench_dit", "suite", "--arch", "wan-1.3b",
         "--layers", "1", "--shape", "16x16x5", "--device", "cpu", "--out", str(out),
         "--models", str(tmp_path / "models"), "--variants", "bf16,offload_block",
         "--steps", "1", "--repeats", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["variant"]: r for r in json.loads((out / "bench_dit.json").read_text())["warm"]}
    assert set(rows) == {"bf16", "offload_block"}
    assert "| offload_block | - |" in (out / "bench_dit.md").read_text()
    assert "| 0.0000 | 0.0000 |" in (out / "bench_dit.md").read_text()  # offload: exact


def test_bench_dit_reports_compile_counters() -> None:
    """A compiled variant's row says how many graphs its warm-up compiled and how the compile
    caches answered (here two shapes through AOTAutograd: two graphs, the third call a
    guard hit)."""
    import torch

    from scripts.bench.bench_dit import compile_counters

    torch._dynamo.reset()
    before = compile_counters().get("graphs", 0)
    f = torch.compile(lambda x: x.sin() + 1, backend="aot_eager", dynamic=False)
    f(torch.randn(4))
    f(torch.randn(4, 3))
    f(torch.randn(4, 3))  # a guard hit: no new graph
    got = compile_counters()
    assert got["graphs"] - before == 2
    assert all(v > 0 for v in got.values())  # zeros are left out


def test_fp8_storage_hook_cost_bench_on_cpu(tmp_path: Path) -> None:
    """``bench_dit hooks``: the published Wan2.1-1.3B DiT on meta tensors, FP8 storage placed
    by the stage's own code: every hooked module is one of the blocks' linear layers (weight
    and bias cast), the norms, embeddings and output projection are left alone, and the
    host time of one forward's casts is measured."""
    from scripts.bench import bench_dit

    out = tmp_path / "out"
    assert bench_dit.main(["hooks", "--archs", "wan-1.3b", "--repeats", "2",
                           "--out", str(out)]) == 0
    row = json.loads((out / "hooks.json").read_text())["wan-1.3b"]
    # 30 blocks x 10 linear layers (self- and cross-attention q, k, v, out; the two of the
    # feed-forward); the condition embedder's and the output projection's are skipped.
    assert (row["modules"], row["tensors"]) == (300, 600)
    assert row["ms_median"] > 0
    assert "| wan-1.3b | 300 | 600 |" in (out / "hooks.md").read_text()


def test_reported_stats_are_sanitised_before_the_status_page() -> None:
    from controller.control import _stats
    from controller.ownership.registry import WorkerInfo

    got = _stats({"resident_bytes": 3, "peak": 2.5, "bad": "x", "flag": True, 7: 1,
                  **{f"k{i}": i for i in range(40)}})
    assert got["resident_bytes"] == 3.0 and got["peak"] == 2.5
    assert "bad" not in got and "flag" not in got and len(got) <= 16
    assert _stats(["not", "a", "map"]) == {}
    w = WorkerInfo(1, "transformer", "t", 1, "", "wan_t2v")  # type: ignore[arg-type]
    w.stats = got
    assert w.public()["stats"] == got
