"""Model folders in the layouts users have them (workers/models/layouts.py, convert.py): the
original Wan2.1 layout (T2V, I2V) and single-file DiTs (Qwen-Image, Wan; ComfyUI's and
diffusers' key names) give the pixels of the same weights in diffusers' layout; a folder in
no served layout is refused with what was found; ``--check`` reports the layout.

The tiny original-layout folders are written from tiny diffusers-layout ones through the
published key mappings (modelkit/original.py), never downloaded."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

torch.set_num_threads(1)

from contracts.config import ServiceConfig  # noqa: E402
from contracts.errors import ModelLoadError  # noqa: E402
from contracts.request import GenerationRequest  # noqa: E402
from workers.models.base import DecoderAdapter, EncoderAdapter, TransformerAdapter  # noqa: E402
from workers.models.components import check_stage_folder  # noqa: E402

pytestmark = pytest.mark.integration  # builds and runs the tiny models


def pixels(folder: Path, task: str, image: bytes | None = None, dtype: str = "float32",
           dit_file: Path | None = None) -> np.ndarray:
    """The three stages freshly loaded from ``folder``, one small request; float pixels."""
    extra: dict[str, Any] = {"num_frames": 5} if task.startswith("wan") else {}
    req = GenerationRequest(task=task, prompt="a cat in the snow", height=32, width=32,
                            infer_steps=2, seed=7, **extra)
    encoder = EncoderAdapter.for_task(folder, task, dtype=dtype)
    transformer = TransformerAdapter.for_task(folder, task, dtype=dtype)
    transformer.dit_file = None if dit_file is None else str(dit_file)
    decoder = DecoderAdapter.for_task(folder, task, dtype=dtype)
    for stage in (encoder, transformer, decoder):
        stage.load()
    latents = transformer.denoise(req, encoder.encode(req, image))
    out: np.ndarray = decoder.decode_float(req, latents)
    assert out.std() > 0.01, "degenerate output"
    return out


@pytest.mark.parametrize(("task", "dtype"), [("wan_t2v", "float32"), ("wan_t2v", "bfloat16"),
                                             ("wan_i2v", "float32")])
def test_original_wan_layout_gives_the_diffusers_layout_pixels(
        wan_pairs: Path, input_png: bytes, task: str, dtype: str) -> None:
    image = input_png if task == "wan_i2v" else None
    original = wan_pairs / f"{task}-original"
    found = check_stage_folder(original, task, "encoder")
    assert found.layout == "wan_original" and found.source is not None
    ours = pixels(original, task, image, dtype)
    reference = pixels(wan_pairs / f"{task}-diffusers", task, image, dtype)
    assert float(np.abs(ours - reference).max()) == 0.0


def _folder_without_dit(src: Path, dst: Path) -> Path:
    """``src`` with its DiT's weights gone (its config kept): a single file must bring them."""
    dst.mkdir()
    for entry in src.iterdir():
        if entry.name != "transformer":
            (dst / entry.name).symlink_to(entry)
    (dst / "transformer").mkdir()
    shutil.copy(src / "transformer" / "config.json", dst / "transformer")
    return dst


@pytest.mark.parametrize("names", ["comfyui", "diffusers"])
def test_qwen_single_file_dit_gives_the_folder_pixels(tiny_models: Path, tmp_path: Path,
                                                      names: str) -> None:
    from modelkit.original import write_single_file_dit

    src = tiny_models / "qwen_t2i"
    dit = write_single_file_dit(src, tmp_path / "dit.safetensors", names)
    folder = _folder_without_dit(src, tmp_path / "folder")
    found = check_stage_folder(folder, "qwen_t2i", "transformer", dit)
    assert found.layout == "diffusers + single-file DiT"
    with pytest.raises(ModelLoadError, match="incomplete"):  # no DiT without the file
        check_stage_folder(folder, "qwen_t2i", "transformer")
    ours = pixels(folder, "qwen_t2i", dit_file=dit)
    assert float(np.abs(ours - pixels(src, "qwen_t2i")).max()) == 0.0


def test_wan_single_file_dits(wan_pairs: Path, tmp_path: Path) -> None:
    """A ComfyUI Wan DiT file on a diffusers folder, and an original-names one on an
    original folder, through diffusers' Wan converter."""
    from modelkit.original import write_single_file_dit

    src = wan_pairs / "wan_t2v-diffusers"
    reference = pixels(src, "wan_t2v")
    comfy = write_single_file_dit(src, tmp_path / "comfy.safetensors", "comfyui")
    folder = _folder_without_dit(src, tmp_path / "folder")
    assert float(np.abs(pixels(folder, "wan_t2v", dit_file=comfy) - reference).max()) == 0.0
    plain = write_single_file_dit(src, tmp_path / "original.safetensors", "original")
    on_original = pixels(wan_pairs / "wan_t2v-original", "wan_t2v", dit_file=plain)
    assert float(np.abs(on_original - reference).max()) == 0.0


def test_a_folder_in_no_served_layout_is_refused_naming_what_was_found(
        tmp_path: Path, wan_pairs: Path) -> None:
    odd = tmp_path / "odd"
    (odd / "unet").mkdir(parents=True)
    (odd / "model.ckpt").write_bytes(b"x")
    with pytest.raises(ModelLoadError) as err:
        check_stage_folder(odd, "wan_t2v", "transformer")
    text = str(err.value)
    assert f"model folder {odd} is in no layout diffring serves: found model.ckpt, unet/" in text
    assert "the original Wan2.1 layout" in text and "dit_original_ckpt" in text
    # An original folder missing a file names it.
    broken = tmp_path / "broken"
    shutil.copytree(wan_pairs / "wan_i2v-original", broken)
    (broken / "Wan2.1_VAE.pth").unlink()
    with pytest.raises(ModelLoadError, match=r"original Wan2.1 layout \(I2V\) but lacks "
                                             r"Wan2.1_VAE.pth"):
        check_stage_folder(broken, "wan_i2v", "decoder")
    # And the original layout of one task under the other is the usual refusal, naming the
    # start script that serves it (LightX2V starts an Edit-2511 folder with its i2i script).
    with pytest.raises(ModelLoadError, match=r"is a WanImageToVideoPipeline checkpoint .* "
                       r"started by scripts/server/disagg/wan/start_wan_i2v_disagg.sh"):
        check_stage_folder(wan_pairs / "wan_i2v-original", "wan_t2v", "encoder")


def test_check_reports_the_layout(wan_pairs: Path, tmp_path: Path) -> None:
    from doctor import run_checks

    def checks(folder: Path) -> dict[str, Any]:
        cfg = ServiceConfig.from_dict({"model_cls": "wan2.1", "task": "i2v",
                                       "model_path": str(folder)})
        return {c.name: c for c in run_checks("encoder", cfg, "t" * 32, {})}

    found = checks(wan_pairs / "wan_i2v-original")
    assert found["layout"].status == "ok" and "wan_original layout" in found["layout"].detail
    assert found["model (encoder)"].status == "ok"
    (tmp_path / "notes.txt").write_text("x")
    refused = checks(tmp_path)
    assert refused["checkpoint"].status == "fail"
    assert "in no layout diffring serves: found notes.txt" in refused["checkpoint"].detail
