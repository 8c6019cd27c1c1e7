"""Wan2.2-A14B LoRA pairs against diffusers: a request names a pair once and each expert gets
its half, as a diffusers user loads them (``load_lora_weights(high)``,
``load_lora_weights(low, load_into_transformer_2=True)``, ``set_adapters``). The pairs are
made here with PEFT on the tiny experts (random weights, scripts/bench/lora_kit.py), in the
published layouts: ``<name>_high_noise`` / ``<name>_low_noise`` files (diffusers' format),
the word in the middle of the name (LightX2V's distill files, original Wan layout), and a
sub-folder of ``high_noise_model`` / ``low_noise_model`` (Wan2.2-Lightning)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

torch.set_num_threads(1)

from contracts.errors import AdapterError, InvalidRequestError  # noqa: E402
from contracts.stage_options import StageOptions  # noqa: E402
from scripts.bench.lora_kit import make_adapter  # noqa: E402
from tests.support.models import diffusers_reference, small_request, stage, wire  # noqa: E402
from workers.models import TransformerAdapter  # noqa: E402
from workers.models.dit.lora import pairs, scan_half  # noqa: E402

pytestmark = pytest.mark.integration  # builds and runs the tiny models

TASK = "wan22_a14b_t2v"
# name -> (file of the high-noise half, file of the low-noise half, format)
PAIRS = {
    "lightning": ("lightning_high_noise.safetensors", "lightning_low_noise.safetensors",
                  "diffusers"),
    "wan2.2_t2v_A14b_lora_rank4_4step": (
        "wan2.2_t2v_A14b_high_noise_lora_rank4_4step.safetensors",
        "wan2.2_t2v_A14b_low_noise_lora_rank4_4step.safetensors", "wan"),
    "seko": ("seko/high_noise_model.safetensors", "seko/low_noise_model.safetensors",
             "diffusers"),
}


@pytest.fixture(scope="module")
def lora_dir(tiny_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pairs of :data:`PAIRS`, each half made on its own expert, and ``style``, one file
    for both experts."""
    from diffusers import WanTransformer3DModel

    folder = tmp_path_factory.mktemp("wan22-loras")
    high = WanTransformer3DModel.from_pretrained(tiny_models / TASK / "transformer")
    low = WanTransformer3DModel.from_pretrained(tiny_models / TASK / "transformer_2")
    for seed, (first, second, fmt) in enumerate(PAIRS.values(), start=1):
        make_adapter(high, folder / first, rank=4, seed=seed, fmt=fmt)
        make_adapter(low, folder / second, rank=4, alpha=2, seed=seed + 10, fmt=fmt)
    make_adapter(high, folder / "style.safetensors", rank=2, seed=30)
    return folder


def with_pairs(folder: Path, loras: list[tuple[str, float]]) -> Callable[[Any], None]:
    """A diffusers pipeline's set-up for ``loras``: each pair's halves into their experts, a
    single file into both, under the request's name."""

    def setup(pipe: Any) -> None:
        names = [f"a{i}" for i in range(len(loras))]  # PEFT's names take no "."
        for (name, _), adapter in zip(loras, names, strict=True):
            high, low = (str(folder / f) for f in PAIRS[name][:2]) if name in PAIRS else \
                (str(folder / f"{name}.safetensors"),) * 2
            pipe.load_lora_weights(high, adapter_name=adapter)
            pipe.load_lora_weights(low, adapter_name=adapter, load_into_transformer_2=True)
        pipe.set_adapters(names, adapter_weights=[w for _, w in loras])

    return setup


def run(tiny_models: Path, dit: TransformerAdapter, loras: list[tuple[str, float]]
        ) -> np.ndarray:
    req = small_request(TASK, loras=[{"name": n, "strength": w} for n, w in loras])
    cond = stage("encoder", tiny_models, TASK).encode(req)
    out: np.ndarray = stage("decoder", tiny_models, TASK).decode_float(
        req, wire(dit.denoise(req, wire(cond))))
    return out


def test_the_folder_is_read_as_pairs(lora_dir: Path) -> None:
    found = pairs(lora_dir)
    assert {n: (p[0].relative_to(lora_dir).as_posix(), p[1].relative_to(lora_dir).as_posix())
            for n, p in found.items()} == {n: f[:2] for n, f in PAIRS.items()}
    assert scan_half(lora_dir, "low")["style"] == scan_half(lora_dir, "high")["style"]
    assert sorted(scan_half(lora_dir, "high")) == sorted([*PAIRS, "style"])


@pytest.mark.parametrize("placement", ["both", "swap"])
def test_pairs_match_diffusers(tiny_models: Path, lora_dir: Path, placement: str) -> None:
    dit = TransformerAdapter.for_task(tiny_models / TASK, TASK, options=StageOptions(
        lora_dir=str(lora_dir), experts=placement))
    dit.load()
    assert dit.offers()["loras"] == sorted([*PAIRS, "style"])
    plain = diffusers_reference(tiny_models, small_request(TASK), None, "float32")
    assert np.array_equal(run(tiny_models, dit, []), plain)
    for loras in ([("lightning", 1.0)], [("seko", 0.8), ("style", 0.5)],
                  [("wan2.2_t2v_A14b_lora_rank4_4step", 0.6)]):
        req = small_request(TASK, loras=[{"name": n, "strength": w} for n, w in loras])
        want = diffusers_reference(tiny_models, req, None, "float32",
                                   setup=with_pairs(lora_dir, loras))
        ours = run(tiny_models, dit, loras)
        assert float(np.abs(ours - want).max()) == 0.0, loras
        assert float(np.abs(ours - plain).max()) > 1e-3, "the pair changed nothing"
        assert np.array_equal(run(tiny_models, dit, []), plain)  # no trace after it


def test_each_half_reaches_its_own_expert(tiny_models: Path, lora_dir: Path) -> None:
    """The high-noise half alone (the low one as zeros) changes only what the high-noise
    steps compute: not the same as the pair, not the same as nothing."""
    import shutil

    only_high = lora_dir.parent / "only-high"
    only_high.mkdir()
    shutil.copy(lora_dir / PAIRS["lightning"][0], only_high / "lightning_high_noise.safetensors")
    from safetensors.torch import load_file, save_file

    low = load_file(lora_dir / PAIRS["lightning"][1])
    save_file({k: torch.zeros_like(v) for k, v in low.items()},
              only_high / "lightning_low_noise.safetensors")
    dit = TransformerAdapter.for_task(tiny_models / TASK, TASK,
                                      options=StageOptions(lora_dir=str(only_high)))
    dit.load()
    half = run(tiny_models, dit, [("lightning", 1.0)])
    full = TransformerAdapter.for_task(tiny_models / TASK, TASK,
                                       options=StageOptions(lora_dir=str(lora_dir)))
    full.load()
    pair = run(tiny_models, full, [("lightning", 1.0)])
    plain = run(tiny_models, full, [])
    assert float(np.abs(half - pair).max()) > 1e-3 and float(np.abs(half - plain).max()) > 1e-3


def test_a_fused_pair_equals_the_pair_per_request(tiny_models: Path, lora_dir: Path) -> None:
    fused = TransformerAdapter.for_task(tiny_models / TASK, TASK, options=StageOptions(
        lora_dir=str(lora_dir), lora_fuse=({"name": "lightning", "strength": 0.9},)))
    fused.load()
    per_request = TransformerAdapter.for_task(tiny_models / TASK, TASK,
                                              options=StageOptions(lora_dir=str(lora_dir)))
    per_request.load()
    req = small_request(TASK)
    cond = wire(stage("encoder", tiny_models, TASK).encode(req))
    merged = fused.denoise(req, cond)["latents"]
    asked = per_request.denoise(req.replace(loras=[{"name": "lightning", "strength": 0.9}]),
                                cond)["latents"]
    plain = per_request.denoise(req, cond)["latents"]
    assert float((merged - asked).norm() / asked.norm()) < 1e-5
    assert float((merged - plain).norm() / plain.norm()) > 1e-3
    assert "lightning" not in fused.offers()["loras"]


def test_unknown_pairs_and_caches_are_refused(tiny_models: Path, lora_dir: Path) -> None:
    dit = TransformerAdapter.for_task(tiny_models / TASK, TASK,
                                      options=StageOptions(lora_dir=str(lora_dir)))
    dit.load()
    req = small_request(TASK)
    cond = wire(stage("encoder", tiny_models, TASK).encode(req))
    with pytest.raises(AdapterError, match="no adapter 'lightning_high_noise'"):
        dit.denoise(req.replace(loras=[{"name": "lightning_high_noise", "strength": 1.0}]),
                    cond)
    assert dit.offers()["caches"] == []
    with pytest.raises(InvalidRequestError, match="step caches are not available on "
                                                  "wan22_a14b_t2v"):
        dit.denoise(req.replace(cache={"kind": "first_block_cache", "threshold": 0.05}), cond)


class _Handover:
    """Loop hooks of a split worker in one process: hand the state on as it is."""

    def __init__(self, resume: Any = None) -> None:
        self.resume = resume
        self.taken: Any = None

    def boundary(self, step: int, steps: int, snapshot: Callable[[], Any]) -> None:
        pass

    def hand_over(self, step: int, steps: int, snapshot: Callable[[], Any]) -> None:
        from contracts.errors import StageYielded

        self.taken = snapshot()
        raise StageYielded("handed over", step, steps, "handover")


def test_split_workers_each_load_their_half(tiny_models: Path, lora_dir: Path) -> None:
    """``split``: a ``high`` worker loads the high-noise half of each pair, a ``low`` worker
    the low-noise half; a request handed from one to the other equals diffusers' pair."""
    from contracts.errors import StageYielded

    high, low = (TransformerAdapter.for_task(tiny_models / TASK, TASK, options=StageOptions(
        lora_dir=str(lora_dir), experts=e)) for e in ("high", "low"))
    high.load()
    low.load()
    assert high.offers()["loras"] == low.offers()["loras"] == sorted([*PAIRS, "style"])
    loras = [("seko", 0.8), ("style", 0.5)]
    req = small_request(TASK, loras=[{"name": n, "strength": w} for n, w in loras])
    cond = wire(stage("encoder", tiny_models, TASK).encode(req))
    hooks = _Handover()
    with pytest.raises(StageYielded):
        high.denoise(req, cond, loop=hooks)
    latents = low.denoise(req, cond, loop=_Handover(resume=hooks.taken))
    ours = stage("decoder", tiny_models, TASK).decode_float(req, wire(latents))
    want = diffusers_reference(tiny_models, req, None, "float32",
                               setup=with_pairs(lora_dir, loras))
    assert float(np.abs(ours - want).max()) == 0.0
