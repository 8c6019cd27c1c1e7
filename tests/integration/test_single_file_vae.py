"""``vae_path`` (LightX2V's key): a VAE loaded instead of the model folder's own -- a single
file in the original Wan VAE names (``Wan2.1_VAE.pth``, ComfyUI's VAE files) or diffusers'
names, through diffusers' Wan VAE converter, for Wan2.1 and for Qwen-Image (whose VAE has
the same parameter names), or a diffusers VAE folder -- gives the pixels of the same weights
in the folder; what is refused says why.

The single files are written from tiny diffusers-layout folders through the published key
mapping (modelkit/original.py, checked against diffusers' converter), never downloaded."""

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
from workers.models import LocalPipeline  # noqa: E402
from workers.models.components import check_stage_folder  # noqa: E402

pytestmark = pytest.mark.integration  # builds and runs the tiny models


def pixels(folder: Path, task: str, vae: Path | None = None, image: bytes | None = None,
           **fields: Any) -> np.ndarray:
    """The three stages freshly loaded from ``folder`` (with ``vae_path``), one small
    request; float pixels."""
    extra: dict[str, Any] = {"num_frames": 5} if task.startswith("wan") else {}
    req = GenerationRequest(task=task, prompt="a cat in the snow", height=32, width=32,
                            infer_steps=2, seed=7, **extra, **fields)
    pipe = LocalPipeline(folder, task, vae_file=None if vae is None else str(vae))
    pipe.load()
    latents = pipe.transformer.denoise(req, pipe.encoder.encode(req, image))
    out: np.ndarray = pipe.decoder.decode_float(req, latents)
    assert out.std() > 0.01, "degenerate output"
    return out


def without_vae_weights(src: Path, dst: Path, keep_config: bool = True) -> Path:
    """``src`` with its VAE's weights gone (its config kept, or not): ``vae_path`` must
    bring them."""
    dst.mkdir()
    for entry in src.iterdir():
        if entry.name not in ("vae", "Wan2.1_VAE.pth"):
            (dst / entry.name).symlink_to(entry.resolve())
    if keep_config and (src / "vae").is_dir():
        (dst / "vae").mkdir()
        shutil.copy(src / "vae" / "config.json", dst / "vae")
    return dst


@pytest.fixture(scope="module")
def qwen_published(tiny_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from modelkit.original import build_qwen_published_vae

    return build_qwen_published_vae(tiny_models / "qwen_t2i",
                                    tmp_path_factory.mktemp("qwen-vae") / "qwen_t2i")


def test_the_two_vae_classes_share_their_parameter_names(qwen_published: Path) -> None:
    """What reading a Qwen-Image VAE file through the Wan VAE's converter rests on."""
    from diffusers import AutoencoderKLQwenImage, AutoencoderKLWan

    qwen = AutoencoderKLQwenImage.from_pretrained(qwen_published / "vae")
    cfg = qwen.config
    wan = AutoencoderKLWan(base_dim=cfg.base_dim, z_dim=cfg.z_dim, dim_mult=cfg.dim_mult,
                           num_res_blocks=cfg.num_res_blocks, attn_scales=cfg.attn_scales,
                           temperal_downsample=cfg.temperal_downsample)
    shapes = {k: tuple(v.shape) for k, v in qwen.state_dict().items()}
    assert shapes == {k: tuple(v.shape) for k, v in wan.state_dict().items()}


@pytest.mark.parametrize("form", ["original.safetensors", "original.pth",
                                  "diffusers.safetensors", "folder"])
def test_qwen_vae_path_gives_the_folder_pixels(qwen_published: Path, input_png: bytes,
                                               tmp_path: Path, form: str) -> None:
    """Text-to-image (the decoder's VAE) and image-to-image (the encoder's, on demand)."""
    from modelkit.original import write_single_file_vae

    if form == "folder":  # LightX2V's Qwen-Image meaning of vae_path
        vae = qwen_published / "vae"
    else:
        names, suffix = form.split(".")
        vae = write_single_file_vae(qwen_published, tmp_path / f"vae.{suffix}", names)
    folder = without_vae_weights(qwen_published, tmp_path / "folder")
    found = check_stage_folder(folder, "qwen_t2i", "decoder", None, vae)
    assert found.layout == "diffusers + VAE from vae_path"
    with pytest.raises(ModelLoadError, match="'vae' component is incomplete"):
        check_stage_folder(folder, "qwen_t2i", "decoder")  # no VAE without it
    for fields, image in (({}, None), ({"i2i_denoise_strength": 0.5}, input_png)):
        ours = pixels(folder, "qwen_t2i", vae, image, **fields)
        reference = pixels(qwen_published, "qwen_t2i", None, image, **fields)
        assert float(np.abs(ours - reference).max()) == 0.0, fields


@pytest.mark.parametrize("task", ["wan_t2v", "wan_i2v"])
def test_wan_vae_path_gives_the_folder_pixels(wan_pairs: Path, input_png: bytes,
                                              tmp_path: Path, task: str) -> None:
    """An original-names ``.pth`` (as ``Wan2.1_VAE.pth``) on a diffusers folder without VAE
    weights, and an original-names ``.safetensors`` (as ComfyUI's) on an original folder
    without ``Wan2.1_VAE.pth``: the diffusers folder's pixels (I2V: the encoder's VAE too)."""
    from modelkit.original import write_single_file_vae

    src = wan_pairs / f"{task}-diffusers"
    image = input_png if task == "wan_i2v" else None
    reference = pixels(src, task, None, image)
    pth = write_single_file_vae(src, tmp_path / "Wan2.1_VAE.pth")
    folder = without_vae_weights(src, tmp_path / "diffusers")
    assert float(np.abs(pixels(folder, task, pth, image) - reference).max()) == 0.0
    comfy = write_single_file_vae(src, tmp_path / "wan_2.1_vae.safetensors")
    original = without_vae_weights(wan_pairs / f"{task}-original", tmp_path / "original")
    found = check_stage_folder(original, task, "decoder", None, comfy)
    assert found.layout == "wan_original + VAE from vae_path"
    assert float(np.abs(pixels(original, task, comfy, image) - reference).max()) == 0.0


def test_vae_path_refusals(qwen_published: Path, tmp_path: Path) -> None:
    from modelkit.original import write_single_file_vae

    with pytest.raises(ModelLoadError, match=r"vae_path .* does not exist"):
        check_stage_folder(qwen_published, "qwen_t2i", "decoder", None, tmp_path / "nope.pth")
    vae = write_single_file_vae(qwen_published, tmp_path / "vae.safetensors")
    bare = without_vae_weights(qwen_published, tmp_path / "bare", keep_config=False)
    with pytest.raises(ModelLoadError, match="needs the VAE's config"):
        check_stage_folder(bare, "qwen_t2i", "decoder", None, vae)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match=r"folder without config\.json"):
        check_stage_folder(qwen_published, "qwen_t2i", "decoder", None, empty)
    # A file of another model: the strict load names what does not fit.
    from modelkit.original import write_single_file_dit

    dit = write_single_file_dit(qwen_published, tmp_path / "dit.safetensors", "diffusers")
    folder = without_vae_weights(qwen_published, tmp_path / "folder")
    with pytest.raises(ModelLoadError, match="do not fit AutoencoderKLQwenImage"):
        pixels(folder, "qwen_t2i", dit)


def test_check_reports_the_vae(qwen_published: Path, tmp_path: Path) -> None:
    from doctor import run_checks
    from modelkit.original import write_single_file_vae

    vae = write_single_file_vae(qwen_published, tmp_path / "vae.safetensors")
    folder = without_vae_weights(qwen_published, tmp_path / "folder")
    cfg = ServiceConfig.from_dict({"model_cls": "qwen_image", "task": "t2i",
                                   "model_path": str(folder), "vae_path": str(vae)})
    found = {c.name: c for c in run_checks("decoder", cfg, "t" * 32, {})}
    assert "VAE from vae_path" in found["layout"].detail
    assert found["model (decoder)"].status == "ok"
