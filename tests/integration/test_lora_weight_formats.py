"""LoRA adapters on every weight format, fused adapters, published LoRA layouts, recipes.

Each against diffusers' own pipeline with the same adapter, on the tiny models (CPU):

* FP8 storage (layerwise casting to float8_e4m3fn runs on a CPU): a request with adapters
  gives exactly the pixels of the pipeline that loads the adapters and then enables the same
  layerwise casting (diffusers leaves PEFT's layers in the compute dtype), and a request
  without them exactly the cast model's.
* Offload: group offloading runs on a CPU without its copy stream (onload device = CPU). The
  pixels equal the plain pipeline's with the adapters, and every adapter load rebuilds the
  offload groups (what a copy stream needs: its pinned host copies are made per group when
  the groups are built; the stream itself runs on a GPU only, in the benchmark plan).
* FP8 linear layers: torchao's float8 tensors refuse a CPU at conversion (a hardware check
  for the fast kernels) but compute on one; the test lifts the checks (torchao's and the
  stage's) and runs the stage's own conversion, so PEFT's torchao LoRA layer is what runs.
  Skipped where torchao is not installed (the ``test`` extra carries it).
* ``lora_fuse``: the fused DiT equals the per-request adapter at the same strength to float
  rounding (merging reorders the sums: ``x (W + s B A)^T`` against ``x W^T + s (x A^T) B^T``),
  and equals diffusers' own ``fuse_lora`` exactly (the same merge).
* The LightX2V (Wan) and Qwen-Image-Lightning layouts, written from diffusers' converters'
  key naming (scripts/bench/lora_kit.py), load as diffusers' pipelines load them.
* Recipes: Qwen-Image-Lightning's scheduler and Wan's distill shift are what the DiT runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

torch.set_num_threads(1)

from contracts.errors import AdapterError, InvalidRequestError  # noqa: E402
from contracts.request import GenerationRequest  # noqa: E402
from contracts.stage_options import StageOptions  # noqa: E402
from scripts.bench.lora_kit import block_linears, make_adapter  # noqa: E402
from tests.support.models import diffusers_reference, small_request, stage, wire  # noqa: E402
from workers.models import TransformerAdapter  # noqa: E402

pytestmark = pytest.mark.integration  # builds and runs the tiny models

TASKS = ("wan_t2v", "qwen_t2i")
PAIR = [("style", 0.7), ("detail", 1.3)]


def _dit_class(task: str) -> Any:
    import diffusers

    return (diffusers.WanTransformer3DModel if task.startswith("wan")
            else diffusers.QwenImageTransformer2DModel)


@pytest.fixture(scope="module")
def loras(tiny_models: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per task a folder: ``style`` (rank 4, alpha 8), ``detail`` (rank 2) in diffusers'
    format; ``distill`` (every linear layer of every block) in the published layout of the
    family's distill LoRAs (Wan: LightX2V's, Qwen: Lightning's), ``distill_prefixed`` the
    Lightning variant with ComfyUI's prefix."""
    out = {}
    for task in TASKS:
        folder = tmp_path_factory.mktemp(f"loras-{task}")
        dit = _dit_class(task).from_pretrained(tiny_models / task / "transformer")
        make_adapter(dit, folder / "style.safetensors", rank=4, alpha=8, seed=1)
        make_adapter(dit, folder / "detail.safetensors", rank=2, seed=2, scale=0.3)
        every = block_linears(dit)
        if task.startswith("wan"):
            make_adapter(dit, folder / "distill.safetensors", rank=4, seed=3, targets=every,
                         fmt="lightx2v")
        else:
            make_adapter(dit, folder / "distill.safetensors", rank=4, alpha=2, seed=3,
                         targets=every, fmt="lightning")
            make_adapter(dit, folder / "distill_prefixed.safetensors", rank=4, alpha=2, seed=3,
                         targets=every, fmt="lightning", prefix="diffusion_model.")
        out[task] = folder
    return out


def dit_with(tiny_models: Path, task: str, dtype: str = "float32",
             **options: Any) -> TransformerAdapter:
    dit = TransformerAdapter.for_task(tiny_models / task, task, dtype=dtype,
                                      options=StageOptions(**options))
    dit.load()
    return dit


_CONDITIONS: dict[tuple[str, str, str], dict[str, torch.Tensor]] = {}


def run(tiny_models: Path, dit: TransformerAdapter, req: GenerationRequest,
        dtype: str = "float32") -> np.ndarray:
    """Our stages on ``req`` with this DiT: float pixels, as diffusers' "np" output."""
    key = (req.task, repr(req.replace(loras=())), dtype)
    if key not in _CONDITIONS:
        _CONDITIONS[key] = stage("encoder", tiny_models, req.task, dtype).encode(req)
    latents = dit.denoise(req, wire(_CONDITIONS[key]))
    out: np.ndarray = stage("decoder", tiny_models, req.task, dtype).decode_float(
        req, wire(latents))
    return out


def refs(pairs: list[tuple[str, float]]) -> list[dict[str, Any]]:
    return [{"name": n, "strength": w} for n, w in pairs]


def with_adapters(folder: Path, pairs: list[tuple[str, float]],
                  then: Callable[[Any], None] | None = None) -> Callable[[Any], None]:
    """diffusers' user code: load the adapters, set their strengths, then ``then(pipe)``."""
    def setup(pipe: Any) -> None:
        for name, _ in pairs:
            pipe.load_lora_weights(str(folder / f"{name}.safetensors"), adapter_name=name)
        if pairs:
            pipe.set_adapters([n for n, _ in pairs], adapter_weights=[w for _, w in pairs])
        if then is not None:
            then(pipe)
    return setup


def cast_fp8(pipe: Any) -> None:
    pipe.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn,
                                              compute_dtype=torch.float32)


@pytest.mark.parametrize("task", TASKS)
def test_adapters_on_fp8_storage_match_diffusers(tiny_models: Path, loras: dict[str, Path],
                                                 task: str) -> None:
    folder = loras[task]
    dit = dit_with(tiny_models, task, lora_dir=str(folder), weight_storage="fp8")
    plain_req = small_request(task)
    plain = diffusers_reference(tiny_models, plain_req, None, "float32", setup=cast_fp8)
    assert np.array_equal(run(tiny_models, dit, plain_req), plain)
    for pairs in ([("style", 0.7)], PAIR):
        req = small_request(task, loras=refs(pairs))
        ours = run(tiny_models, dit, req)
        reference = diffusers_reference(tiny_models, req, None, "float32",
                                        setup=with_adapters(folder, pairs, cast_fp8))
        assert float(np.abs(ours - reference).max()) == 0.0, pairs
        assert float(np.abs(ours - plain).max()) > 1e-3, "the adapter changed nothing"
        assert np.array_equal(run(tiny_models, dit, plain_req), plain)  # no trace after
    # The adapters live in the compute dtype beside the float8 weights they wrap.
    layer = dict(dit.transformer.named_modules())[
        "blocks.0.attn1.to_q" if task.startswith("wan") else "transformer_blocks.0.attn.to_q"]
    assert layer.base_layer.weight.dtype == torch.float8_e4m3fn
    assert layer.lora_A["style"].weight.dtype == torch.float32


def test_adapters_on_an_offloaded_dit_match_diffusers(
        tiny_models: Path, loras: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    import diffusers.hooks.group_offloading as go

    task = "wan_t2v"
    folder = loras[task]
    regrouped: list[int] = []
    real = go._maybe_remove_and_reapply_group_offloading

    def counting(module: Any) -> None:
        regrouped.append(1)
        real(module)

    monkeypatch.setattr(go, "_maybe_remove_and_reapply_group_offloading", counting)
    for level in ("block", "leaf"):
        dit = dit_with(tiny_models, task, lora_dir=str(folder), offload=level)
        plain_req = small_request(task)
        plain = diffusers_reference(tiny_models, plain_req, None, "float32")
        assert np.array_equal(run(tiny_models, dit, plain_req), plain)
        regrouped.clear()
        before = go._get_top_level_group_offload_hook(dit.transformer)
        req = small_request(task, loras=refs(PAIR))
        ours = run(tiny_models, dit, req)
        reference = diffusers_reference(tiny_models, req, None, "float32",
                                        setup=with_adapters(folder, PAIR))
        assert float(np.abs(ours - reference).max()) == 0.0, level
        # Each load rebuilt the groups, so they hold the adapters' layers.
        assert len(regrouped) == 2, level
        assert go._get_top_level_group_offload_hook(dit.transformer) is not before
        assert np.array_equal(run(tiny_models, dit, plain_req), plain)


@pytest.fixture
def fp8_on_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """FP8 linear layers on this CPU: torchao's and the stage's hardware checks lifted (the
    conversion and the LoRA layers are the same; only the fast kernels need a GPU), and the
    tiny requests admitted (cuBLASLt's row minimum is a GPU matter)."""
    pytest.importorskip("torchao")
    import torchao.quantization.quant_api as quant_api

    import workers.models.dit.dit_options as dit_options

    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda *a: None)
    monkeypatch.setattr(dit_options, "check_fp8_linear", lambda device: None)
    monkeypatch.setattr(dit_options, "FP8_MIN_TOKENS", 1)
    yield


def test_adapters_on_fp8_linear_layers_match_diffusers(
        tiny_models: Path, loras: dict[str, Path], fp8_on_cpu: None) -> None:
    from workers.models.dit.dit_options import fp8_linear_targets, quantize_fp8

    task = "qwen_t2i"  # its tiny sizes are multiples of 16, as FP8 matmuls need
    folder = loras[task]
    bf16 = "bfloat16"  # torchao's rowwise FP8 takes bfloat16 weights (the stage insists too)
    dit = dit_with(tiny_models, task, bf16, lora_dir=str(folder), linear="fp8")
    assert fp8_linear_targets(dit.transformer), "nothing converted: the test proves nothing"

    def quantized(pipe: Any) -> None:  # a diffusers user's torchao conversion, same layers
        targets = set(fp8_linear_targets(pipe.transformer))
        quantize_fp8(pipe.transformer, lambda _m, fqn: fqn in targets)

    def fp8_then_adapters(pairs: list[tuple[str, float]]) -> Callable[[Any], None]:
        def setup(pipe: Any) -> None:
            quantized(pipe)
            with_adapters(folder, pairs)(pipe)
        return setup

    plain_req = small_request(task)
    plain = diffusers_reference(tiny_models, plain_req, None, bf16, setup=quantized)
    assert np.array_equal(run(tiny_models, dit, plain_req, bf16), plain)
    req = small_request(task, loras=refs(PAIR))
    ours = run(tiny_models, dit, req, bf16)
    reference = diffusers_reference(tiny_models, req, None, bf16,
                                    setup=fp8_then_adapters(PAIR))
    assert float(np.abs(ours - reference).max()) == 0.0
    assert float(np.abs(ours - plain).max()) > 1e-3
    assert np.array_equal(run(tiny_models, dit, plain_req, bf16), plain)
    kinds = {type(m).__name__ for m in dit.transformer.modules()}
    assert "TorchaoLoraLinear" in kinds  # PEFT's layer for torchao weights ran


def test_fp8_linear_layers_are_converted_one_block_at_a_time(
        tiny_models: Path, fp8_on_cpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stage converts its FP8 linear layers block by block as it moves them to the device
    (the full-precision DiT is never whole there: a 14B in bf16 could not load under a
    24 GiB budget); the test above proves the result equals a whole-model conversion."""
    import workers.models.dit.dit_options as dit_options

    converted: list[tuple[str, int]] = []
    real = dit_options.quantize_fp8

    def spy(module: torch.nn.Module, chosen: Any = None) -> None:
        layers = sum(isinstance(m, torch.nn.Linear) for m in module.modules())
        converted.append((type(module).__name__, layers))
        real(module, chosen)

    monkeypatch.setattr(dit_options, "quantize_fp8", spy)
    dit = dit_with(tiny_models, "qwen_t2i", "bfloat16", linear="fp8")
    blocks = set(dit.transformer._repeated_blocks)
    count = sum(type(m).__name__ in blocks for m in dit.transformer.modules())
    assert len(converted) == count > 1
    assert all(name in blocks for name, _ in converted)
    assert all(n < sum(isinstance(m, torch.nn.Linear) for m in dit.transformer.modules())
               for _, n in converted)


def test_fused_adapters_equal_the_same_adapters_per_request(
        tiny_models: Path, loras: dict[str, Path]) -> None:
    task = "wan_t2v"
    folder = loras[task]
    fused = dit_with(tiny_models, task, lora_dir=str(folder),
                     lora_fuse=({"name": "style", "strength": 0.7},))
    per_request = dit_with(tiny_models, task, lora_dir=str(folder))
    req = small_request(task)
    cond = wire(stage("encoder", tiny_models, task).encode(req))

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    merged = fused.denoise(req, cond)["latents"]
    asked = per_request.denoise(req.replace(loras=refs([("style", 0.7)])), cond)["latents"]
    plain = per_request.denoise(req, cond)["latents"]
    assert rel(merged, asked) < 1e-5 and rel(merged, plain) > 1e-3
    # Another adapter on top of the fused one: as both per request.
    on_top = fused.denoise(req.replace(loras=refs([("detail", 1.3)])), cond)["latents"]
    both = per_request.denoise(req.replace(loras=refs(PAIR)), cond)["latents"]
    assert rel(on_top, both) < 1e-5
    assert not any(".lora_" in n for n, _ in fused.transformer.named_parameters()
                   if "style" in n), "the fused adapter's layers are gone"
    offers = fused.offers()
    assert offers["fused"] == [{"name": "style", "strength": 0.7}]
    assert "style" not in offers["loras"] and "detail" in offers["loras"]
    with pytest.raises(AdapterError, match="fused into this worker's weights"):
        fused.denoise(req.replace(loras=refs([("style", 1.0)])), cond)


def test_fused_before_fp8_storage_equals_diffusers_fuse(
        tiny_models: Path, loras: dict[str, Path], tmp_path: Path) -> None:
    """Merged before the cast (diffusers: load, fuse_lora, unload_lora, then cast): exactly.
    A folder holding only the fused adapter offers none per request."""
    task = "qwen_t2i"
    only = tmp_path / "only"
    only.mkdir()
    (only / "distill.safetensors").write_bytes((loras[task] / "distill.safetensors").read_bytes())
    dit = dit_with(tiny_models, task, lora_dir=str(only), weight_storage="fp8",
                   lora_fuse=({"name": "distill", "strength": 0.8},))
    assert dit.requests is not None and dit.requests.loras is None
    assert dit.offers()["loras"] == []

    def fuse_then_cast(pipe: Any) -> None:
        with_adapters(only, [("distill", 0.8)])(pipe)
        pipe.fuse_lora(components=["transformer"], adapter_names=["distill"])
        pipe.unload_lora_weights()
        cast_fp8(pipe)

    req = small_request(task)
    reference = diffusers_reference(tiny_models, req, None, "float32", setup=fuse_then_cast)
    assert np.array_equal(run(tiny_models, dit, req), reference)


@pytest.mark.parametrize(("task", "name"), [("wan_t2v", "distill"), ("qwen_t2i", "distill"),
                                            ("qwen_t2i", "distill_prefixed")])
def test_published_distill_layouts_load_as_diffusers_loads_them(
        tiny_models: Path, loras: dict[str, Path], task: str, name: str) -> None:
    folder = loras[task]
    dit = dit_with(tiny_models, task, lora_dir=str(folder))
    req = small_request(task, loras=refs([(name, 1.0)]))
    ours = run(tiny_models, dit, req)
    reference = diffusers_reference(tiny_models, req, None, "float32",
                                    setup=with_adapters(folder, [(name, 1.0)]))
    assert float(np.abs(ours - reference).max()) == 0.0
    plain = diffusers_reference(tiny_models, small_request(task), None, "float32")
    assert float(np.abs(ours - plain).max()) > 1e-3, "the adapter changed nothing"
    if task.startswith("wan"):  # LightX2V's bias deltas arrive as PEFT's lora_B.bias
        assert dit.transformer.peft_config[name].lora_bias


def test_recipes_run_the_published_schedulers(tiny_models: Path) -> None:
    import math

    from diffusers import FlowMatchEulerDiscreteScheduler

    task = "qwen_t2i"
    dit = dit_with(tiny_models, task, recipe="qwen-image-lightning-4step")
    lightning = FlowMatchEulerDiscreteScheduler.from_config({
        "base_image_seq_len": 256, "base_shift": math.log(3), "invert_sigmas": False,
        "max_image_seq_len": 8192, "max_shift": math.log(3), "num_train_timesteps": 1000,
        "shift": 1.0, "shift_terminal": None, "stochastic_sampling": False,
        "time_shift_type": "exponential", "use_beta_sigmas": False,
        "use_dynamic_shifting": True, "use_exponential_sigmas": False,
        "use_karras_sigmas": False})  # Qwen-Image-Lightning's generate_with_diffusers.py

    def with_lightning(pipe: Any) -> None:
        pipe.scheduler = lightning

    req = small_request(task, infer_steps=4, true_cfg_scale=1.0)
    reference = diffusers_reference(tiny_models, req, None, "float32", setup=with_lightning)
    assert np.array_equal(run(tiny_models, dit, req), reference)
    with pytest.raises(InvalidRequestError, match="CFG-distilled"):
        dit.denoise(small_request(task, true_cfg_scale=4.0), {})
    wan = dit_with(tiny_models, "wan_t2v", recipe="wan2.1-distill-4step")
    assert wan.scheduler.config.flow_shift == 5.0
    # the start-up warm-up runs the recipe's guidance (it ran CFG and was refused: fatal)
    assert wan.warm_up(["32x32x5"], steps=1) > 0
    assert dit.warm_up(["32x32"], steps=2) > 0
    assert dit_with(tiny_models, "wan_t2v", recipe="wan2.1-distill-4step",
                    flow_shift=3.0).scheduler.config.flow_shift == 3.0


def test_compiled_fp8_linear_adapter_switches_do_not_recompile(
        tiny_models: Path, loras: dict[str, Path], fp8_on_cpu: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled worker's adapter slots over FP8 linear layers: switching adapters adds no
    graph, frame or recompile (dynamo's counters; the "eager" backend, as in test_lora.py),
    and the slots compute what the eager worker's adapters do, to float rounding."""
    import torch._dynamo
    from diffusers.models.modeling_utils import ModelMixin
    from torch._dynamo.utils import counters

    real = ModelMixin.compile_repeated_blocks
    monkeypatch.setattr(ModelMixin, "compile_repeated_blocks",
                        lambda self, **kw: real(self, backend="eager", **kw))
    torch._dynamo.reset()
    task, bf16 = "qwen_t2i", "bfloat16"
    folder = loras[task]
    dit = TransformerAdapter.for_task(
        tiny_models / task, task, dtype=bf16, compile=True,
        options=StageOptions(lora_dir=str(folder), linear="fp8", lora_max_loaded=2))
    dit.load()
    req = small_request(task, infer_steps=2)
    dit.warm_up([f"{req.height}x{req.width}"], steps=2)
    cond = wire(stage("encoder", tiny_models, task, bf16).encode(req))

    def snapshot() -> tuple[int, int, int]:
        return (counters["stats"]["unique_graphs"], counters["frames"]["total"],
                sum(counters["recompiles"].values()))

    before = snapshot()
    assert before[0] > 0, "nothing was compiled: the test would prove nothing"
    switches = [[("style", 0.7)], [("detail", 1.0)], PAIR, []]
    outputs = [dit.denoise(req.replace(loras=refs(p)), cond)["latents"] for p in switches]
    assert snapshot() == before, (before, snapshot())
    eager = dit_with(tiny_models, task, bf16, lora_dir=str(folder), linear="fp8")
    for pairs, got in zip(switches, outputs, strict=True):
        want = eager.denoise(req.replace(loras=refs(pairs)), cond)["latents"]
        rel = float((got.float() - want.float()).norm() / want.float().norm())
        assert rel < 1e-5, (pairs, rel)  # as in test_lora.py (equal on this CPU)
    torch._dynamo.reset()
