"""Wan2.2 on tiny random-weight folders: the A14B experts (which one runs each step, the
``swap`` placement against ``both`` and diffusers, a resume after the switch), the stages'
own components, and a group serving it through the task API and OpenAI's videos route.

Pixels equal to diffusers' pipelines for every Wan2.2 task and dtype:
tests/integration/test_models.py (``test_stages_match_diffusers_pipeline``); the contracts
around them: tests/unit/test_wan22_contracts.py.
"""

from __future__ import annotations

import base64
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

torch.set_num_threads(1)

from contracts.errors import CheckpointError, ModelLoadError, StageYielded  # noqa: E402
from contracts.request import GenerationRequest  # noqa: E402
from contracts.stage_options import StageOptions  # noqa: E402
from launcher import wait_task  # noqa: E402
from tests.support.groups import events_of, start_group  # noqa: E402
from tests.support.http import openai_client, pixels, result  # noqa: E402
from tests.support.models import (  # noqa: E402
    diffusers_reference,
    small_request,
    stage,
    wire,
)
from workers.models import LocalPipeline, TransformerAdapter  # noqa: E402
from workers.models.loop_state import LoopState, from_wire, to_wire  # noqa: E402

warnings.filterwarnings("ignore", category=DeprecationWarning, module="openai")
pytestmark = [pytest.mark.integration,  # builds and runs the tiny models, starts a group
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

A14B = ("wan22_a14b_t2v", "wan22_a14b_i2v")


def _image(task: str, png: bytes) -> bytes | None:
    return png if task.endswith("i2v") else None


@pytest.mark.parametrize("task", [*A14B, "wan22_5b_t2v"])
def test_each_step_names_its_expert(tiny_models: Path, input_png: bytes, task: str) -> None:
    """A14B's boundary falls inside the small request's steps: high, high, then low (so both
    experts ran in the fidelity test); TI2V-5B's one DiT names none."""
    req = small_request(task)
    cond = stage("encoder", tiny_models, task).encode(req, _image(task, input_png))
    dit = stage("transformer", tiny_models, task)
    seen: list[str | None] = []
    dit.denoise(req, wire(cond), on_step=lambda k, n: seen.append(dit.active_expert))
    assert seen == (["high", "high", "low"] if task in A14B else [None] * 3)


@pytest.mark.parametrize("task", A14B)
def test_swap_gives_the_pixels_of_both_and_of_diffusers(tiny_models: Path, input_png: bytes,
                                                        task: str) -> None:
    """``transformer.experts: swap``: the same pixels as ``both`` and as diffusers' pipeline,
    one move to the low-noise expert at the boundary and one back after the loop, per
    request."""
    req = small_request(task)
    cond = stage("encoder", tiny_models, task).encode(req, _image(task, input_png))
    swap = TransformerAdapter.for_task(tiny_models / task, task,
                                       options=StageOptions(experts="swap"))
    swap.load()
    assert swap.experts.resident == 0 and swap.experts.moves == 0
    decoder = stage("decoder", tiny_models, task)
    reference = diffusers_reference(tiny_models, req, _image(task, input_png), "float32")
    for n in (1, 2):  # the second request starts on the high-noise expert again
        where: list[int] = []
        latents = swap.denoise(req, wire(cond),
                               on_step=lambda k, n, seen=where: seen.append(
                                   swap.experts.resident))
        assert where == [0, 0, 1] and swap.experts.resident == 0
        assert swap.experts.moves == 2 * n
        both = stage("transformer", tiny_models, task).denoise(req, wire(cond))
        assert torch.equal(latents["latents"], both["latents"])
        ours = decoder.decode_float(req, wire(latents))
        assert float(np.abs(ours - reference).max()) == 0.0


class Hooks:
    """Loop hooks: resume from ``resume``; after step ``stop_at`` take the state through the
    wire format and end the loop as a yield does."""

    def __init__(self, resume: LoopState | None = None, stop_at: int | None = None) -> None:
        self.resume = resume
        self.stop_at = stop_at
        self.taken: LoopState | None = None

    def boundary(self, step: int, steps: int, snapshot: Callable[[], LoopState]) -> None:
        if step == self.stop_at:
            state = snapshot()
            tensors, meta = to_wire(state)
            # The wire: each tensor as raw bytes into a new one (0-d scheduler tensors too).
            moved = {k: wire({k: v.reshape(-1)})[k].reshape(v.shape) for k, v in tensors.items()}
            self.taken = from_wire(state.step, state.steps, moved, meta, "cpu")
            raise StageYielded("stopped", step, steps, "test")


def test_a_resume_after_the_switch_continues_on_the_low_noise_expert(
        tiny_models: Path) -> None:
    """Ten steps of T2V-A14B (shift 12, boundary 875): the switch falls after step 7
    (timesteps ..., 923, 889 | 837, 750, 573). A loop stopped after step 9 carries ``low`` in
    its state; resumed -- on a ``swap`` worker, whose device holds the high-noise expert -- it
    continues on the low-noise expert and gives the bytes of the uninterrupted loop; a
    state naming the other expert is refused."""
    task = "wan22_a14b_t2v"
    req = small_request(task, infer_steps=10)
    cond = wire(stage("encoder", tiny_models, task).encode(req))
    dit = stage("transformer", tiny_models, task)
    experts: list[str | None] = []
    want = dit.denoise(req, cond, on_step=lambda k, n: experts.append(dit.active_expert))
    switch = experts.index("low")
    assert switch >= 1 and experts.count("low") >= 3, experts
    stop = switch + 2  # after the first low-noise step
    for at, expert in ((switch, "low"), (stop, "low"), (switch - 1, "high")):
        first = Hooks(stop_at=at)
        with pytest.raises(StageYielded):
            dit.denoise(req, cond, loop=first)
        assert first.taken is not None and first.taken.expert == expert, at
    swap = TransformerAdapter.for_task(tiny_models / task, task,
                                       options=StageOptions(experts="swap"))
    swap.load()
    resumed: list[str | None] = []
    got = swap.denoise(req, cond, loop=Hooks(resume=first_state(dit, req, cond, stop)),
                       on_step=lambda k, n: resumed.append(swap.active_expert))
    assert resumed == ["low"] * (10 - stop)
    assert torch.equal(got["latents"], want["latents"])
    assert swap.experts.moves == 2  # straight to the low-noise expert, and back
    wrong = first_state(dit, req, cond, stop)
    wrong.expert = "high"
    with pytest.raises(CheckpointError, match="on the high-noise expert, but this worker's "
                                              "schedule runs that step on the low-noise one"):
        dit.denoise(req, cond, loop=Hooks(resume=wrong))


def first_state(dit: Any, req: GenerationRequest, cond: dict[str, torch.Tensor],
                at: int) -> LoopState:
    hooks = Hooks(stop_at=at)
    with pytest.raises(StageYielded):
        dit.denoise(req, cond, loop=hooks)
    assert hooks.taken is not None
    return hooks.taken


OWN = {
    ("encoder", "wan22_a14b_i2v"): ["tokenizer", "text_encoder", "vae"],
    ("transformer", "wan22_a14b_t2v"): ["transformer", "transformer_2", "scheduler",
                                        "vae/config.json", "model_index.json"],
    ("transformer", "wan22_5b_i2v"): ["transformer", "scheduler", "vae/config.json"],
    ("decoder", "wan22_5b_t2v"): ["vae"],
}


@pytest.mark.parametrize(("kind", "task"), sorted(OWN))
def test_wan22_stages_load_only_their_components(tiny_models: Path, tmp_path: Path, kind: str,
                                                 task: str) -> None:
    from tests.support.models import ADAPTERS

    own = tmp_path / "own"
    for part in OWN[(kind, task)]:
        (own / part).parent.mkdir(parents=True, exist_ok=True)
        (own / part).symlink_to(tiny_models / task / part)
    ADAPTERS[kind].for_task(own, task).load()
    if kind == "transformer" and task.startswith("wan22_a14b"):
        (own / "transformer_2").unlink()
        with pytest.raises(ModelLoadError, match="has no 'transformer_2' component"):
            ADAPTERS[kind].for_task(own, task).load()


# -- a group -------------------------------------------------------------------------------------
def test_a_group_serves_a14b_through_both_apis(tiny_models: Path, input_png: bytes,
                                               tmp_path: Path) -> None:
    """I2V-A14B with ``experts: swap``: a task with ``guidance_scale_2`` gives the bytes of
    the one-process pipeline; its events name the expert of each step; OpenAI's videos
    route (the ``openai`` package) reaches the same pipeline."""
    task = "wan22_a14b_i2v"
    fields = {"height": 32, "width": 32, "target_video_length": 9, "infer_steps": 3,
              "target_fps": 8, "seed": 11, "guidance_scale": 4.0, "guidance_scale_2": 2.0}
    req = GenerationRequest(task=task, prompt="a tiny wave", height=32, width=32,
                            num_frames=9, infer_steps=3, fps=8, seed=11, guidance_scale=4.0,
                            guidance_scale_2=2.0)
    local = LocalPipeline(tiny_models / task, task)
    want = local.run(req, input_png)
    with start_group(task, tiny_models, tmp_path,
                     settings={"transformer": {"transformer": {"experts": "swap"}}}) as group:
        events = events_of(group, "video", {
            "prompt": "a tiny wave", "task_id": "moe-1", **fields,
            "image_path": base64.b64encode(input_png).decode()})
        assert [(d["step"], d["expert"]) for name, d in events if name == "progress"] == \
            [(1, "high"), (2, "high"), (3, "low")]
        st = wait_task(group.url, "moe-1", timeout=60)
        assert st["status"] == "completed" and st["expert"] == "low", st
        got = pixels(result(group.url, "moe-1"), "mp4")
        assert np.array_equal(got, pixels(want.data, "mp4"))
        oc = openai_client(group.url)
        job = oc.videos.create(  # type: ignore[call-overload]
            prompt="a tiny wave", size="32x32", seconds="1",
            input_reference=("in.png", input_png, "image/png"),
            extra_body={"fps": 8, "seed": 11, "infer_steps": 3, "guidance_scale": 4.0,
                        "guidance_scale_2": 2.0})
        done = oc.videos.poll(job.id, poll_interval_ms=200)
        assert done.status == "completed" and done.model == task, done
        mp4 = oc.videos.download_content(job.id).content
        assert np.array_equal(pixels(mp4, "mp4"), pixels(want.data, "mp4"))


def test_swap_with_fp8_storage_equals_both_with_it(tiny_models: Path) -> None:
    """FP8 storage applies to each expert (the low-noise one built in host memory under
    swap): the two placements still compute the same bytes."""
    task = "wan22_a14b_t2v"
    req = small_request(task)
    cond = wire(stage("encoder", tiny_models, task).encode(req))
    out = {}
    for placement in ("both", "swap"):
        dit = TransformerAdapter.for_task(tiny_models / task, task, options=StageOptions(
            experts=placement, weight_storage="fp8"))
        dit.load()
        assert all(m.weight.dtype == torch.float8_e4m3fn for dit_ in dit.dits()
                   for m in [dit_.blocks[0].ffn.net[2]])
        out[placement] = dit.denoise(req, cond)["latents"]
    assert torch.equal(out["both"], out["swap"])
    plain = stage("transformer", tiny_models, task).denoise(req, cond)["latents"]
    assert not torch.equal(out["both"], plain)  # FP8 storage is lossy: it did apply


def test_the_budget_counts_one_expert_under_swap_and_split(tiny_models: Path) -> None:
    """``max_vram_gb`` between one expert and two (plus the working memory): ``swap`` and
    split's ``high`` / ``low`` load, ``both`` is refused naming the estimate."""
    import json

    from workers.models.memory import GIB, dit_working_bytes, estimate_weights

    task = "wan22_a14b_t2v"
    config = json.loads((tiny_models / task / "transformer" / "config.json").read_text())
    one = estimate_weights([tiny_models / task / "transformer"], 4).full
    budget = (dit_working_bytes(config, "video", (), False, 4) + 1.5 * one) / GIB
    with pytest.raises(ModelLoadError, match="but max_vram_gb is"):
        TransformerAdapter.for_task(tiny_models / task, task, options=StageOptions(
            max_vram_gb=budget)).load()
    for experts in ("swap", "high", "low"):  # split: each worker holds one expert
        TransformerAdapter.for_task(tiny_models / task, task, options=StageOptions(
            experts=experts, max_vram_gb=budget)).load()
