"""The model-folder class check (workers/models/model_folder.py): each folder a task does not
serve is refused, before any weight is read, with an error naming the class, what serves it
and what to change. JSON files only: no model library, no process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from contracts.errors import ModelLoadError
from contracts.pipelines import TASK_SPECS, served_classes
from workers.models.components import STAGE_COMPONENTS, check_stage_folder
from workers.models.model_folder import check_model_folder

QWEN_DIT = {"_class_name": "QwenImageTransformer2DModel", "zero_cond_t": False}
WAN_T2V_DIT = {"_class_name": "WanTransformer3DModel", "image_dim": None}
WAN_I2V_DIT = {"_class_name": "WanTransformer3DModel", "image_dim": 1280,
               "pos_embed_seq_len": None}


def folder(tmp_path: Path, index: dict[str, Any] | None, dit: dict[str, Any] | None,
           name: str = "model") -> Path:
    root = tmp_path / name
    root.mkdir()
    if index is not None:
        (root / "model_index.json").write_text(json.dumps(index))
    if dit is not None:
        (root / "transformer").mkdir()
        (root / "transformer" / "config.json").write_text(json.dumps(dit))
    return root


def refused(root: Path, task: str) -> str:
    with pytest.raises(ModelLoadError) as info:
        check_model_folder(root, task)
    return str(info.value)


DITS = {"wan_t2v": WAN_T2V_DIT, "wan_i2v": WAN_I2V_DIT, "qwen_t2i": QWEN_DIT,
        "qwen_i2i": QWEN_DIT, "qwen_i2i_plus": {**QWEN_DIT, "zero_cond_t": True}}


@pytest.mark.parametrize("task", sorted(DITS))
def test_each_served_class_loads_under_its_task(tmp_path: Path, task: str) -> None:
    cls = TASK_SPECS[task].pipeline_class
    found = check_model_folder(folder(tmp_path, {"_class_name": cls}, DITS[task]), task)
    assert found.pipeline_class == cls
    # ... and under no other task.
    for other in DITS:
        if other != task:
            assert f"is a {cls} checkpoint" in refused(
                folder(tmp_path, {"_class_name": cls}, None, other), other)


def test_served_classes_are_one_per_pipeline() -> None:
    assert served_classes() == {
        "WanPipeline": TASK_SPECS["wan_t2v"], "WanImageToVideoPipeline": TASK_SPECS["wan_i2v"],
        "QwenImagePipeline": TASK_SPECS["qwen_t2i"],
        "QwenImageEditPipeline": TASK_SPECS["qwen_i2i"],
        "QwenImageEditPlusPipeline": TASK_SPECS["qwen_i2i_plus"],
    }


def test_unserved_class_names_itself_and_what_is_served(tmp_path: Path) -> None:
    message = refused(folder(tmp_path, {"_class_name": "FluxPipeline"}, None), "qwen_t2i")
    assert "is a FluxPipeline checkpoint (model_index.json), which diffring does not serve" \
        in message
    for cls, spec in served_classes().items():
        assert f"{cls} ({spec.name})" in message
    assert "Point model_path at a QwenImagePipeline folder" in message


def test_edit_2511_folder_under_the_first_edit_says_what_to_set(tmp_path: Path) -> None:
    root = folder(tmp_path, {"_class_name": "QwenImageEditPlusPipeline"},
                  {**QWEN_DIT, "zero_cond_t": True})
    message = refused(root, "qwen_i2i")
    assert "is a QwenImageEditPlusPipeline checkpoint" in message
    assert "served by diffring as qwen_i2i_plus (model_cls 'qwen_image', task 'i2i_plus')" \
        in message
    assert "configured for qwen_i2i, which serves QwenImageEditPipeline folders" in message
    assert "Set task to 'i2i_plus'" in message
    assert check_model_folder(root, "qwen_i2i_plus").describe() == (
        "QwenImageEditPlusPipeline: zero_cond_t (Qwen-Image-Edit-2511 style)")
    # The other way round: the first Edit's folder is not an EditPlus one.
    first = folder(tmp_path, {"_class_name": "QwenImageEditPipeline"}, QWEN_DIT, "edit")
    assert "Set task to 'i2i'" in refused(first, "qwen_i2i_plus")


def test_2509_is_edit_plus_with_zero_cond_t_off(tmp_path: Path) -> None:
    root = folder(tmp_path, {"_class_name": "QwenImageEditPlusPipeline"}, QWEN_DIT)
    assert "2509" in check_model_folder(root, "qwen_i2i_plus").describe()


@pytest.mark.parametrize("index", [None, {"_class_name": "QwenImageEditPipeline"}])
def test_a_2511_dit_is_refused_outside_edit_plus(tmp_path: Path, index: Any) -> None:
    """By the DiT's config alone too: a stage's own copy of its components has no model
    index, and a hand-made Edit folder may carry a 2511 DiT."""
    root = folder(tmp_path, index, {**QWEN_DIT, "zero_cond_t": True})
    message = refused(root, "qwen_i2i")
    assert "sets zero_cond_t (a Qwen-Image-Edit-2511 DiT" in message
    assert "diffring's qwen_i2i_plus (task 'i2i_plus')" in message


@pytest.mark.parametrize("key", ["use_additional_t_cond", "use_layer3d_rope"])
def test_layered_dit_is_refused(tmp_path: Path, key: str) -> None:
    root = folder(tmp_path, {"_class_name": "QwenImagePipeline"}, {**QWEN_DIT, key: True})
    assert f"sets {key} (a Qwen-Image-Layered DiT)" in refused(root, "qwen_t2i")


@pytest.mark.parametrize(("index", "message"), [
    ({"transformer_2": ["diffusers", "WanTransformer3DModel"]},
     "two-expert (Wan2.2-A14B) WanPipeline checkpoint (model_index.json), served by diffring "
     "as wan22_a14b_t2v"),
    ({"boundary_ratio": 0.875}, "two-expert (Wan2.2-A14B)"),
    ({"expand_timesteps": True}, "expand_timesteps (Wan2.2-TI2V-5B) WanPipeline checkpoint "
     "(model_index.json), served by diffring as wan22_5b_t2v"),
])
def test_wan22_folders_are_other_pipelines(tmp_path: Path, index: dict[str, Any],
                                           message: str) -> None:
    """A Wan2.2 folder names Wan2.1's pipeline class: its model index tells the rows apart
    (the Wan2.2 rows themselves: tests/unit/test_wan22_contracts.py)."""
    root = folder(tmp_path, {"_class_name": "WanPipeline", "transformer_2": [None, None],
                             **index}, WAN_T2V_DIT)
    assert message in refused(root, "wan_t2v")


def test_wan_dit_of_the_other_task_or_flf2v_is_refused(tmp_path: Path) -> None:
    assert "is a T2V DiT, but the task is wan_i2v" in refused(
        folder(tmp_path, None, WAN_T2V_DIT, "t2v"), "wan_i2v")
    assert "is an I2V DiT, but the task is wan_t2v" in refused(
        folder(tmp_path, None, WAN_I2V_DIT, "i2v"), "wan_t2v")
    flf2v = folder(tmp_path, {"_class_name": "WanImageToVideoPipeline"},
                   {**WAN_I2V_DIT, "pos_embed_seq_len": 514}, "flf2v")
    assert "first-last-frame DiT" in refused(flf2v, "wan_i2v")


def test_dit_of_another_family_and_broken_files(tmp_path: Path) -> None:
    root = folder(tmp_path, {"_class_name": "QwenImagePipeline"},
                  {"_class_name": "FluxTransformer2DModel"})
    assert "is a FluxTransformer2DModel, but qwen_t2i runs a QwenImageTransformer2DModel" \
        in refused(root, "qwen_t2i")
    nameless = folder(tmp_path, {"scheduler": ["diffusers", "X"]}, None, "nameless")
    assert "model_index.json names no pipeline class (_class_name)" in refused(
        nameless, "qwen_t2i")
    broken = folder(tmp_path, None, None, "broken")
    (broken / "model_index.json").write_text("{ not json")
    assert "unreadable" in refused(broken, "qwen_t2i")


def test_synthetic_and_index_less_folders(tmp_path: Path) -> None:
    assert check_model_folder(folder(tmp_path, None, None), "synthetic").pipeline_class is None
    assert check_model_folder(folder(tmp_path, None, QWEN_DIT, "bare"), "qwen_t2i").describe() \
        == "no model_index.json"


def test_worker_start_check_refuses_before_the_components(tmp_path: Path) -> None:
    """The worker's start-up check (check_stage_folder) runs the class check first: a
    complete folder of another pipeline is refused by its class, not let through."""
    root = folder(tmp_path, {"_class_name": "QwenImageEditPlusPipeline"}, QWEN_DIT)
    for component in STAGE_COMPONENTS["qwen_i2i"]["encoder"]:
        (root / component).mkdir(exist_ok=True)
        (root / component / "config.json").write_text("{}")
        (root / component / "model.safetensors").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="Set task to 'i2i_plus'"):
        check_stage_folder(root, "qwen_i2i", "encoder")
    assert check_stage_folder(root, "qwen_i2i_plus", "encoder").pipeline_class == (
        "QwenImageEditPlusPipeline")


def test_pack_round_trip_and_damage() -> None:
    """Several images travel as one pack; one image as its own bytes; a damaged pack is a
    StageInputError, and no accepted image format starts like a pack."""
    from contracts.errors import StageInputError
    from contracts.input_images import PACK_MAGIC, is_pack, pack_images, unpack_images

    a, b = b"\x89PNG\r\n\x1a\n-one", b"\xff\xd8\xff-two"
    assert pack_images([a]) == a and unpack_images(a, "t") == [a]
    packed = pack_images([a, b])
    assert is_pack(packed) and unpack_images(packed, "t") == [a, b]
    for damaged in (PACK_MAGIC + b"\xc1", PACK_MAGIC + b"\x91\xc4\x01x"):  # garbage; a list of 1
        with pytest.raises(StageInputError, match="packed input images"):
            unpack_images(damaged, "qwen_i2i_plus")
    for magic in (b"\x89PNG", b"\xff\xd8", b"RIFF", b"BM", b"GIF8", b"II*\x00", b"MM\x00*"):
        assert not PACK_MAGIC.startswith(magic)
    with pytest.raises(ValueError):
        pack_images([])
    # A one-image stage refuses a pack by name rather than as an undecodable file.
    from workers.models.media import decode_image

    with pytest.raises(StageInputError, match="wan_i2v takes one input image, got 2"):
        decode_image(packed, "wan_i2v")
