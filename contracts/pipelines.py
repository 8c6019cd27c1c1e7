"""The pipeline table: every pipeline diffring serves, and the settings lists that go with it.

One row per pipeline (:class:`TaskSpec`), used everywhere a pipeline is named: the service
configuration (``model_cls`` + ``task`` -> pipeline), the request schema (defaults, sizes),
the front door (image or video, input image or not), the group launcher and the request
scripts. Nothing here imports a model library.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from contracts.errors import InvalidRequestError


@dataclass(frozen=True)
class TaskSpec:
    """Static facts about a pipeline that hold for every checkpoint of its family."""

    name: str
    """Pipeline name: ``wan_t2v``, ``wan_i2v`` (Wan2.1), ``wan22_a14b_t2v``,
    ``wan22_a14b_i2v``, ``wan22_5b_t2v``, ``wan22_5b_i2v`` (Wan2.2), ``qwen_t2i``,
    ``qwen_i2i``, ``qwen_i2i_plus`` or ``synthetic``."""
    family: Literal["wan", "qwen", "synthetic"]
    model_cls: str
    """LightX2V's ``model_cls`` of the family (config files name pipelines this way)."""
    task: str
    """LightX2V's ``task`` within the family (``t2v``, ``i2v``, ``t2i``, ``i2i``; diffring's
    ``i2i_plus`` for Qwen-Image-Edit-2509 / 2511)."""
    output: Literal["video", "image"]
    needs_image: bool
    size_multiple: int
    """Height and width must be multiples of this (VAE spatial factor x DiT patch size)."""
    temporal_multiple: int
    """Video frame counts must be ``temporal_multiple * k + 1`` (VAE temporal factor)."""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    """Request defaults for the fields a request leaves unset."""
    pipeline_class: str | None = None
    """diffusers' one-process pipeline this row follows operation by operation, and the
    ``_class_name`` a model folder's ``model_index.json`` must name to be served by it
    (checked at load: :mod:`workers.models.model_folder`). None for the synthetic pipeline,
    which has no model."""
    multi_image: bool = False
    """Whether a request may carry several input images (up to the front door's
    ``server.max_input_images``); else an image task takes exactly one."""
    min_steps: int = 1
    """The fewest denoising steps the family's scheduler can run (checked at the front door,
    so a request the DiT would fail is refused instead)."""
    max_side: int = 4096
    """The largest height or width a request may ask for, in pixels."""
    max_pixels: int = 4096 * 4096
    """The largest height x width a request may ask for (far past what the checkpoints
    were trained at, a request only runs out of device memory after minutes of work)."""
    image_to_image: bool = False
    """A text-to-image pipeline that also serves image-to-image: a request may carry one
    input image together with ``i2i_denoise_strength`` (diffusers' img2img pipeline of the
    same checkpoint, e.g. ``QwenImageImg2ImgPipeline``), and then must carry both."""
    denoise_strength: bool = False
    """Whether a request may carry ``i2i_denoise_strength`` (Qwen-Image: image-to-image
    from the T2I checkpoint; the edits: LightX2V's redraw strength of one input image)."""

    experts: int = 1
    """The DiTs of the checkpoint: 2 for Wan2.2-A14B (``transformer`` runs the high-noise
    steps, ``transformer_2`` the low-noise ones, switching at the folder's
    ``boundary_ratio``; a request may set ``guidance_scale_2`` for the second)."""
    expand_timesteps: bool = False
    """Wan2.2-TI2V-5B: the DiT takes a timestep per latent token (image-to-video keeps the
    first latent frame at timestep 0); the folder's ``model_index.json`` says so."""
    folder_class: str | None = None
    """The ``_class_name`` of the folders this row serves, where it is not
    ``pipeline_class``: TI2V-5B's one folder names ``WanPipeline`` and serves
    image-to-video through ``WanImageToVideoPipeline`` too."""

    @property
    def takes_image(self) -> bool:
        """Whether requests of this pipeline may carry an input image at all (then the
        controller stages input images for the encoders)."""
        return self.needs_image or self.image_to_image

    @property
    def folder_pipeline(self) -> str | None:
        """The ``_class_name`` a model folder of this row names."""
        return self.folder_class or self.pipeline_class


# Defaults follow the published checkpoints and diffusers' own pipeline defaults; the tiny
# test models are driven with small explicit sizes and step counts instead.
# Wan2.1 T2V and I2V share their request defaults (I2V checkpoints are also run at 480p, 81
# frames, 512 text tokens).
_WAN_DEFAULTS: Mapping[str, Any] = {
    "negative_prompt": "",
    "infer_steps": 50,
    "height": 480,
    "width": 832,
    "num_frames": 81,
    "fps": 16,
    "guidance_scale": 5.0,
    "true_cfg_scale": None,
    "max_sequence_length": 512,
}
_QWEN_DEFAULTS: Mapping[str, Any] = {
    # Qwen-Image runs true CFG against a blank negative prompt by default.
    "negative_prompt": " ",
    "infer_steps": 50,
    "height": 1328,
    "width": 1328,
    "num_frames": 1,
    "fps": None,
    "guidance_scale": None,
    "true_cfg_scale": 4.0,
    "max_sequence_length": 512,
}


# The synthetic pipeline has no model: each stage takes a configured time and produces tensors
# of configured shapes (``workers/models/families/synthetic.py``), so the runtime's own cost can be
# measured. Small defaults: a 64x64 PNG after 4 "denoising" steps.
_SYNTHETIC_DEFAULTS: Mapping[str, Any] = {
    "negative_prompt": "",
    "infer_steps": 4,
    "height": 64,
    "width": 64,
    "num_frames": 1,
    "fps": None,
    "guidance_scale": None,
    "true_cfg_scale": None,
    "max_sequence_length": 64,
}


# Size limits: the Wan2.1 checkpoints are trained at 480P and 720P; up to 1080p (twice
# 720P's area) is served. Qwen-Image is trained around 1328x1328 (1.8 megapixels); up to
# 3072 a side and 4.7 megapixels is served: LightX2V's published Qwen-Image configs ask for
# 2752x1536 (4.2 megapixels), and their users' configs must run as they are. Steps:
# Qwen-Image's scheduler (flow matching with ``shift_terminal``, 0.02 in the published
# folders) stretches its sigmas so that the last one lands on ``shift_terminal``, dividing by
# the first one's distance from it: with one step that is 0 / 0 and every timestep is NaN.
# Wan's UniPC runs one step.


def _wan(task: str, needs_image: bool, pipeline_class: str) -> TaskSpec:
    return TaskSpec(f"wan_{task}", "wan", "wan2.1", task, "video", needs_image, 16, 4,
                    _WAN_DEFAULTS, pipeline_class, max_side=1920, max_pixels=1920 * 1088)


# Wan2.2. A14B (T2V, I2V): two DiTs of the Wan2.1-14B shape; the defaults are Wan's published
# generation settings (40 steps; T2V guidance 4.0 for the high-noise expert and 3.0 for the
# low-noise one, I2V 3.5 for both), the sizes diffusers' examples use (T2V 720x1280, I2V
# 480x832). Its I2V has no CLIP image encoder: the first frame reaches the DiT through the VAE
# condition only, so its text length is free as in T2V. TI2V-5B: one DiT over the Wan2.2 VAE
# (48 latent channels, 16x spatial compression: sizes are multiples of 16 x the DiT's 2x2
# patch), 1280x704 at 121 frames and 24 fps, 50 steps, guidance 5.0; text-to-video and
# image-to-video on the one folder (``WanPipeline`` in its model index).
_WAN22_A14B: Mapping[str, Any] = {**_WAN_DEFAULTS, "infer_steps": 40}
_WAN22_5B: Mapping[str, Any] = {**_WAN_DEFAULTS, "height": 704, "width": 1280,
                                "num_frames": 121, "fps": 24}


def _wan22(task: str, needs_image: bool, pipeline_class: str, a14b: bool,
           **defaults: Any) -> TaskSpec:
    size = 16 if a14b else 32
    return TaskSpec(f"wan22_{'a14b' if a14b else '5b'}_{task}", "wan",
                    "wan2.2_moe" if a14b else "wan2.2", task, "video", needs_image, size, 4,
                    {**(_WAN22_A14B if a14b else _WAN22_5B), **defaults}, pipeline_class,
                    max_side=1920, max_pixels=1920 * 1088, experts=2 if a14b else 1,
                    expand_timesteps=not a14b, folder_class=None if a14b else "WanPipeline")


def _qwen(task: str, needs_image: bool, pipeline_class: str, multi_image: bool = False,
          **defaults: Any) -> TaskSpec:
    return TaskSpec(f"qwen_{task}", "qwen", "qwen_image", task, "image", needs_image, 16, 1,
                    {**_QWEN_DEFAULTS, **defaults}, pipeline_class, multi_image,
                    min_steps=2, max_side=3072, max_pixels=3072 * 1536,
                    image_to_image=not needs_image, denoise_strength=True)


# Qwen-Image-Edit-2509 and -2511 are a pipeline of their own (``qwen_i2i_plus``, config
# ``task: "i2i_plus"``), not ``qwen_i2i`` switched by the folder. Their folders name diffusers'
# QwenImageEditPlusPipeline, whose requests differ from the first Edit's: one to several
# input images, each named "Picture N:" in the prompt, each sized twice (about 384x384 for the
# vision-language encoder, 1024x1024 for the VAE latents), the output size taken from the last
# one. The front door refuses what the encoders cannot serve (a second image, too many
# images: 422 / 413) and it never reads a model folder: the controller may run where the
# weights are not. So what a service accepts has to follow from its config alone, and an
# operator reads it there. The folder is checked against the config when a stage loads
# (workers/models/model_folder.py): a 2511 folder under a qwen_i2i config is refused at start
# with an error naming QwenImageEditPlusPipeline and the task that serves it, rather than run
# as the first Edit with other pixels. LightX2V also selects the 2509 / 2511 variants by
# configuration (its i2i config files for them), not by looking into the folder.
TASK_SPECS: Final[dict[str, TaskSpec]] = {
    spec.name: spec
    for spec in (
        _wan("t2v", needs_image=False, pipeline_class="WanPipeline"),
        _wan("i2v", needs_image=True, pipeline_class="WanImageToVideoPipeline"),
        _wan22("t2v", False, "WanPipeline", a14b=True, height=720, width=1280,
               guidance_scale=4.0, guidance_scale_2=3.0),
        _wan22("i2v", True, "WanImageToVideoPipeline", a14b=True, guidance_scale=3.5,
               guidance_scale_2=3.5),
        _wan22("t2v", False, "WanPipeline", a14b=False),
        _wan22("i2v", True, "WanImageToVideoPipeline", a14b=False),
        _qwen("t2i", needs_image=False, pipeline_class="QwenImagePipeline"),
        # None: output at ~1 megapixel with the input image's aspect ratio, as diffusers.
        _qwen("i2i", needs_image=True, pipeline_class="QwenImageEditPipeline", height=None,
              width=None),
        # None: ~1 megapixel with the aspect ratio of the last input image, as diffusers.
        _qwen("i2i_plus", needs_image=True, pipeline_class="QwenImageEditPlusPipeline",
              multi_image=True, height=None, width=None),
        TaskSpec("synthetic", "synthetic", "synthetic", "t2i", "image", False, 8, 1,
                 _SYNTHETIC_DEFAULTS),
    )
}

TASKS: Final[tuple[str, ...]] = tuple(TASK_SPECS)
MODEL_TASKS: Final[dict[str, tuple[str, ...]]] = {}
for _spec in TASK_SPECS.values():
    MODEL_TASKS.setdefault(_spec.model_cls, ())
    MODEL_TASKS[_spec.model_cls] += (_spec.task,)


def task_spec(task: str) -> TaskSpec:
    """The :class:`TaskSpec` of pipeline ``task``; an :class:`InvalidRequestError` names the
    known ones."""
    try:
        return TASK_SPECS[task]
    except (KeyError, TypeError):
        raise InvalidRequestError(
            f"unknown task {task!r}; expected one of {', '.join(TASKS)}"
        ) from None


def pipeline_name(model_cls: str, task: str) -> str:
    """The pipeline a config's ``model_cls`` + ``task`` name (``wan2.1`` + ``t2v`` ->
    ``wan_t2v``); an :class:`InvalidRequestError` when the table has no such row."""
    for spec in TASK_SPECS.values():
        if spec.model_cls == model_cls and spec.task == task:
            return spec.name
    raise InvalidRequestError(f"no pipeline for model_cls {model_cls!r} and task {task!r}")


def served_classes() -> dict[str, TaskSpec]:
    """diffusers pipeline class -> the first row that serves folders naming it (a Wan2.2
    folder names the class of Wan2.1's: :func:`rows_for_folder` tells them apart)."""
    out: dict[str, TaskSpec] = {}
    for spec in TASK_SPECS.values():
        if spec.folder_pipeline is not None:
            out.setdefault(spec.folder_pipeline, spec)
    return out


def rows_for_folder(class_name: str, experts: int, expand_timesteps: bool) -> list[TaskSpec]:
    """The rows serving a model folder whose ``model_index.json`` names ``class_name`` with
    that many DiTs and that timestep mode (TI2V-5B's folder: two rows, T2V and I2V)."""
    return [s for s in TASK_SPECS.values() if s.folder_pipeline == class_name
            and s.experts == experts and s.expand_timesteps == expand_timesteps]


# -- settings every stage shares -----------------------------------------------------------
DTYPES: Final[tuple[str, ...]] = ("float32", "bfloat16")
ATTENTION_BACKENDS: Final[tuple[str, ...]] = (
    "sdpa", "sdpa_cudnn", "sdpa_flash", "flash_attn", "sage_attn", "fp8_cudnn", "sage2",
)
# How MP4 results are encoded: "auto" is NVENC when it opens on the machine, else libx264.
VIDEO_CODECS: Final[tuple[str, ...]] = ("auto", "libx264", "h264_nvenc")
X264_PRESETS: Final[tuple[str, ...]] = (
    "ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower",
    "veryslow",
)
_DEVICE_RE: Final = re.compile(r"^(cpu|cuda(:\d+)?)$")


def check_device(device: object) -> bool:
    """Whether ``device`` is a device setting diffring accepts: ``cpu``, ``cuda``, ``cuda:N``."""
    return isinstance(device, str) and bool(_DEVICE_RE.match(device))


def parse_shape(shape: object) -> tuple[int, ...]:
    """A geometry setting: ``"480x832x81"`` -> (480, 832, 81) (H, W, frames) for videos,
    ``"1024x1024"`` -> (1024, 1024) for images. A ``ValueError`` that shows the format."""
    dims: tuple[int, ...] = ()
    if isinstance(shape, str):
        try:
            dims = tuple(int(part) for part in shape.lower().split("x"))
        except ValueError:
            dims = ()
    if len(dims) not in (2, 3) or min(dims) <= 0:
        raise ValueError(f"shape {shape!r} is not HxW or HxWxF (e.g. '1024x1024', '480x832x81')")
    return dims
