"""``i2i_denoise_strength`` in the Qwen-Image stages, on the tiny random-weight folders:
qwen_t2i with an input image gives diffusers' ``QwenImageImg2ImgPipeline`` pixel for pixel;
the edits (LightX2V's meaning: the condition image is also the start) give the edit
pipeline's pixels when it is handed the same tail of the schedule and the same start; the
T2I encoder loads its VAE on demand; a stopped strength loop resumes byte for byte."""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

torch.set_num_threads(1)  # tiny ops on a busy machine get slower with more threads

from contracts.errors import (  # noqa: E402
    InvalidRequestError,
    ModelLoadError,
    StageInputError,
    StageYielded,
)
from contracts.request import GenerationRequest  # noqa: E402
from workers.models import DecoderAdapter, EncoderAdapter, TransformerAdapter  # noqa: E402
from workers.models.components import check_stage_folder  # noqa: E402
from workers.models.loop_state import LoopState, from_wire, to_wire  # noqa: E402

pytestmark = pytest.mark.integration  # builds and runs the tiny models

PROMPT, NEGATIVE, SEED = "a red fox in fresh snow", "blurred", 1234
_STAGES: dict[tuple[str, str, str], Any] = {}
_KINDS = {"encoder": EncoderAdapter, "transformer": TransformerAdapter,
          "decoder": DecoderAdapter}


def stage(kind: str, models: Path, task: str, dtype: str = "float32") -> Any:
    """Loaded stages, kept for the module (loading is the slow part)."""
    if (kind, task, dtype) not in _STAGES:
        obj = _KINDS[kind].for_task(models / task, task, "cpu", dtype)
        obj.load()
        _STAGES[(kind, task, dtype)] = obj
    return _STAGES[(kind, task, dtype)]


def request(task: str, **fields: Any) -> GenerationRequest:
    req = GenerationRequest(task=task, prompt=PROMPT, negative_prompt=NEGATIVE, seed=SEED,
                            **fields)
    return GenerationRequest.from_dict(req.to_dict())  # the request travels as a map


def run(models: Path, req: GenerationRequest, image: bytes | None, dtype: str = "float32",
        steps: list[tuple[int, int]] | None = None) -> np.ndarray:
    """The three stages, each output through a byte copy (what a transfer does)."""
    cond = wire(stage("encoder", models, req.task, dtype).encode(req, image))
    latents = stage("transformer", models, req.task, dtype).denoise(
        req, cond, on_step=None if steps is None else lambda k, n: steps.append((k, n)))
    out: np.ndarray = stage("decoder", models, req.task, dtype).decode_float(req, wire(latents))
    return out


def wire(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        raw = bytearray(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        out[name] = torch.frombuffer(raw, dtype=torch.uint8).view(t.dtype).reshape(t.shape)
    return out


def pil(png: bytes) -> Any:
    from PIL import Image

    return Image.open(io.BytesIO(png)).convert("RGB")


# -- qwen_t2i: diffusers' QwenImageImg2ImgPipeline ----------------------------------------------
@pytest.mark.parametrize(("dtype", "strength", "ran"),
                         [("float32", 0.6, 3), ("float32", 1.0, 4), ("bfloat16", 0.3, 2)])
def test_t2i_with_an_image_is_diffusers_img2img(tiny_models: Path, input_png: bytes,
                                                dtype: str, strength: float, ran: int) -> None:
    """Four steps at strength 0.6 run the last 4 - int(4 * 0.4) = 3 (diffusers' count;
    LightX2V's rounding would run 2); at 1.0 all four, from the image noised away."""
    import diffusers

    req = request("qwen_t2i", height=32, width=48, infer_steps=4,
                  i2i_denoise_strength=strength)
    steps: list[tuple[int, int]] = []
    ours = run(tiny_models, req, input_png, dtype, steps)
    assert steps == [(k, ran) for k in range(1, ran + 1)]

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    pipe = diffusers.QwenImageImg2ImgPipeline.from_pretrained(tiny_models / "qwen_t2i",
                                                              dtype=torch_dtype)
    pipe.set_progress_bar_config(disable=True)
    reference = pipe(prompt=PROMPT, negative_prompt=NEGATIVE, image=pil(input_png),
                     strength=strength, height=32, width=48, num_inference_steps=4,
                     true_cfg_scale=req.true_cfg_scale, output_type="np",
                     generator=torch.Generator("cpu").manual_seed(SEED)).images[0]
    assert ours.shape == reference.shape == (32, 48, 3)
    assert float(np.abs(ours - reference).max()) == 0.0
    assert ours.std() > 0.01, "degenerate output: the test would prove little"


# -- the edits: LightX2V's meaning --------------------------------------------------------------
@pytest.mark.parametrize("task", ["qwen_i2i", "qwen_i2i_plus"])
def test_edit_strength_is_the_edit_pipeline_on_the_schedule_tail(
        tiny_models: Path, input_png: bytes, task: str) -> None:
    """No diffusers pipeline edits with a strength; what it must be: the edit pipeline run
    on the last steps of its schedule (its own ``sigmas``) from its condition image's
    latents noised to the first of them (the scheduler's ``scale_noise``), the noise drawn
    from the seed as the pipeline draws it. The output size is the condition image's
    (~1 megapixel, the edits' default), so the start needs no resizing."""
    import diffusers
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import VAE_IMAGE_SIZE
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (
        calculate_dimensions as plus_dimensions,
    )
    from diffusers.utils.torch_utils import randn_tensor

    from workers.models.families.qwen_text import QwenEditProcessor

    steps_total, strength = 3, 0.5  # 3 - int(3 * 0.5) = 2 steps
    req = request(task, infer_steps=steps_total, i2i_denoise_strength=strength)
    steps: list[tuple[int, int]] = []
    ours = run(tiny_models, req, input_png, steps=steps)
    assert steps == [(1, 2), (2, 2)]

    folder = tiny_models / task
    cls = "QwenImageEditPipeline" if task == "qwen_i2i" else "QwenImageEditPlusPipeline"
    pipe = getattr(diffusers, cls).from_pretrained(
        folder, dtype=torch.float32,
        processor=QwenEditProcessor.from_pretrained(folder / "processor"))
    pipe.set_progress_bar_config(disable=True)
    image = pil(input_png)
    # The condition image's latents, as each pipeline makes them (~1 megapixel, VAE mode).
    ratio = image.size[0] / image.size[1]
    if task == "qwen_i2i":
        width, height = calculate_dimensions(1024 * 1024, ratio)[:2]
        pixels = pipe.image_processor.preprocess(
            pipe.image_processor.resize(image, height, width), height, width)
    else:
        width, height = plus_dimensions(VAE_IMAGE_SIZE, ratio)
        pixels = pipe.image_processor.preprocess(image, height, width)
    start = pipe._encode_vae_image(pixels.unsqueeze(2), generator=None)  # (1, z, 1, h, w)
    z, h, w = start.shape[1], start.shape[-2], start.shape[-1]
    sched = type(pipe.scheduler).from_config(pipe.scheduler.config)
    sigmas = np.linspace(1.0, 1 / steps_total, steps_total)
    mu = calculate_shift((h // 2) * (w // 2), sched.config.base_image_seq_len,
                         sched.config.max_image_seq_len, sched.config.base_shift,
                         sched.config.max_shift)
    sched.set_timesteps(sigmas=sigmas, mu=mu)
    skip = 1
    sched.set_begin_index(skip)
    noise = randn_tensor((1, 1, z, h, w), generator=torch.Generator("cpu").manual_seed(SEED),
                         dtype=torch.float32)
    noised = sched.scale_noise(start.transpose(1, 2), sched.timesteps[skip:skip + 1], noise)
    reference = pipe(prompt=PROMPT, negative_prompt=NEGATIVE, image=image,
                     latents=pipe._pack_latents(noised, 1, z, h, w),
                     sigmas=list(sigmas[skip:]), num_inference_steps=steps_total - skip,
                     true_cfg_scale=req.true_cfg_scale, output_type="np",
                     generator=torch.Generator("cpu").manual_seed(SEED)).images[0]
    assert ours.shape == reference.shape == (h * 8, w * 8, 3)
    assert float(np.abs(ours - reference).max()) == 0.0


def test_edit_strength_at_another_size(tiny_models: Path, input_png: bytes) -> None:
    """An edit whose output size is not the condition image's starts from its latents
    resized (bilinear, as LightX2V); at strength 1 the start is all noise: the plain edit,
    bit for bit."""
    size = {"height": 32, "width": 32, "infer_steps": 2}
    plain = run(tiny_models, request("qwen_i2i", **size), input_png)
    full = run(tiny_models, request("qwen_i2i", i2i_denoise_strength=1.0, **size), input_png)
    half = run(tiny_models, request("qwen_i2i", i2i_denoise_strength=0.5, **size), input_png)
    assert np.array_equal(full, plain)
    assert half.shape == plain.shape == (32, 32, 3) and not np.array_equal(half, plain)


# -- the T2I encoder's VAE, on demand ----------------------------------------------------------
def test_t2i_encoder_loads_its_vae_on_demand(tiny_models: Path, input_png: bytes,
                                             tmp_path: Path) -> None:
    """A T2I encoder loads no VAE at start and none for text-to-image; the first
    image-to-image request loads it. A folder without a VAE serves text-to-image, and
    refuses image-to-image naming the component."""
    enc = EncoderAdapter.for_task(tiny_models / "qwen_t2i", "qwen_t2i")
    enc.load()
    assert enc.vae is None
    enc.encode(request("qwen_t2i", height=32, width=32, infer_steps=2), None)
    assert enc.vae is None
    out = enc.encode(request("qwen_t2i", height=32, width=32, infer_steps=2,
                             i2i_denoise_strength=0.5), input_png)
    assert enc.vae is not None
    assert set(out) >= {"init_latents", "init_generator"}
    assert out["init_latents"].shape == (1, 16, 1, 4, 4)

    text_only = tmp_path / "qwen_t2i_text_only"
    text_only.mkdir()
    for entry in (tiny_models / "qwen_t2i").iterdir():
        if entry.name != "vae":
            os.symlink(entry, text_only / entry.name)
    check_stage_folder(text_only, "qwen_t2i", "encoder")  # the VAE is not needed at start
    bare = EncoderAdapter.for_task(text_only, "qwen_t2i")
    bare.load()
    bare.encode(request("qwen_t2i", height=32, width=32, infer_steps=2), None)
    with pytest.raises(ModelLoadError, match="'vae' component"):
        bare.encode(request("qwen_t2i", height=32, width=32, infer_steps=2,
                            i2i_denoise_strength=0.5), input_png)


# -- what the stages refuse --------------------------------------------------------------------
def test_stages_refuse_a_strength_without_its_image(tiny_models: Path, input_png: bytes,
                                                    input_png_2: bytes) -> None:
    from contracts.input_images import pack_images

    enc = stage("encoder", tiny_models, "qwen_t2i")
    geometry = {"height": 32, "width": 32, "infer_steps": 2}
    with pytest.raises(StageInputError, match="only with i2i_denoise_strength"):
        enc.encode(request("qwen_t2i", **geometry), input_png)
    with pytest.raises(StageInputError, match="needs an input image"):
        enc.encode(request("qwen_t2i", i2i_denoise_strength=0.5, **geometry), None)
    text = enc.encode(request("qwen_t2i", **geometry), None)
    dit = stage("transformer", tiny_models, "qwen_t2i")
    with pytest.raises(StageInputError, match="init_latents"):
        dit.denoise(request("qwen_t2i", i2i_denoise_strength=0.5, **geometry), text)

    plus = request("qwen_i2i_plus", i2i_denoise_strength=0.5, **geometry)
    two = stage("encoder", tiny_models, "qwen_i2i_plus").encode(
        plus, pack_images([input_png, input_png_2]))
    with pytest.raises(InvalidRequestError, match="redraws one input image, got 2"):
        stage("transformer", tiny_models, "qwen_i2i_plus").denoise(plus, two)


# -- checkpoints -------------------------------------------------------------------------------
class Hooks:
    """Stop after step ``stop_at`` with the state taken through the wire format, or resume
    from ``resume``."""

    def __init__(self, resume: LoopState | None = None, stop_at: int | None = None) -> None:
        self.resume = resume
        self.stop_at = stop_at
        self.taken: LoopState | None = None

    def boundary(self, step: int, steps: int, snapshot: Callable[[], LoopState]) -> None:
        if step == self.stop_at:
            state = snapshot()
            tensors, meta = to_wire(state)
            self.taken = from_wire(state.step, state.steps, wire(tensors), meta, "cpu")
            raise StageYielded("stopped", step, steps, "test")


@pytest.mark.parametrize("task", ["qwen_t2i", "qwen_i2i"])
def test_stopped_strength_loop_resumes_byte_identical(tiny_models: Path, input_png: bytes,
                                                      task: str) -> None:
    """The truncated schedule's begin index is the scheduler's state like any other: a loop
    stopped after any of its 3 steps resumes to the bytes of an uninterrupted run."""
    req = request(task, height=32, width=32, infer_steps=4, i2i_denoise_strength=0.6)
    inputs = wire(stage("encoder", tiny_models, task).encode(req, input_png))
    dit = stage("transformer", tiny_models, task)
    want = dit.denoise(req, inputs, loop=Hooks())["latents"]
    for k in (1, 2):
        first = Hooks(stop_at=k)
        with pytest.raises(StageYielded):
            dit.denoise(req, inputs, loop=first)
        assert first.taken is not None and (first.taken.step, first.taken.steps) == (k, 3)
        got = dit.denoise(req, inputs, loop=Hooks(resume=first.taken))["latents"]
        assert torch.equal(got, want), f"{task}: resumed after step {k} differs"
