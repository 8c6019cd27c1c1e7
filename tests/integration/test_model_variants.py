"""ModelFolder variants against diffusers' own pipelines, on tiny random-weight folders.

* Qwen-Image-Edit-2511 (``qwen_i2i_plus``: QwenImageEditPlusPipeline, ``zero_cond_t``) with
  two input images (one image: ``test_models.test_stages_match_diffusers_pipeline``), the
  output size of the last image, and its 2509 sibling (``zero_cond_t`` off).
* Qwen-Image-2512 and Wan2.1-I2V-14B-720P: the fields of their published configs that are
  not sizes change nothing the stages do; tiny folders carrying those fields give diffusers'
  pixels with the stages unchanged (docs/models.md lists the fields).

The folders' classes are checked against the task at load (``tests/unit/test_model_folder.py``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

torch.set_num_threads(1)

from contracts.input_images import pack_images  # noqa: E402
from contracts.request import GenerationRequest  # noqa: E402
from tests.support.models import (  # noqa: E402
    ADAPTERS,
    diffusers_reference,
    small_request,
    stage,
    wire,
)
from workers.models.model_folder import check_model_folder  # noqa: E402

pytestmark = pytest.mark.integration  # builds and runs the tiny models

PLUS = "qwen_i2i_plus"
_ENCODED: dict[tuple[bytes, ...], dict[str, torch.Tensor]] = {}


def encoded(models: Path, images: tuple[bytes, ...]) -> dict[str, torch.Tensor]:
    """The EditPlus encoder's outputs for ``images`` (cached: they depend on the images and
    the prompts only, not on the output size)."""
    if images not in _ENCODED:
        enc = stage("encoder", models, PLUS)
        _ENCODED[images] = wire(enc.encode(small_request(PLUS), pack_images(images)))
    return _ENCODED[images]


def variant(src: Path, dst: Path, patches: Mapping[str, Mapping[str, Any]]) -> Path:
    """A folder that is ``src`` (symlinked) except for the JSON files in ``patches``
    (relative path -> keys to set; a value of None is written as JSON null)."""
    dst.mkdir()
    patched_dirs = {Path(rel).parent for rel in patches if Path(rel).parent != Path(".")}
    for entry in src.iterdir():
        rel = Path(entry.name)
        if rel in patched_dirs:
            (dst / rel).mkdir()
            for inner in entry.iterdir():
                if str(rel / inner.name) not in patches:
                    (dst / rel / inner.name).symlink_to(inner)
        elif entry.name not in patches:
            (dst / rel).symlink_to(entry)
    for rel, keys in patches.items():
        data = json.loads((src / rel).read_text())
        data.update(keys)
        (dst / rel).write_text(json.dumps(data, indent=2))
    return dst


def run_stages(folder: Path, task: str, req: GenerationRequest,
               image: bytes | None = None) -> np.ndarray:
    """Encoder, DiT and decoder freshly loaded from ``folder``; float32 pixels."""
    loaded = {}
    for kind, cls in ADAPTERS.items():
        loaded[kind] = cls.for_task(folder, task)
        loaded[kind].load()
    cond = loaded["encoder"].encode(req, image)
    latents = loaded["transformer"].denoise(req, wire(cond))
    out: np.ndarray = loaded["decoder"].decode_float(req, wire(latents))
    return out


# -- Qwen-Image-Edit-2511 / 2509 ---------------------------------------------------------------
def test_edit_plus_two_images_match_diffusers(tiny_models: Path, input_png: bytes,
                                              input_png_2: bytes) -> None:
    """Two pictures through the three stages (over the wire) == QwenImageEditPlusPipeline
    with the same two images, pixel for pixel (zero_cond_t on: the 2511 folder)."""
    assert check_model_folder(tiny_models / PLUS, PLUS).variant.startswith("zero_cond_t ")
    req = small_request(PLUS)
    cond = encoded(tiny_models, (input_png, input_png_2))
    one = encoded(tiny_models, (input_png,))
    assert set(cond) == set(one) | {"image_latents_2"}
    # Each picture at its own ~1 megapixel size: 40x48 -> 928x1120, 64x40 -> 1280x800.
    assert tuple(cond["image_latents"].shape[-2:]) == (1120 // 8, 928 // 8)
    assert tuple(cond["image_latents_2"].shape[-2:]) == (800 // 8, 1280 // 8)
    # "Picture 2: <image>" makes the prompt longer than with one picture.
    assert cond["prompt_embeds"].shape[1] > one["prompt_embeds"].shape[1]
    latents = stage("transformer", tiny_models, PLUS).denoise(req, cond)
    decoder = stage("decoder", tiny_models, PLUS)
    ours = decoder.decode_float(req, wire(latents))
    reference = diffusers_reference(tiny_models, req, [input_png, input_png_2], "float32")
    assert ours.shape == reference.shape == (32, 32, 3)
    assert float(np.abs(ours - reference).max()) == 0.0
    assert decoder.decode(req, wire(latents)).frames.std() > 1.0, "degenerate output"
    # The second picture counts: the same request with one picture gives other latents.
    single = stage("transformer", tiny_models, PLUS).denoise(req, one)["latents"]
    assert not torch.equal(single, latents["latents"])


def test_edit_plus_size_defaults_to_the_last_image(tiny_models: Path, input_png: bytes,
                                                   input_png_2: bytes) -> None:
    """Without a size the output is ~1 megapixel at the last picture's aspect (diffusers:
    ``image[-1]``); the first picture's is 928x1120."""
    req = small_request(PLUS, height=None, width=None)
    cond = encoded(tiny_models, (input_png, input_png_2))
    latents = stage("transformer", tiny_models, PLUS).denoise(req, cond)["latents"]
    assert tuple(latents.shape) == (1, 16, 1, 800 // 8, 1280 // 8)


def test_edit_2509_style_matches_diffusers(tiny_models: Path, input_png: bytes,
                                           tmp_path: Path) -> None:
    """The 2509 checkpoint is the same pipeline with zero_cond_t off (no other weights):
    served as qwen_i2i_plus, diffusers' pixels, and other latents than 2511's."""
    folder = variant(tiny_models / PLUS, tmp_path / "edit-2509",
                     {"transformer/config.json": {"zero_cond_t": False}})
    assert "2509" in check_model_folder(folder, PLUS).describe()
    req = small_request(PLUS)
    ours = run_stages(folder, PLUS, req, input_png)
    reference = diffusers_reference(tiny_models, req, [input_png], "float32", folder=folder)
    assert float(np.abs(ours - reference).max()) == 0.0
    cond = encoded(tiny_models, (input_png,))
    dit_2509 = ADAPTERS["transformer"].for_task(folder, PLUS)
    dit_2509.load()
    a = dit_2509.denoise(req, cond)["latents"]
    b = stage("transformer", tiny_models, PLUS).denoise(req, cond)["latents"]
    assert not torch.equal(a, b), "zero_cond_t made no difference: the test would prove little"


# -- Qwen-Image-2512 and Wan2.1-I2V-14B-720P ---------------------------------------------------
# The fields of the published configs that are not sizes (docs/models.md says where each
# value comes from). Sizes stay the tiny models'.
QWEN_IMAGE_2512 = {
    "model_index.json": {"_class_name": "QwenImagePipeline"},
    "transformer/config.json": {"_class_name": "QwenImageTransformer2DModel",
                                "guidance_embeds": False, "zero_cond_t": False,
                                "use_additional_t_cond": False, "use_layer3d_rope": False},
    "scheduler/scheduler_config.json": {
        "_class_name": "FlowMatchEulerDiscreteScheduler", "use_dynamic_shifting": True,
        "base_shift": 0.5, "max_shift": 0.9, "base_image_seq_len": 256,
        "max_image_seq_len": 8192, "shift": 1.0, "shift_terminal": 0.02,
        "time_shift_type": "exponential", "num_train_timesteps": 1000,
    },
}
WAN_I2V_720P = {
    "model_index.json": {"_class_name": "WanImageToVideoPipeline"},
    "transformer/config.json": {"_class_name": "WanTransformer3DModel", "in_channels": 36,
                                "pos_embed_seq_len": None, "rope_max_seq_len": 1024,
                                "qk_norm": "rms_norm_across_heads", "cross_attn_norm": True},
    # 720P: the shift diffusers' documentation sets for 720p (the folder's value is what
    # every stage and diffusers read; 3.0, the 480p one, is what the tiny folder has).
    "scheduler/scheduler_config.json": {"_class_name": "UniPCMultistepScheduler",
                                        "flow_shift": 5.0, "prediction_type": "flow_prediction",
                                        "use_flow_sigmas": True},
}


@pytest.mark.parametrize(("task", "patches"), [("qwen_t2i", QWEN_IMAGE_2512),
                                               ("wan_i2v", WAN_I2V_720P)],
                         ids=["Qwen-Image-2512", "Wan2.1-I2V-14B-720P"])
def test_published_configs_need_nothing_new(tiny_models: Path, input_png: bytes,
                                            tmp_path: Path, task: str,
                                            patches: Mapping[str, Mapping[str, Any]]) -> None:
    folder = variant(tiny_models / task, tmp_path / task, patches)
    check_model_folder(folder, task)  # served as the family's pipeline
    req = small_request(task)
    image = input_png if task == "wan_i2v" else None
    ours = run_stages(folder, task, req, image)
    reference = diffusers_reference(tiny_models, req, image, "float32", folder=folder)
    assert float(np.abs(ours - reference).max()) == 0.0
    if task == "wan_i2v":  # the folder's scheduler is the one used: 5.0 is not 3.0
        assert not np.array_equal(ours, diffusers_reference(tiny_models, req, image,
                                                            "float32"))
