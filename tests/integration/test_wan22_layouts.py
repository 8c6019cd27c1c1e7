"""The original Wan2.2-A14B layout (workers/models/layouts.py): T2V and I2V folders with
``high_noise_model/`` and ``low_noise_model/`` give the pixels of the same weights in
diffusers' layout, both experts running at the published boundary; a half folder is refused
naming what it lacks. The original TI2V-5B layout (its DiT at the top, ``Wan2.2_VAE.pth``)
likewise, for both of its tasks.

The tiny original folders are written from tiny diffusers-layout ones through the published
key mappings (modelkit/original.py ``build_wan22_pair``), never downloaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

torch.set_num_threads(1)

from contracts.errors import ModelLoadError  # noqa: E402
from tests.support.models import small_request  # noqa: E402
from workers.models.base import DecoderAdapter, EncoderAdapter, TransformerAdapter  # noqa: E402
from workers.models.components import check_stage_folder  # noqa: E402

pytestmark = pytest.mark.integration  # builds and runs the tiny models


def pixels(folder: Path, task: str, image: bytes | None, dtype: str = "float32"
           ) -> tuple[np.ndarray, list[str | None]]:
    """The three stages freshly loaded from ``folder``, one small request (three steps: the
    boundary falls inside them); float pixels and the expert of each step."""
    req = small_request(task)
    encoder = EncoderAdapter.for_task(folder, task, dtype=dtype)
    transformer = TransformerAdapter.for_task(folder, task, dtype=dtype)
    decoder = DecoderAdapter.for_task(folder, task, dtype=dtype)
    for stage in (encoder, transformer, decoder):
        stage.load()
    experts: list[str | None] = []
    latents = transformer.denoise(req, encoder.encode(req, image),
                                  on_step=lambda k, n: experts.append(transformer.active_expert))
    out: np.ndarray = decoder.decode_float(req, latents)
    assert out.std() > 0.01, "degenerate output"
    return out, experts


@pytest.mark.parametrize("task", ["wan22_a14b_t2v", "wan22_a14b_i2v"])
def test_original_wan22_a14b_layout_gives_the_diffusers_layout_pixels(
        wan22_pairs: Path, input_png: bytes, task: str) -> None:
    image = input_png if task.endswith("i2v") else None
    original = wan22_pairs / f"{task}-original"
    found = check_stage_folder(original, task, "transformer")
    assert found.layout == "wan22_original" and found.source is not None
    boundary = 0.9 if task.endswith("i2v") else 0.875
    assert found.variant == f"two experts, boundary_ratio {boundary}"
    view = json.loads((found.source / "scheduler" / "scheduler_config.json").read_text())
    assert view["flow_shift"] == (5.0 if task.endswith("i2v") else 12.0)
    ours, experts = pixels(original, task, image)
    reference, want = pixels(wan22_pairs / f"{task}-diffusers", task, image)
    assert experts == want == ["high", "high", "low"]
    assert float(np.abs(ours - reference).max()) == 0.0


def test_a_half_wan22_folder_is_refused_naming_what_it_lacks(
        wan22_pairs: Path, tmp_path: Path) -> None:
    task = "wan22_a14b_t2v"
    half = tmp_path / "half"
    shutil.copytree(wan22_pairs / f"{task}-original", half)
    shutil.rmtree(half / "low_noise_model")
    with pytest.raises(ModelLoadError, match=r"original Wan2.2-A14B layout but lacks "
                                             r"low_noise_model/config.json$"):
        check_stage_folder(half, task, "transformer")
    shutil.copytree(wan22_pairs / f"{task}-original" / "low_noise_model",
                    half / "low_noise_model")
    (half / "Wan2.1_VAE.pth").unlink()
    (half / "low_noise_model" / "diffusion_pytorch_model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"lacks Wan2.1_VAE.pth"):
        check_stage_folder(half, task, "decoder")
    shutil.copy(wan22_pairs / f"{task}-original" / "Wan2.1_VAE.pth", half)
    with pytest.raises(ModelLoadError, match=r"low_noise_model: 1 DiT shard\(s\) listed in "
                       r"diffusion_pytorch_model.safetensors.index.json missing"):
        check_stage_folder(half, task, "transformer")
    # The T2V experts under the I2V task: the usual refusal, naming the row that serves them.
    with pytest.raises(ModelLoadError, match=r"served by diffring as wan22_a14b_t2v"):
        check_stage_folder(wan22_pairs / f"{task}-original", "wan22_a14b_i2v", "encoder")


@pytest.mark.parametrize(("task", "dtype"), [("wan22_5b_t2v", "float32"),
                                             ("wan22_5b_t2v", "bfloat16"),
                                             ("wan22_5b_i2v", "float32")])
def test_original_ti2v_5b_layout_gives_the_diffusers_layout_pixels(
        wan22_pairs: Path, input_png: bytes, task: str, dtype: str) -> None:
    """One original folder serves both TI2V-5B tasks; its Wan2.2_VAE.pth goes through
    diffring's key map (workers/models/wan22_vae.py), the encoder's VAE for I2V too."""
    image = input_png if task.endswith("i2v") else None
    original = wan22_pairs / "wan22_5b-original"
    found = check_stage_folder(original, task, "decoder")
    assert found.layout == "wan22_original" and found.source is not None
    assert found.variant == "expand_timesteps (TI2V-5B)"
    ours, experts = pixels(original, task, image, dtype)
    reference, _ = pixels(wan22_pairs / "wan22_5b-diffusers", task, image, dtype)
    assert experts == [None] * 3
    assert float(np.abs(ours - reference).max()) == 0.0


def test_a_half_ti2v_5b_folder_is_refused_naming_what_it_lacks(
        wan22_pairs: Path, tmp_path: Path) -> None:
    half = tmp_path / "half"
    shutil.copytree(wan22_pairs / "wan22_5b-original", half)
    (half / "Wan2.2_VAE.pth").unlink()
    with pytest.raises(ModelLoadError, match=r"original Wan2.2-TI2V-5B layout but lacks "
                                             r"Wan2.2_VAE.pth$"):
        check_stage_folder(half, "wan22_5b_t2v", "decoder")
    # A foreign tensor in the VAE file is named, not dropped.
    vae = torch.load(wan22_pairs / "wan22_5b-original" / "Wan2.2_VAE.pth")
    torch.save({**vae, "decoder.extra.weight": torch.zeros(1)}, half / "Wan2.2_VAE.pth")
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'decoder.extra.weight' in "
                                             r"the Wan2.2 VAE checkpoint"):
        DecoderAdapter.for_task(half, "wan22_5b_t2v").load()


@pytest.mark.parametrize(("model_cls", "task", "folder"), [
    ("wan2.2_moe", "i2v", "wan22_a14b_i2v-original"), ("wan2.2", "t2v", "wan22_5b-original")])
def test_check_reports_the_wan22_original_layout(wan22_pairs: Path, model_cls: str, task: str,
                                                 folder: str) -> None:
    """``--check`` (LightX2V's model_cls and task) on the original folders: the layout line
    names it, the stage's model check passes."""
    from contracts.config import ServiceConfig
    from doctor import run_checks

    cfg = ServiceConfig.from_dict({"model_cls": model_cls, "task": task,
                                   "model_path": str(wan22_pairs / folder)})
    found = {c.name: c for c in run_checks("decoder", cfg, "t" * 32, {})}
    assert found["layout"].status == "ok", found["layout"]
    assert "wan22_original layout" in found["layout"].detail
    assert found["model (decoder)"].status == "ok", found["model (decoder)"]


def test_swap_on_the_original_a14b_layout(wan22_pairs: Path) -> None:
    """``transformer.experts: swap`` reads both converted experts (the low-noise one into
    host memory): the latents of ``both`` on the diffusers folder."""
    from contracts.stage_options import StageOptions

    task = "wan22_a14b_t2v"
    req = small_request(task)
    encoder = EncoderAdapter.for_task(wan22_pairs / f"{task}-diffusers", task)
    encoder.load()
    cond = encoder.encode(req, None)
    swap: Any = TransformerAdapter.for_task(wan22_pairs / f"{task}-original", task,
                                            options=StageOptions(experts="swap"))
    both = TransformerAdapter.for_task(wan22_pairs / f"{task}-diffusers", task)
    for dit in (swap, both):
        dit.load()
    got = swap.denoise(req, dict(cond))["latents"]
    assert swap.experts.moves == 2
    assert torch.equal(got, both.denoise(req, dict(cond))["latents"])
