"""Stage adapters against diffusers' own pipelines, on tiny random-weight models.

The session fixtures ``tiny_models`` and ``input_png`` live in ``tests/conftest.py``, the
helpers the model tests share in ``tests/support/models.py``. The tiny models are built once
per session by ``modelkit.tiny`` (into a temp dir, or into ``$DIFFRING_TINY_MODELS`` when
set, where an up-to-date build is reused).
"""

from __future__ import annotations

import importlib.util
import io
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

# Tiny ops on a busy 2-core machine get hundreds of times slower with extra threads.
torch.set_num_threads(1)

from contracts.errors import (  # noqa: E402  (after the thread setting, on purpose)
    InvalidRequestError,
    ModelLoadError,
    StageCancelled,
    StageInputError,
)
from contracts.pipelines import TASKS, task_spec  # noqa: E402
from contracts.request import GenerationRequest  # noqa: E402
from tests.support.models import (  # noqa: E402
    ADAPTERS,
    IMAGE_INPUT_TASKS,
    PROMPT,
    SMALL,
    STAGES,
    VIDEO_TASKS,
    diffusers_reference,
    small_request,
    stage,
    wire,
)
from workers.models import (  # noqa: E402
    DecoderAdapter,
    EncoderAdapter,
    TransformerAdapter,
    run_pipeline,
)
from workers.models.media import to_uint8  # noqa: E402

pytestmark = pytest.mark.integration  # builds and runs the tiny models

# The pipelines with a diffusers reference (the synthetic one has no model: test_synthetic.py).
DIFFUSERS_TASKS = tuple(t for t in TASKS if task_spec(t).family != "synthetic")


# ---------------------------------------------------------------------------------------------
# (a) three stages == diffusers' pipeline, pixel for pixel
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("task", DIFFUSERS_TASKS)
def test_stages_match_diffusers_pipeline(
    tiny_models: Path, input_png: bytes, task: str, dtype: str
) -> None:
    req = small_request(task)
    image = input_png if task in IMAGE_INPUT_TASKS else None
    # The request itself travels as a map, too.
    req = GenerationRequest.from_dict(req.to_dict())

    conditioning = stage("encoder", tiny_models, task, dtype).encode(req, image)
    steps: list[tuple[int, int]] = []
    latents = stage("transformer", tiny_models, task, dtype).denoise(
        req, wire(conditioning), on_step=lambda k, n: steps.append((k, n))
    )
    decoder = stage("decoder", tiny_models, task, dtype)
    ours = decoder.decode_float(req, wire(latents))
    artifact = decoder.decode(req, wire(latents))

    reference = diffusers_reference(tiny_models, req, image, dtype)
    assert ours.shape == reference.shape
    assert float(np.abs(ours - reference).max()) == 0.0
    assert np.array_equal(artifact.frames, to_uint8(reference))
    assert artifact.frames.std() > 1.0, "degenerate output: the test would prove little"
    n_steps = SMALL[task]["infer_steps"]
    assert steps == [(k, n_steps) for k in range(1, n_steps + 1)]

    n_frames = req.num_frames if task in VIDEO_TASKS else None
    expected_shape = (req.height, req.width, 3)
    if n_frames is not None:
        assert artifact.frames.shape == (n_frames, *expected_shape)
        assert (artifact.media_type, artifact.extension) == ("video/mp4", "mp4")
        assert artifact.data[4:8] == b"ftyp"
    else:
        assert artifact.frames.shape == expected_shape
        assert (artifact.media_type, artifact.extension) == ("image/png", "png")
        from PIL import Image

        assert np.array_equal(np.asarray(Image.open(io.BytesIO(artifact.data))), artifact.frames)
        assert decoder.decode(req, latents).data == artifact.data  # PNG bytes are deterministic


def test_conditioning_tensors(tiny_models: Path, input_png: bytes) -> None:
    """The documented tensor names and layouts between the stages."""
    names = {
        "wan_t2v": {"prompt_embeds", "negative_prompt_embeds"},
        "wan_i2v": {"prompt_embeds", "negative_prompt_embeds", "image_embeds", "condition"},
        "qwen_t2i": {
            "prompt_embeds",
            "prompt_embeds_mask",
            "negative_prompt_embeds",
            "negative_prompt_embeds_mask",
        },
        "qwen_i2i": {
            "prompt_embeds",
            "prompt_embeds_mask",
            "negative_prompt_embeds",
            "negative_prompt_embeds_mask",
            "image_latents",
        },
    }
    names["qwen_i2i_plus"] = names["qwen_i2i"]  # one image; a second adds image_latents_2
    # Wan2.2 has no CLIP: the first frame reaches the DiT through the VAE condition alone.
    for task in ("wan22_a14b_t2v", "wan22_5b_t2v"):
        names[task] = names["wan_t2v"]
    for task in ("wan22_a14b_i2v", "wan22_5b_i2v"):
        names[task] = names["wan_t2v"] | {"condition"}
    for task in DIFFUSERS_TASKS:
        req = small_request(task)
        image = input_png if task in IMAGE_INPUT_TASKS else None
        out = stage("encoder", tiny_models, task).encode(req, image)
        assert set(out) == names[task], task
        assert all(t.is_contiguous() for t in out.values())
    # No CFG, no negative branch.
    assert set(
        stage("encoder", tiny_models, "wan_t2v").encode(
            small_request("wan_t2v", guidance_scale=1.0)
        )
    ) == {"prompt_embeds"}
    assert set(
        stage("encoder", tiny_models, "qwen_t2i").encode(
            small_request("qwen_t2i", true_cfg_scale=1.0)
        )
    ) == {"prompt_embeds", "prompt_embeds_mask"}


def test_run_pipeline_equals_stages(tiny_models: Path) -> None:
    req = small_request("qwen_t2i", seed=99)
    artifact = run_pipeline(tiny_models / "qwen_t2i", "qwen_t2i", req)
    tensors = stage("encoder", tiny_models, "qwen_t2i").encode(req)
    latents = stage("transformer", tiny_models, "qwen_t2i").denoise(req, wire(tensors))
    split = stage("decoder", tiny_models, "qwen_t2i").decode(req, wire(latents))
    assert np.array_equal(artifact.frames, split.frames)
    assert artifact.data == split.data


def test_edit_size_defaults_to_condition_image(tiny_models: Path, input_png: bytes) -> None:
    """qwen_i2i without a size: ~1 megapixel with the input's 40:48 aspect, as diffusers."""
    req = small_request("qwen_i2i", height=None, width=None, infer_steps=2)
    tensors = stage("encoder", tiny_models, "qwen_i2i").encode(req, input_png)
    latents = stage("transformer", tiny_models, "qwen_i2i").denoise(req, wire(tensors))
    assert tuple(latents["latents"].shape) == (1, 16, 1, 1120 // 8, 928 // 8)


def test_unusable_schedule_is_refused(tiny_models: Path) -> None:
    # Qwen-Image's terminal shift divides by zero for a one-step schedule (diffusers would
    # quietly produce NaN latents): the request is refused (the pipeline's min_steps) before
    # any stage runs, and the DiT, asked anyway, says so too.
    with pytest.raises(InvalidRequestError, match="infer_steps must be at least 2"):
        small_request("qwen_t2i", infer_steps=1)
    req = small_request("qwen_t2i", infer_steps=2)
    tensors = stage("encoder", tiny_models, "qwen_t2i").encode(req)
    object.__setattr__(req, "infer_steps", 1)  # past the request's own check
    with pytest.raises(InvalidRequestError, match="no valid noise schedule for 1 step"):
        stage("transformer", tiny_models, "qwen_t2i").denoise(req, tensors)


def test_seed_changes_the_result(tiny_models: Path) -> None:
    dit = stage("transformer", tiny_models, "qwen_t2i")
    tensors = stage("encoder", tiny_models, "qwen_t2i").encode(small_request("qwen_t2i"))
    a = dit.denoise(small_request("qwen_t2i", seed=1), tensors)["latents"]
    b = dit.denoise(small_request("qwen_t2i", seed=2), tensors)["latents"]
    again = dit.denoise(small_request("qwen_t2i", seed=1), tensors)["latents"]
    assert not torch.equal(a, b)
    assert torch.equal(a, again)  # no scheduler state leaks from one request to the next


# ---------------------------------------------------------------------------------------------
# Progress and cancellation
# ---------------------------------------------------------------------------------------------
def test_should_stop_cancels_at_a_step_boundary(tiny_models: Path) -> None:
    req = small_request("wan_t2v", infer_steps=4)
    tensors = stage("encoder", tiny_models, "wan_t2v").encode(req)
    done: list[int] = []
    with pytest.raises(StageCancelled) as info:
        stage("transformer", tiny_models, "wan_t2v").denoise(
            req, tensors, on_step=lambda k, n: done.append(k), should_stop=lambda: len(done) >= 2
        )
    assert done == [1, 2]
    assert (info.value.completed_steps, info.value.total_steps) == (2, 4)
    assert "after 2 of 4 steps" in str(info.value)


# ---------------------------------------------------------------------------------------------
# (b) components: missing ones fail clearly; each stage needs only its own
# ---------------------------------------------------------------------------------------------
OWN_COMPONENTS = {
    ("encoder", "wan_t2v"): ["tokenizer", "text_encoder"],
    ("encoder", "wan_i2v"): [
        "tokenizer",
        "text_encoder",
        "image_encoder",
        "image_processor",
        "vae",
    ],
    ("encoder", "qwen_t2i"): ["tokenizer", "text_encoder"],
    ("encoder", "qwen_i2i"): ["processor", "text_encoder", "vae"],
    ("encoder", "qwen_i2i_plus"): ["processor", "text_encoder", "vae"],
    # The DiT stage reads only the VAE's config.json (latent geometry), never its weights.
    ("transformer", "wan_t2v"): ["transformer", "scheduler", "vae/config.json"],
    ("transformer", "wan_i2v"): ["transformer", "scheduler", "vae/config.json"],
    ("transformer", "qwen_t2i"): ["transformer", "scheduler", "vae/config.json"],
    ("transformer", "qwen_i2i"): ["transformer", "scheduler", "vae/config.json"],
    ("transformer", "qwen_i2i_plus"): ["transformer", "scheduler", "vae/config.json"],
    ("decoder", "wan_t2v"): ["vae"],
    ("decoder", "wan_i2v"): ["vae"],
    ("decoder", "qwen_t2i"): ["vae"],
    ("decoder", "qwen_i2i"): ["vae"],
    ("decoder", "qwen_i2i_plus"): ["vae"],
}


def _partial_folder(src: Path, dst: Path, parts: list[str]) -> Path:
    """A model folder holding only ``parts`` (symlinks to the full build)."""
    dst.mkdir()
    for part in parts:
        target = dst / part
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(src / part)
    return dst


def _make_stage(kind: str, folder: Path, task: str) -> Any:
    return ADAPTERS[kind].for_task(folder, task)


@pytest.mark.parametrize(("kind", "task"), sorted(OWN_COMPONENTS))
def test_stage_loads_only_its_components(
    tiny_models: Path, tmp_path: Path, kind: str, task: str
) -> None:
    parts = OWN_COMPONENTS[(kind, task)]
    _make_stage(kind, _partial_folder(tiny_models / task, tmp_path / "own", parts), task).load()
    # Without any one of them, load() names the folder and the component.
    missing = parts[0].split("/")[0]
    rest = [p for p in parts if not p.startswith(missing)]
    folder = _partial_folder(tiny_models / task, tmp_path / "partial", rest)
    with pytest.raises(ModelLoadError) as info:
        _make_stage(kind, folder, task).load()
    message = str(info.value)
    assert f"model folder {folder} has no {missing!r} component" in message
    assert f"(expected {folder / missing})" in message


def test_missing_model_folder(tmp_path: Path) -> None:
    stage_ = DecoderAdapter.for_task(tmp_path / "nowhere", "wan_t2v")  # constructor does no I/O
    with pytest.raises(ModelLoadError, match="does not exist"):
        stage_.load()


def test_wrong_folder_for_task(tiny_models: Path) -> None:
    """A folder of another pipeline is refused at load, before any weight is read, with the
    class it is and the task that serves it (tests/unit/test_model_folder.py has every case)."""
    with pytest.raises(ModelLoadError, match=r"is a WanPipeline checkpoint .* served by "
                       r"diffring as wan_t2v .* configured for wan_i2v"):
        TransformerAdapter.for_task(tiny_models / "wan_t2v", "wan_i2v").load()
    # The Edit-2511 folder under the first Edit's task would give other pixels: refused.
    for kind in ADAPTERS:
        with pytest.raises(ModelLoadError, match=r"QwenImageEditPlusPipeline checkpoint .* "
                           r"Set task to 'i2i_plus'"):
            ADAPTERS[kind].for_task(tiny_models / "qwen_i2i_plus", "qwen_i2i").load()


def test_stage_settings_are_checked(tiny_models: Path) -> None:
    with pytest.raises(ModelLoadError, match="dtype must be one of float32, bfloat16"):
        EncoderAdapter.for_task(tiny_models / "wan_t2v", "wan_t2v", dtype="float64")
    with pytest.raises(ModelLoadError, match="device must be"):
        EncoderAdapter.for_task(tiny_models / "wan_t2v", "wan_t2v", device="gpu0")
    with pytest.raises(ModelLoadError, match="unknown task 'sdxl'"):
        DecoderAdapter.for_task(tiny_models / "wan_t2v", "sdxl")
    with pytest.raises(ModelLoadError, match="unknown attention backend 'xformers'"):
        TransformerAdapter.for_task(tiny_models / "wan_t2v", "wan_t2v", attention="xformers")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="CUDA is not available"):
            DecoderAdapter.for_task(tiny_models / "wan_t2v", "wan_t2v", device="cuda:0").load()
    with pytest.raises(ModelLoadError, match="call load"):
        EncoderAdapter.for_task(tiny_models / "wan_t2v", "wan_t2v").encode(small_request("wan_t2v"))


@pytest.mark.parametrize(
    ("backend", "package"), [("flash_attn", "flash-attn"), ("sage_attn", "sageattention")]
)
def test_attention_backend_unavailable_names_the_package(
    tiny_models: Path, backend: str, package: str
) -> None:
    module = package.replace("-", "_")
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{package} is installed here")
    dit = TransformerAdapter.for_task(tiny_models / "qwen_t2i", "qwen_t2i", attention=backend)
    with pytest.raises(ModelLoadError, match=f"needs the '{package}' package.*pip install"):
        dit.load()


@pytest.mark.parametrize("task", ["wan_i2v", "qwen_i2i"])
def test_kernel_attention_processors_match_diffusers(tiny_models: Path, task: str) -> None:
    """The processors behind ``sage_attn`` (which needs CUDA) give the same DiT output as
    diffusers' processors when their kernel is SDPA: only the kernel differs."""
    from diffusers import QwenImageTransformer2DModel, WanTransformer3DModel

    from workers.models.dit.attention import install_kernel_processors, sdpa_kernel

    cls = WanTransformer3DModel if task.startswith("wan") else QwenImageTransformer2DModel
    model = cls.from_pretrained(tiny_models / task / "transformer").eval()
    gen = torch.Generator().manual_seed(0)
    if task == "wan_i2v":
        inputs: dict[str, Any] = {
            "hidden_states": torch.randn(1, 36, 3, 4, 4, generator=gen),
            "timestep": torch.tensor([500.0]),
            "encoder_hidden_states": torch.randn(1, 512, 32, generator=gen),
            "encoder_hidden_states_image": torch.randn(1, 17, 32, generator=gen),
        }
    else:
        inputs = {
            "hidden_states": torch.randn(1, 8, 64, generator=gen),
            "timestep": torch.tensor([0.5]),
            "encoder_hidden_states": torch.randn(1, 6, 32, generator=gen),
            "encoder_hidden_states_mask": None,
            "img_shapes": [[(1, 2, 2), (1, 2, 2)]],
        }
    with torch.no_grad():
        reference = model(**inputs, return_dict=False)[0]
        assert install_kernel_processors(model, sdpa_kernel) > 0
        ours = model(**inputs, return_dict=False)[0]
    assert torch.equal(ours, reference)


# ---------------------------------------------------------------------------------------------
# Inputs the stages refuse
# ---------------------------------------------------------------------------------------------
def test_input_image_is_checked(tiny_models: Path, input_png: bytes) -> None:
    enc = stage("encoder", tiny_models, "wan_i2v")
    with pytest.raises(StageInputError, match="needs an input image"):
        enc.encode(small_request("wan_i2v"), None)
    with pytest.raises(StageInputError, match="could not be decoded"):
        enc.encode(small_request("wan_i2v"), b"certainly not a png")
    with pytest.raises(StageInputError, match="takes no input image"):
        stage("encoder", tiny_models, "wan_t2v").encode(small_request("wan_t2v"), input_png)


def test_stage_inputs_are_checked(tiny_models: Path) -> None:
    dit = stage("transformer", tiny_models, "wan_t2v")
    with pytest.raises(StageInputError, match="missing tensor 'negative_prompt_embeds'"):
        dit.denoise(small_request("wan_t2v"), {"prompt_embeds": torch.zeros(1, 512, 32)})
    with pytest.raises(StageInputError, match="loaded for wan_t2v, got a qwen_t2i request"):
        dit.denoise(small_request("qwen_t2i"), {})
    with pytest.raises(StageInputError, match="missing tensor 'latents'"):
        stage("decoder", tiny_models, "qwen_t2i").decode(small_request("qwen_t2i"), {})


# ---------------------------------------------------------------------------------------------
# (c) requests
# ---------------------------------------------------------------------------------------------
BAD_REQUESTS: list[tuple[dict[str, Any], str]] = [
    ({"task": "sdxl"}, "unknown task 'sdxl'; expected one of wan_t2v"),
    ({"prompt": "   "}, "prompt must be a non-empty string"),
    ({"prompt": None}, "prompt must be a non-empty string"),
    ({"infer_steps": 0}, "infer_steps must be between 1 and 1000, got 0"),
    ({"infer_steps": 2.5}, "infer_steps must be an integer, got 2.5"),
    ({"seed": -1}, "seed must be between 0 and"),
    ({"seed": True}, "seed must be an integer, got True"),
    ({"height": 0}, "height must be between 16 and 1920, got 0"),  # Wan2.1's limit
    ({"height": 40}, "height must be a multiple of 16, got 40"),
    ({"width": 8192}, "width must be between 16 and 1920, got 8192"),
    ({"num_frames": 10}, "num_frames must be 4k+1 (1, 5, 9, ... 81), got 10"),
    ({"fps": 0}, "fps must be between 1 and 240, got 0"),
    ({"guidance_scale": math.nan}, "guidance_scale must be a finite number"),
    ({"guidance_scale": -1.0}, "guidance_scale must be >= 0.0, got -1.0"),
    ({"true_cfg_scale": 4.0}, "true_cfg_scale applies to Qwen tasks only"),
    ({"max_sequence_length": 1000}, "max_sequence_length must be between 1 and 512"),
    ({"task": "wan_i2v", "max_sequence_length": 256}, "must be 512 for wan_i2v"),
    ({"task": "qwen_t2i", "num_frames": 9}, "num_frames must be 1 for an image task"),
    ({"task": "qwen_t2i", "fps": 8}, "fps applies to video tasks only"),
    ({"task": "qwen_i2i", "width": None}, "give both height and width, or neither"),
    ({"task": "qwen_t2i", "true_cfg_scale": "4"}, "true_cfg_scale must be a finite number"),
    ({"task": "qwen_t2i", "max_sequence_length": 2048}, "between 1 and 1024"),
    ({"negative_prompt": 3}, "negative_prompt must be a string"),
]


@pytest.mark.parametrize(("changes", "message"), BAD_REQUESTS)
def test_bad_requests_are_rejected(changes: dict[str, Any], message: str) -> None:
    task = changes.get("task", "wan_t2v")
    fields: dict[str, Any] = {"task": task, "prompt": PROMPT, **SMALL.get(task, {})}
    if task in ("qwen_t2i", "qwen_i2i"):
        fields.pop("fps", None)
    fields.update(changes)
    with pytest.raises(InvalidRequestError) as info:
        GenerationRequest(**fields)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_request_defaults_and_round_trip() -> None:
    import msgpack

    req = GenerationRequest(task="wan_t2v", prompt="a cat")
    assert (req.height, req.width, req.num_frames, req.fps) == (480, 832, 81, 16)
    assert (req.infer_steps, req.guidance_scale, req.negative_prompt) == (50, 5.0, "")
    assert GenerationRequest.defaults_for("qwen_t2i")["true_cfg_scale"] == 4.0
    edit = GenerationRequest.from_dict({"task": "qwen_i2i", "prompt": "make it red"})
    assert (edit.height, edit.width, edit.num_frames, edit.fps) == (None, None, 1, None)
    qwen = GenerationRequest(task="qwen_t2i", prompt="x", true_cfg_scale=5)
    assert isinstance(qwen.true_cfg_scale, float)

    for original in (req, edit, qwen, small_request("wan_i2v")):
        wire_bytes = msgpack.packb(original.to_dict())
        assert GenerationRequest.from_dict(msgpack.unpackb(wire_bytes)) == original

    with pytest.raises(InvalidRequestError, match=r"unknown request field\(s\): colour, steps"):
        GenerationRequest.from_dict({"task": "wan_t2v", "prompt": "x", "steps": 4, "colour": 1})
    with pytest.raises(InvalidRequestError, match="'prompt' is required"):
        GenerationRequest.from_dict({"task": "wan_t2v"})
    with pytest.raises(InvalidRequestError, match="must be a map"):
        GenerationRequest.from_dict(["wan_t2v"])  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="infer_steps must be between"):
        req.replace(infer_steps=0)


def test_tiny_model_build_is_idempotent(tiny_models: Path) -> None:
    from modelkit import tiny as script

    marker = tiny_models / "wan_t2v" / script.MARKER_NAME
    before = marker.stat().st_mtime_ns
    script.build_task(tiny_models, "wan_t2v", seed=0)
    assert marker.stat().st_mtime_ns == before


@pytest.fixture(autouse=True, scope="module")
def _release_stages() -> Iterator[None]:
    yield
    STAGES.clear()


# ---------------------------------------------------------------------------------------------
# DiT options: CFG batching, compile wiring, warm-up
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("task", ["wan_t2v", "wan_i2v", "qwen_t2i", "qwen_i2i",
                                  "qwen_i2i_plus"])
def test_cfg_batch_equals_two_forwards(tiny_models: Path, input_png: bytes, task: str) -> None:
    """One batch-2 forward computes what two batch-1 forwards do (other kernel shapes, so
    equal to float32 rounding, not bit for bit). Qwen's negative prompt is shorter than the
    prompt here: the padded, masked path."""
    req = small_request(task)
    image = input_png if task in IMAGE_INPUT_TASKS else None
    cond = stage("encoder", tiny_models, task).encode(req, image)
    if task.startswith("qwen"):
        assert cond["prompt_embeds"].shape[1] != cond["negative_prompt_embeds"].shape[1]
    two = stage("transformer", tiny_models, task).denoise(req, wire(cond))["latents"]
    batched = TransformerAdapter.for_task(tiny_models / task, task, cfg_batch=True)
    batched.load()
    one = batched.denoise(req, wire(cond))["latents"]
    assert one.shape == two.shape
    rel = float((one - two).norm() / two.norm())
    assert rel < 1e-4, rel


def test_compile_is_applied_at_load(tiny_models: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from diffusers.models.modeling_utils import ModelMixin

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(ModelMixin, "compile_repeated_blocks",
                        lambda self, *a, **kw: calls.append(kw))
    adapter = TransformerAdapter.for_task(tiny_models / "wan_t2v", "wan_t2v", compile=True)
    assert calls == []  # constructors do no work
    adapter.load()
    assert calls == [{"dynamic": None}]


@pytest.mark.parametrize(("task", "shape"), [("wan_t2v", "32x32x5"), ("qwen_t2i", "32x48")])
def test_warm_up_runs_the_shapes(tiny_models: Path, task: str, shape: str,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    adapter = TransformerAdapter.for_task(tiny_models / task, task)
    adapter.load()
    seen: list[tuple[Any, ...]] = []
    real = adapter.denoise

    def spy(req: GenerationRequest, tensors: Mapping[str, torch.Tensor], *a: Any,
            **kw: Any) -> Any:
        seen.append((req.height, req.width, req.num_frames,
                     tuple(tensors["prompt_embeds"].shape)))
        return real(req, tensors, *a, **kw)

    monkeypatch.setattr(adapter, "denoise", spy)
    assert adapter.warm_up([shape]) > 0
    dims = tuple(int(x) for x in shape.split("x"))
    assert [s[:2] for s in seen] == [dims[:2]] * adapter.warmup_variants
    if task.startswith("qwen"):  # two text lengths: a compiled DiT gets it as dynamic
        assert seen[0][3][1] != seen[1][3][1]
    wrong = "32x32" if task == "wan_t2v" else "32x32x5"
    with pytest.raises(ModelLoadError, match=f"{task} needs HxW"):
        adapter.warm_up([wrong])
    with pytest.raises(ModelLoadError, match="not HxW or HxWxF"):
        adapter.warm_up(["big"])


@pytest.mark.parametrize("backend", ["sdpa_cudnn", "sdpa_flash"])
def test_pinned_sdpa_needs_cuda(tiny_models: Path, backend: str) -> None:
    adapter = TransformerAdapter.for_task(tiny_models / "wan_t2v", "wan_t2v", attention=backend)
    with pytest.raises(ModelLoadError, match="runs on CUDA devices only"):
        adapter.load()
