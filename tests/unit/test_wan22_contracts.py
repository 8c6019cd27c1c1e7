"""Wan2.2 in the contracts and the pieces around its stages, in-process: the pipeline rows,
``guidance_scale_2`` in a request, the model folders each row serves, LightX2V's pair of
guidance scales, the ``transformer.experts`` option, the expert a loop state carries and the
expert a progress report carries to status and events, and the expert placement's moves on
toy modules (the stages themselves: tests/integration/test_wan22.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from contracts.config import ServiceConfig
from contracts.errors import CheckpointError, ConfigError, InvalidRequestError, ModelLoadError
from contracts.messages import Progress, decode, encode
from contracts.pipelines import pipeline_name, rows_for_folder, task_spec
from contracts.request import GenerationRequest
from contracts.stage_options import StageOptions
from controller.http.events import task_event
from tests.support.coordinators import denoising, queue_coordinator
from workers.models.components import check_stage_folder
from workers.models.dit.experts import Experts, check_placement
from workers.models.loop_state import LoopState, from_wire, to_wire
from workers.models.model_folder import check_model_folder

A14B = ("wan22_a14b_t2v", "wan22_a14b_i2v")
FIVE_B = ("wan22_5b_t2v", "wan22_5b_i2v")


# -- the rows ----------------------------------------------------------------------------------
def test_rows_are_named_by_lightx2v_model_cls_and_task() -> None:
    assert pipeline_name("wan2.2_moe", "t2v") == "wan22_a14b_t2v"
    assert pipeline_name("wan2.2_moe", "i2v") == "wan22_a14b_i2v"
    assert pipeline_name("wan2.2", "t2v") == "wan22_5b_t2v"
    assert pipeline_name("wan2.2", "i2v") == "wan22_5b_i2v"
    for name in A14B:
        spec = task_spec(name)
        assert (spec.family, spec.experts, spec.expand_timesteps, spec.size_multiple) == \
            ("wan", 2, False, 16)
    for name in FIVE_B:
        spec = task_spec(name)
        assert (spec.experts, spec.expand_timesteps, spec.size_multiple) == (1, True, 32)
        assert spec.folder_pipeline == "WanPipeline"  # one folder serves both tasks
    assert [s.name for s in rows_for_folder("WanPipeline", 1, True)] == list(FIVE_B)
    assert [s.name for s in rows_for_folder("WanPipeline", 2, False)] == ["wan22_a14b_t2v"]
    assert [s.name for s in rows_for_folder("WanPipeline", 1, False)] == ["wan_t2v"]


def test_published_defaults() -> None:
    t2v = GenerationRequest(task="wan22_a14b_t2v", prompt="p")
    assert (t2v.guidance_scale, t2v.guidance_scale_2, t2v.infer_steps) == (4.0, 3.0, 40)
    assert (t2v.height, t2v.width, t2v.num_frames) == (720, 1280, 81)
    i2v = GenerationRequest(task="wan22_a14b_i2v", prompt="p")
    assert (i2v.guidance_scale, i2v.guidance_scale_2, i2v.height) == (3.5, 3.5, 480)
    five = GenerationRequest(task="wan22_5b_t2v", prompt="p")
    assert (five.height, five.width, five.num_frames, five.fps, five.guidance_scale_2) == \
        (704, 1280, 121, 24, None)


# -- guidance_scale_2 ---------------------------------------------------------------------------
def test_guidance_scale_2_is_the_a14b_tasks_own() -> None:
    req = GenerationRequest(task="wan22_a14b_t2v", prompt="p", guidance_scale_2=2)
    assert req.guidance_scale_2 == 2.0 and isinstance(req.guidance_scale_2, float)
    assert GenerationRequest.from_dict(req.to_dict()) == req
    for other in ("wan_t2v", "wan22_5b_t2v", "qwen_t2i", "synthetic"):
        with pytest.raises(InvalidRequestError, match=r"guidance_scale_2 applies to the two-"
                                                      r"expert Wan2\.2-A14B tasks only"):
            GenerationRequest(task=other, prompt="p", guidance_scale_2=3.0)
    with pytest.raises(InvalidRequestError, match=r"guidance_scale_2 must be >= 0\.0"):
        GenerationRequest(task="wan22_a14b_i2v", prompt="p", guidance_scale_2=-1.0)
    # A request without it travels exactly as before the field existed.
    assert "guidance_scale_2" not in GenerationRequest(task="wan_t2v", prompt="p").to_dict()


def test_ti2v_sizes_follow_its_vae() -> None:
    with pytest.raises(InvalidRequestError, match="height must be a multiple of 32"):
        GenerationRequest(task="wan22_5b_i2v", prompt="p", height=48, width=64)


# -- model folders -------------------------------------------------------------------------------
WAN22_DIT = {"_class_name": "WanTransformer3DModel", "image_dim": None, "in_channels": 16,
             "out_channels": 16}
INDEX = {
    "wan22_a14b_t2v": {"_class_name": "WanPipeline", "boundary_ratio": 0.875,
                       "transformer_2": ["diffusers", "WanTransformer3DModel"],
                       "expand_timesteps": False},
    "wan22_a14b_i2v": {"_class_name": "WanImageToVideoPipeline", "boundary_ratio": 0.9,
                       "transformer_2": ["diffusers", "WanTransformer3DModel"],
                       "image_encoder": [None, None]},
    "wan22_5b": {"_class_name": "WanPipeline", "boundary_ratio": None,
                 "transformer_2": [None, None], "expand_timesteps": True},
}
DIT = {"wan22_a14b_t2v": WAN22_DIT, "wan22_a14b_i2v": {**WAN22_DIT, "in_channels": 36},
       "wan22_5b": {**WAN22_DIT, "in_channels": 48, "out_channels": 48}}


def folder(tmp_path: Path, name: str, index: dict[str, Any] | None = None,
           dit: dict[str, Any] | None = None) -> Path:
    root = tmp_path / name
    (root / "transformer").mkdir(parents=True)
    if index is not None or name in INDEX:
        (root / "model_index.json").write_text(json.dumps(index or INDEX[name]))
    (root / "transformer" / "config.json").write_text(json.dumps(dit or DIT[name]))
    return root


def refused(root: Path, task: str) -> str:
    with pytest.raises(ModelLoadError) as info:
        check_model_folder(root, task)
    return str(info.value)


def test_each_wan22_folder_is_served_by_its_rows(tmp_path: Path) -> None:
    a14b = check_model_folder(folder(tmp_path, "wan22_a14b_t2v"), "wan22_a14b_t2v")
    assert a14b.describe() == "WanPipeline: two experts, boundary_ratio 0.875"
    check_model_folder(folder(tmp_path, "wan22_a14b_i2v"), "wan22_a14b_i2v")
    five = folder(tmp_path, "wan22_5b")
    for task_name in FIVE_B:  # the one TI2V-5B folder, both tasks
        assert "expand_timesteps" in check_model_folder(five, task_name).describe()


def test_a_wan22_folder_under_a_wan21_task_says_what_to_set(tmp_path: Path) -> None:
    message = refused(folder(tmp_path, "wan22_a14b_t2v"), "wan_t2v")
    assert "is a two-expert (Wan2.2-A14B) WanPipeline checkpoint" in message
    assert "served by diffring as wan22_a14b_t2v (model_cls 'wan2.2_moe', task 't2v')" \
        in message
    assert "Set model_cls to 'wan2.2_moe' and task to 't2v'" in message
    flux = folder(tmp_path, "flux", {"_class_name": "FluxPipeline"}, WAN22_DIT)
    assert "two-expert (Wan2.2-A14B) WanPipeline (wan22_a14b_t2v)" in refused(flux, "wan_t2v")
    message = refused(folder(tmp_path, "wan22_5b"), "wan_i2v")
    assert "expand_timesteps (Wan2.2-TI2V-5B) WanPipeline checkpoint" in message
    assert "served by diffring as wan22_5b_i2v" in message  # the row of its kind of output
    # The other way round: a Wan2.1 folder is none of the Wan2.2 rows.
    wan21 = folder(tmp_path, "wan21", {"_class_name": "WanPipeline"}, WAN22_DIT)
    assert "served by diffring as wan_t2v (model_cls 'wan2.1'" in refused(wan21,
                                                                            "wan22_a14b_t2v")


def test_wan22_dits_of_the_other_task_are_refused(tmp_path: Path) -> None:
    t2v_dit = folder(tmp_path, "t2v-dit", INDEX["wan22_a14b_i2v"], WAN22_DIT)
    assert "is a T2V DiT, but the task is wan22_a14b_i2v" in refused(t2v_dit, "wan22_a14b_i2v")
    clip = folder(tmp_path, "clip", INDEX["wan22_a14b_i2v"],
                  {**DIT["wan22_a14b_i2v"], "image_dim": 1280})
    assert "CLIP image context" in refused(clip, "wan22_a14b_i2v")


def test_the_two_experts_stage_needs_the_model_index(tmp_path: Path) -> None:
    """Its boundary_ratio is there; a stage's own copy of its components must keep it."""
    root = tmp_path / "bare"
    for component in ("transformer", "transformer_2"):
        (root / component).mkdir(parents=True)
        (root / component / "config.json").write_text(json.dumps(WAN22_DIT))
        (root / component / "diffusion_pytorch_model.safetensors").write_bytes(b"")
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text("{}")
    (root / "vae").mkdir()
    (root / "vae" / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=r"the 'model_index.json' component is "
                                             r"incomplete \(missing\); the transformer stage"):
        check_stage_folder(root, "wan22_a14b_t2v", "transformer")


# -- LightX2V -----------------------------------------------------------------------------------
def test_lightx2v_pair_of_scales_is_high_then_low() -> None:
    cfg = ServiceConfig.from_dict({"model_cls": "wan2.2_moe", "task": "t2v",
                                   "sample_guide_scale": [4.0, 3.0], "boundary": 0.875,
                                   "boundary_step_index": 2})
    assert cfg.pipeline == "wan22_a14b_t2v"
    assert cfg.request_defaults["guidance_scale"] == 4.0
    assert cfg.request_defaults["guidance_scale_2"] == 3.0
    ignored = {n.key: n.why for n in cfg.lightx2v if n.to is None}
    assert "boundary_ratio" in ignored["boundary"] and "boundary_step_index" in ignored
    with pytest.raises(ConfigError, match=r"a pair of scales is for the two experts"):
        ServiceConfig.from_dict({"model_cls": "wan2.1", "task": "t2v",
                                 "sample_guide_scale": [4.0, 3.0]})


# -- the experts option -------------------------------------------------------------------------
def test_experts_option_is_checked() -> None:
    with pytest.raises(ConfigError, match="experts must be one of both, swap, high, low"):
        StageOptions(experts="split")
    with pytest.raises(ConfigError, match="wan_t2v has one DiT"):
        ServiceConfig.from_dict({"model_cls": "wan2.1", "task": "t2v",
                                 "transformer": {"experts": "swap"}})
    with pytest.raises(ConfigError, match="cannot be combined with compile"):
        ServiceConfig.from_dict({"model_cls": "wan2.2_moe", "task": "t2v", "compile": True,
                                 "warmup_shapes": ["480x832x81"],
                                 "transformer": {"experts": "swap"}})
    cfg = ServiceConfig.from_dict({"model_cls": "wan2.2_moe", "task": "i2v",
                                   "transformer": {"experts": "swap",
                                                   "weight_storage": "fp8"}})
    assert cfg.transformer.experts == "swap"
    with pytest.raises(ModelLoadError, match="cannot move FP8 linear layers"):
        check_placement(StageOptions(experts="swap", linear="fp8"), 2, compiled=False)
    check_placement(StageOptions(experts="swap", weight_storage="fp8"), 2, compiled=False)


def test_split_experts_option_is_checked() -> None:
    """``high`` / ``low`` (the split placement): one expert per worker, so the weight options
    and compile of any one DiT apply; not a one-DiT model, not a transformer group."""
    for experts in ("high", "low"):
        with pytest.raises(ConfigError, match=f"experts '{experts}' places the two experts of "
                                              "Wan2.2-A14B; wan_i2v has one DiT"):
            ServiceConfig.from_dict({"model_cls": "wan2.1", "task": "i2v",
                                     "transformer": {"experts": experts}})
        with pytest.raises(ConfigError, match="runs one expert on one device"):
            ServiceConfig.from_dict({"model_cls": "wan2.2_moe", "task": "t2v",
                                     "transformer": {"experts": experts,
                                                     "parallel": "cfg=2"}})
        cfg = ServiceConfig.from_dict({"model_cls": "wan2.2_moe", "task": "t2v",
                                       "compile": True, "warmup_shapes": ["480x832x81"],
                                       "dtype": "bfloat16",
                                       "transformer": {"experts": experts, "linear": "fp8"}})
        assert cfg.transformer.experts == experts
        check_placement(StageOptions(experts=experts, linear="fp8"), 2,
                        compiled=True)
        with pytest.raises(ModelLoadError, match="this model has one DiT"):
            check_placement(StageOptions(experts=experts), 1, compiled=False)


def test_a_split_worker_holds_one_expert() -> None:
    """The rule still names both experts; the one not held is refused, not run."""
    high = Experts([_Toy(1.0), None], 875.0, "high", torch.device("cpu"))
    assert high.holds(0) and not high.holds(1) and len(high.all()) == 1
    assert high.index_at(874) == 1 and high.name(1) == "low"
    with pytest.raises(CheckpointError, match="holds the high-noise expert only"):
        high.get(1)
    low = Experts([None, _Toy(2.0)], 875.0, "low", torch.device("cpu"))
    assert low.first is low.get(1) and not low.holds(0)


class _Toy(torch.nn.Module):
    def __init__(self, value: float) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(2, 2)
        torch.nn.init.constant_(self.proj.weight, value)
        self.register_buffer("table", torch.full((2,), value))


def test_the_schedule_picks_the_expert_at_the_boundary() -> None:
    experts = Experts([_Toy(1.0), _Toy(2.0)], 875.0, "both", torch.device("cpu"))
    assert [experts.index_at(t) for t in (999, 875, 874.9, 0)] == [0, 0, 1, 1]
    assert [experts.name(i) for i in (0, 1)] == ["high", "low"]
    one = Experts([_Toy(1.0)], None, "both", torch.device("cpu"))
    assert one.index_at(0) == 0 and one.name(0) is None and not one.two


def test_swap_moves_once_each_way_and_keeps_the_weights() -> None:
    high, low = _Toy(1.0), _Toy(2.0)
    experts = Experts([high, low], 500.0, "swap", torch.device("cpu"))
    experts.placed()
    assert experts.resident == 0 and experts.moves == 0
    for _ in range(2):  # two requests
        before = experts.moves
        assert experts.get(0) is high and experts.moves == before  # on it already
        experts.upcoming(1)  # no device to overlap with on the CPU: moved at the boundary
        moves = experts.moves
        assert experts.get(1) is low and experts.moves == moves + 1 and experts.resident == 1
        assert experts.get(1) is low and experts.moves == moves + 1  # the next low step
        experts.finished()
        assert experts.resident == 0 and experts.moves == moves + 2
        assert float(high.proj.weight.detach()[0, 0]) == 1.0 and float(low.table[0]) == 2.0
    both = Experts([_Toy(1.0), _Toy(2.0)], 500.0, "both", torch.device("cpu"))
    both.get(1)
    both.finished()
    assert both.moves == 0


def test_adapters_loaded_while_parked_move_in_with_their_expert() -> None:
    high, low = _Toy(1.0), _Toy(2.0)
    experts = Experts([high, low], 500.0, "swap", torch.device("cpu"))
    experts.placed()
    low.proj.lora_A = torch.nn.Linear(2, 1)  # what PEFT adds to a parked expert
    experts.get(1)
    assert "proj.lora_A.weight" in experts._host[1]


# -- the loop state and the progress -------------------------------------------------------------
def test_loop_state_carries_the_expert_of_the_next_step() -> None:
    state = LoopState(2, 3, {"latents": torch.ones(2)}, {"_step_index": 2}, "low")
    tensors, meta = to_wire(state)
    assert meta["expert"] == "low"
    assert from_wire(2, 3, tensors, meta, "cpu").expert == "low"
    _, plain = to_wire(LoopState(1, 3, {"latents": torch.ones(2)}))
    assert "expert" not in plain  # a one-DiT state travels as before


def test_progress_carries_the_expert_to_status_and_events(tmp_path: Path) -> None:
    msg = decode(encode(Progress(task_id="a", attempt=1, step=2, steps=3, expert="low")))
    assert isinstance(msg, Progress) and msg.expert == "low"
    co = queue_coordinator(tmp_path)
    _enc, dit, _dec = denoising(co, "a")
    t = co.table.get("a")
    assert t is not None
    co.on_progress(dit, "a", 1, 1, 3, "high")
    assert t.public()["expert"] == "high"
    co.on_progress(dit, "a", 1, 3, 3, "low")
    assert t.public()["expert"] == "low" and task_event("progress", t)["expert"] == "low"
    co.on_progress(dit, "a", 1, 3, 3)  # a one-DiT model's report
    assert "expert" not in task_event("progress", t)
    co.close()
