"""LoRA adapters and step caches per request, against diffusers' own pipelines.

Adapters are made here with PEFT (random weights, scripts/bench/lora_kit.py) and saved in
diffusers' format, and for Wan also in the original Wan2.1 layout that diffusers' loader
converts. For each pipeline with a DiT, a request with adapters gives the pixels of
diffusers' pipeline with those adapters loaded at those strengths (``load_lora_weights`` +
``set_adapters``), a request without adapters right after gives exactly the plain output,
and a cached request gives the pixels of the pipeline with the same cache config enabled.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

torch.set_num_threads(1)

from contracts.errors import AdapterError, InvalidRequestError  # noqa: E402
from contracts.request import GenerationRequest  # noqa: E402
from contracts.stage_options import StageOptions  # noqa: E402
from scripts.bench.lora_kit import make_adapter  # noqa: E402
from tests.support.models import (  # noqa: E402
    IMAGE_INPUT_TASKS,
    diffusers_reference,
    reference_cache,
    small_request,
    stage,
    wire,
    with_adapters,
)
from tests.support.paths import ROOT  # noqa: E402
from workers.models import TransformerAdapter  # noqa: E402

# Builds the tiny models and starts processes (the benchmark).
pytestmark = pytest.mark.integration

DIT_TASKS = ("wan_t2v", "wan_i2v", "qwen_t2i", "qwen_i2i")
ADAPTERS: dict[str, dict[str, Any]] = {
    # alpha != rank: the metadata's lora_alpha must reach the scaling
    "style": {"rank": 4, "alpha": 8, "seed": 1},
    "detail": {"rank": 2, "seed": 2, "scale": 0.3},
    "same": {"rank": 4, "seed": 3},
}


def _dit_class(task: str) -> Any:
    import diffusers

    return (diffusers.WanTransformer3DModel if task.startswith("wan")
            else diffusers.QwenImageTransformer2DModel)


@pytest.fixture(scope="module")
def lora_dirs(tiny_models: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per task, a folder of adapters: ``style``, ``detail``, ``same``; Wan also ``orig``,
    the weights of ``same`` in the original Wan layout."""
    out = {}
    for task in DIT_TASKS:
        folder = tmp_path_factory.mktemp(f"loras-{task}")
        dit = _dit_class(task).from_pretrained(tiny_models / task / "transformer")
        for name, kw in ADAPTERS.items():
            make_adapter(dit, folder / f"{name}.safetensors", **kw)
        if task.startswith("wan"):
            make_adapter(dit, folder / "orig.safetensors", fmt="wan", **ADAPTERS["same"])
        out[task] = folder
    return out


_DITS: dict[tuple[str, str], TransformerAdapter] = {}


def lora_dit(tiny_models: Path, task: str, folder: Path, **options: Any) -> TransformerAdapter:
    key = (task, repr(sorted(options.items())))
    if key not in _DITS:
        dit = TransformerAdapter.for_task(tiny_models / task, task,
                                          options=StageOptions(lora_dir=str(folder), **options))
        dit.load()
        _DITS[key] = dit
    return _DITS[key]


_CONDITIONS: dict[tuple[str, bytes | None], dict[str, Any]] = {}


def run(tiny_models: Path, dit: TransformerAdapter, req: GenerationRequest,
        image: bytes | None) -> np.ndarray:
    """Our three stages (the DiT given) on ``req``: float pixels, as diffusers' "np". The
    encoder's output does not depend on the adapters or the cache, only on the rest of the
    request: it is computed once per such request (an edit's encoder, which sizes the image
    to a megapixel, is most of a run's time on the CPU)."""
    key = (repr(req.replace(loras=(), cache=None)), image)
    if key not in _CONDITIONS:
        _CONDITIONS[key] = stage("encoder", tiny_models, req.task).encode(req, image)
    cond = _CONDITIONS[key]
    latents = dit.denoise(req, wire(cond))
    out: np.ndarray = stage("decoder", tiny_models, req.task).decode_float(req, wire(latents))
    return out


def refs(loras: list[tuple[str, float]]) -> list[dict[str, Any]]:
    return [{"name": n, "strength": w} for n, w in loras]


@pytest.mark.parametrize("task", DIT_TASKS)
def test_adapters_match_diffusers(tiny_models: Path, input_png: bytes,
                                  lora_dirs: dict[str, Path], task: str) -> None:
    folder = lora_dirs[task]
    image = input_png if task in IMAGE_INPUT_TASKS else None
    dit = lora_dit(tiny_models, task, folder)
    plain_req = small_request(task)
    plain_ref = diffusers_reference(tiny_models, plain_req, image, "float32")
    assert np.array_equal(run(tiny_models, dit, plain_req, image), plain_ref)

    cases = [[("style", 0.7)], [("style", 0.7), ("detail", 1.3)]]
    if task.startswith("wan"):
        cases.append([("orig", 0.5)])
    outputs = {}
    for loras in cases:
        req = small_request(task, loras=refs(loras))
        ours = run(tiny_models, dit, req, image)
        reference = diffusers_reference(tiny_models, req, image, "float32",
                                        setup=with_adapters(folder, loras))
        assert float(np.abs(ours - reference).max()) == 0.0, loras
        assert float(np.abs(ours - plain_ref).max()) > 1e-3, "the adapter changed nothing"
        outputs[loras[-1][0]] = ours
        # Right after: no trace of the adapters.
        assert np.array_equal(run(tiny_models, dit, plain_req, image), plain_ref)
    assert not np.array_equal(outputs["style"], outputs["detail"])
    if task.startswith("wan"):  # the converted original layout is the same adapter
        same = run(tiny_models, dit, small_request(task, loras=refs([("same", 0.5)])), image)
        assert np.array_equal(outputs["orig"], same)


# Each kind with settings that skip work on these tiny models (checked: the output moves).
CACHES: dict[str, list[dict[str, Any]]] = {
    "wan_t2v": [
        {"kind": "first_block_cache", "threshold": 0.2},
        {"kind": "mag_cache", "mag_ratios": [1.0] * 6, "retention_ratio": 0.2},
        {"kind": "taylorseer_cache", "cache_interval": 2, "disable_cache_before_step": 2,
         "cache_identifiers": [r"blocks\.\d+"], "taylor_factors_dtype": "float32"},
        {"kind": "pyramid_attention_broadcast", "spatial_attention_block_skip_range": 2,
         "spatial_attention_timestep_skip_range": [0, 1000]},
    ],
    "wan_i2v": [{"kind": "mag_cache", "mag_ratios": [1.0] * 6}],
    "qwen_t2i": [{"kind": "first_block_cache", "threshold": 0.6},
                 {"kind": "taylorseer_cache", "cache_interval": 2,
                  "disable_cache_before_step": 2, "taylor_factors_dtype": "float32"}],
    "qwen_i2i": [{"kind": "mag_cache", "mag_ratios": [1.0] * 6}],
}


@pytest.mark.parametrize(("task", "cache"), [(t, c) for t, cs in CACHES.items() for c in cs],
                         ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_cache_matches_diffusers(tiny_models: Path, input_png: bytes,
                                 lora_dirs: dict[str, Path], task: str,
                                 cache: dict[str, Any]) -> None:
    image = input_png if task in IMAGE_INPUT_TASKS else None
    dit = lora_dit(tiny_models, task, lora_dirs[task])
    steps = 6
    req = small_request(task, infer_steps=steps, cache=cache)
    plain_req = small_request(task, infer_steps=steps)
    plain = diffusers_reference(tiny_models, plain_req, image, "float32")
    ours = run(tiny_models, dit, req, image)
    reference = diffusers_reference(tiny_models, req, image, "float32",
                                    setup=reference_cache(cache, steps))
    assert float(np.abs(ours - reference).max()) == 0.0
    assert float(np.abs(ours - plain).max()) > 1e-4, "the cache skipped nothing"
    # Its state went with it: the same request again gives the same pixels, a plain one the
    # plain pixels.
    assert np.array_equal(run(tiny_models, dit, req, image), ours)
    assert np.array_equal(run(tiny_models, dit, plain_req, image), plain)


def test_worker_default_cache_and_turning_it_off(tiny_models: Path) -> None:
    cache = {"kind": "first_block_cache", "threshold": 0.6}
    dit = TransformerAdapter.for_task(tiny_models / "qwen_t2i", "qwen_t2i",
                                      options=StageOptions(cache=cache))
    dit.load()
    plain_dit = stage("transformer", tiny_models, "qwen_t2i")
    req = small_request("qwen_t2i", infer_steps=6)
    cond = wire(stage("encoder", tiny_models, "qwen_t2i").encode(req))
    default = dit.denoise(req, cond)["latents"]
    asked = plain_dit.denoise(req.replace(cache=cache), cond)["latents"]
    assert torch.equal(default, asked)
    off = dit.denoise(req.replace(cache={"kind": "none"}), cond)["latents"]
    assert torch.equal(off, plain_dit.denoise(req, cond)["latents"])
    assert not torch.equal(off, default)


@pytest.mark.parametrize(("task", "kind", "why"), [
    ("wan_t2v", "faster_cache", "needs both guidance branches in one batch"),
    ("qwen_t2i", "faster_cache", "needs both guidance branches in one batch"),
    ("qwen_t2i", "pyramid_attention_broadcast", "differ in length"),
])
def test_unsupported_cache_kind_is_refused(tiny_models: Path, task: str, kind: str,
                                           why: str) -> None:
    dit = stage("transformer", tiny_models, task)
    assert kind not in dit.offers()["caches"]
    with pytest.raises(InvalidRequestError, match=why):
        dit.denoise(small_request(task, cache={"kind": kind}), {})


def test_bad_adapter_files_fail_the_request_only(tiny_models: Path, lora_dirs: dict[str, Path],
                                                 tmp_path: Path) -> None:
    task = "wan_t2v"
    folder = tmp_path / "loras"
    folder.mkdir()
    for name in ("style", "detail"):
        (folder / f"{name}.safetensors").write_bytes(
            (lora_dirs[task] / f"{name}.safetensors").read_bytes())
    (folder / "corrupt.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    from safetensors.torch import save_file

    save_file({"transformer.nowhere.lora_A.weight": torch.zeros(2, 4),
               "transformer.nowhere.lora_B.weight": torch.zeros(4, 2)},
              str(folder / "foreign.safetensors"))
    save_file({"transformer.blocks.0.attn1.to_q.weight": torch.zeros(32, 32)},
              str(folder / "notlora.safetensors"))
    dit = TransformerAdapter.for_task(tiny_models / task, task,
                                      options=StageOptions(lora_dir=str(folder)))
    dit.load()
    assert dit.offers()["loras"] == ["corrupt", "detail", "foreign", "notlora", "style"]
    req = small_request(task)
    cond = wire(stage("encoder", tiny_models, task).encode(req))
    plain = stage("transformer", tiny_models, task).denoise(req, cond)["latents"]
    good = dit.denoise(small_request(task, loras=refs([("style", 1.0)])), cond)["latents"]
    cases = [
        ("corrupt", r"corrupt\.safetensors\) cannot be read"),
        ("foreign", r"foreign\.safetensors\) (does not fit this model|none of its keys)"),
        ("notlora", r"notlora\.safetensors\) is not a LoRA checkpoint"),
        ("missing", "no adapter 'missing' in .*; this worker serves corrupt, detail"),
    ]
    for name, message in cases:
        with pytest.raises(AdapterError, match=message):
            # With a good adapter before it: its load must not survive the failure.
            dit.denoise(small_request(task, loras=refs([("detail", 1.0), (name, 1.0)])), cond)
        assert torch.equal(dit.denoise(req, cond)["latents"], plain), name
        again = dit.denoise(small_request(task, loras=refs([("style", 1.0)])), cond)["latents"]
        assert torch.equal(again, good), name
    with pytest.raises(AdapterError, match="no LoRA adapters"):
        stage("transformer", tiny_models, task).denoise(
            small_request(task, loras=refs([("style", 1.0)])), cond)


def _replace(folder: Path, name: str, source: Path) -> None:
    """Put ``source``'s bytes at ``folder/name.safetensors`` as an operator should: a new
    file renamed over the old one."""
    import os

    tmp = folder / f".{name}.new"
    tmp.write_bytes(source.read_bytes())
    os.replace(tmp, folder / f"{name}.safetensors")


def test_an_adapter_file_replaced_while_loaded_is_read_again(
        tiny_models: Path, lora_dirs: dict[str, Path], tmp_path: Path) -> None:
    """The eager worker keeps adapters loaded between requests; a file replaced meanwhile
    is read again at its next use (main served the old weights until eviction)."""
    task = "qwen_t2i"
    folder = tmp_path / "loras"
    folder.mkdir()
    _replace(folder, "swap", lora_dirs[task] / "style.safetensors")
    dit = TransformerAdapter.for_task(tiny_models / task, task,
                                      options=StageOptions(lora_dir=str(folder)))
    dit.load()
    reference = lora_dit(tiny_models, task, lora_dirs[task])
    req = small_request(task, infer_steps=2)
    cond = wire(stage("encoder", tiny_models, task).encode(req))

    def latents(d: TransformerAdapter, name: str) -> torch.Tensor:
        out: torch.Tensor = d.denoise(req.replace(loras=refs([(name, 0.8)])), cond)["latents"]
        return out

    style, detail = latents(reference, "style"), latents(reference, "detail")
    assert torch.equal(latents(dit, "swap"), style)
    _replace(folder, "swap", lora_dirs[task] / "detail.safetensors")
    assert torch.equal(latents(dit, "swap"), detail)
    assert torch.equal(latents(dit, "swap"), detail)  # read once: the file is unchanged
    assert set(dit.transformer.peft_config) == {"swap"}


def test_most_recently_used_adapters_stay_loaded(tiny_models: Path,
                                                 lora_dirs: dict[str, Path]) -> None:
    from workers.models.dit.lora import LoraLibrary

    task = "qwen_t2i"
    dit = TransformerAdapter.for_task(
        tiny_models / task, task,
        options=StageOptions(lora_dir=str(lora_dirs[task]), lora_max_loaded=2))
    dit.load()
    library = dit.requests.loras if dit.requests else None
    assert isinstance(library, LoraLibrary)
    req = small_request(task, infer_steps=2)
    cond = wire(stage("encoder", tiny_models, task).encode(req))
    first = dit.denoise(req.replace(loras=refs([("style", 0.5)])), cond)["latents"]
    for name in ("detail", "same", "style"):
        dit.denoise(req.replace(loras=refs([(name, 0.5)])), cond)
    assert list(library.loaded) == ["same", "style"]  # detail went first (least recent)
    assert set(dit.transformer.peft_config) == {"same", "style"}
    # Reloaded after its eviction, an adapter computes what it computed the first time.
    dit.denoise(req.replace(loras=refs([("detail", 0.5)])), cond)
    dit.denoise(req.replace(loras=refs([("same", 0.5)])), cond)
    again = dit.denoise(req.replace(loras=refs([("style", 0.5)])), cond)["latents"]
    assert torch.equal(again, first)
    # A byte bound below one adapter's size: a request's own adapters are still loaded
    # (the bound is on what stays loaded for later requests), the others go.
    library.max_bytes = 1
    dit.denoise(req.replace(loras=refs([("detail", 0.5), ("style", 0.5)])), cond)
    assert list(library.loaded) == ["detail", "style"]
    dit.denoise(req.replace(loras=refs([("same", 0.5)])), cond)
    assert list(library.loaded) == ["same"]


def test_compiled_adapter_switches_do_not_recompile(
    tiny_models: Path, lora_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With compile on, adapters are hot-swapped into slots compiled once: several switches
    (one adapter, another, two, none, a new strength) add no graph and no frame compile,
    by dynamo's own counters. The "eager" backend: recompiles are dynamo's decision (its
    guards), whatever backend turns the graphs into code; Inductor would only add minutes
    of C++ compilation on this machine."""
    import torch._dynamo
    from diffusers.models.modeling_utils import ModelMixin
    from torch._dynamo.utils import counters

    real = ModelMixin.compile_repeated_blocks
    monkeypatch.setattr(ModelMixin, "compile_repeated_blocks",
                        lambda self, **kw: real(self, backend="eager", **kw))
    torch._dynamo.reset()
    task = "wan_t2v"
    folder = lora_dirs[task]
    dit = TransformerAdapter.for_task(
        tiny_models / task, task, compile=True,
        options=StageOptions(lora_dir=str(folder), lora_max_loaded=2))
    dit.load()
    req = small_request(task, infer_steps=2)
    geometry = f"{req.height}x{req.width}x{req.num_frames}"
    dit.warm_up([geometry], steps=2)
    cond = wire(stage("encoder", tiny_models, task).encode(req))

    def snapshot() -> tuple[int, int, int]:
        return (counters["stats"]["unique_graphs"], counters["frames"]["total"],
                sum(counters["recompiles"].values()))

    before = snapshot()
    assert before[0] > 0, "nothing was compiled: the test would prove nothing"
    switches = [[("style", 0.7)], [("detail", 1.0)], [("style", 0.7), ("detail", 1.3)], [],
                [("same", 0.4)], [("style", 0.2)], []]
    outputs = []
    for loras in switches:
        outputs.append(dit.denoise(req.replace(loras=refs(loras)), cond)["latents"])
    assert snapshot() == before, (before, snapshot())
    # The slots compute the adapters: as the eager worker does, to float rounding.
    eager = lora_dit(tiny_models, task, folder)
    for loras, got in zip(switches, outputs, strict=True):
        want = eager.denoise(req.replace(loras=refs(loras)), cond)["latents"]
        rel = float((got - want).norm() / want.norm())
        assert rel < 1e-5, (loras, rel)
    assert torch.equal(outputs[3], outputs[6])  # no adapter: the same, whatever came before
    # A file replaced while its slot holds it is swapped in again, still without compiling.
    _replace(folder, "swap", folder / "style.safetensors")
    dit.denoise(req.replace(loras=refs([("swap", 0.7)])), cond)
    _replace(folder, "swap", folder / "detail.safetensors")
    got = dit.denoise(req.replace(loras=refs([("swap", 0.7)])), cond)["latents"]
    want = eager.denoise(req.replace(loras=refs([("detail", 0.7)])), cond)["latents"]
    assert float((got - want).norm() / want.norm()) < 1e-5
    assert snapshot() == before, (before, snapshot())
    (folder / "swap.safetensors").unlink()
    torch._dynamo.reset()


def test_bench_lora_runs_on_cpu(tmp_path: Path) -> None:
    """The GPU benchmark's code path at a toy size on the CPU (its figures mean nothing here;
    the compiled hot-swap is left out: Inductor on this machine takes minutes)."""
    import json
    import subprocess
    import sys

    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.bench.bench_lora", "--arch", "wan-1.3b", "--layers",
         "2", "--shape", "16x16x5", "--device", "cpu", "--out", str(out), "--models",
         str(tmp_path / "models"), "--steps", "1", "--cache-steps", "3", "--rank", "4",
         "--repeats", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "bench_lora.json").read_text())
    for key in ("first_use_s", "switch_loaded_s", "plain_s", "one_adapter_s",
                "two_adapters_s"):
        assert result[key] > 0, key
    assert set(result["caches"]) == {
        "none", "first_block_cache/never", "first_block_cache/always", "mag_cache/every_other",
        "taylorseer_cache/interval_2", "pyramid_attention_broadcast/2"}
    assert "| switch to a loaded adapter" in (out / "bench_lora.md").read_text()
