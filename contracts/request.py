"""The task schema: one generation request, as every stage and the front door see it.

A request travels between stages as :meth:`GenerationRequest.to_dict` (a msgpack-able map);
the input image of I2V / I2I tasks does not: it is staged on its own and passed as encoded
bytes. Validation happens here, once, against the pipeline table
(:mod:`contracts.pipelines`), so the front door refuses what a worker could not serve.
Nothing here imports a model library.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from contracts.dit_request import CacheSpec, LoraRef, parse_cache, parse_loras
from contracts.errors import InvalidRequestError
from contracts.pipelines import TaskSpec, task_spec

_MAX_STEPS = 1000
_MAX_FRAMES = 1025
_MAX_FPS = 240
_MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class GenerationRequest:
    """One generation job. It travels between stages as ``to_dict()`` (a msgpack-able map);
    the input image of I2V / I2I tasks does not: it is passed separately as encoded bytes.

    Fields left as ``None`` take the task's default (:meth:`defaults_for`) in
    ``__post_init__``; fields whose task default is ``None`` stay ``None``.
    """

    task: str
    """A pipeline of :data:`contracts.pipelines.TASK_SPECS` (``wan_t2v``, ``wan22_a14b_i2v``,
    ``qwen_t2i``, ...)."""
    prompt: str
    """What to generate (or, for ``qwen_i2i`` / ``qwen_i2i_plus``, how to edit the input
    images). Not empty."""
    negative_prompt: str | None = None
    """What to steer away from; used when guidance is on. Wan: "" by default; Qwen: " "."""
    seed: int = 0
    """Seed of the initial noise, 0 <= seed < 2**63. The noise is drawn from a CPU generator,
    so a seed gives the same result on any device."""
    infer_steps: int | None = None
    """Denoising steps, 1..1000 (real models: 50)."""
    height: int | None = None
    """Output height in pixels, a multiple of 16. ``qwen_i2i`` / ``qwen_i2i_plus`` only:
    ``None`` together with ``width`` means ~1 megapixel with the (last) input image's aspect
    ratio."""
    width: int | None = None
    """Output width in pixels, a multiple of 16 (see ``height``)."""
    num_frames: int | None = None
    """Video frames, 4k+1 (Wan: 81 by default). Image tasks: 1."""
    fps: int | None = None
    """Frames per second of the MP4 (video tasks only; image tasks: None)."""
    guidance_scale: float | None = None
    """Wan: classifier-free guidance scale (> 1 enables CFG; default 5.0). Qwen: the embedded
    guidance of guidance-distilled checkpoints only; None for the published ones."""
    true_cfg_scale: float | None = None
    """Qwen only: true classifier-free guidance scale (> 1 enables it; default 4.0)."""
    guidance_scale_2: float | None = None
    """Wan2.2-A14B only: the guidance scale of the low-noise expert (``guidance_scale`` is
    the high-noise one's; T2V default 3.0, I2V 3.5). Whether CFG runs at all follows
    ``guidance_scale`` alone, as in diffusers' pipelines."""
    max_sequence_length: int | None = None
    """Text tokens given to the DiT. Wan: 512 (I2V checkpoints require exactly 512); Qwen:
    1..1024 (default 512)."""
    loras: tuple[LoraRef, ...] = ()
    """LoRA adapters for this request only, each a file stem in the DiT worker's
    ``transformer.lora_dir`` with a strength (:mod:`contracts.dit_request`); a map travels
    as a list of ``{name, strength}``. Empty: the base model."""
    cache: CacheSpec | None = None
    """Step cache for this request (``{kind, ...}``, diffusers' names); None: the DiT
    worker's default (``transformer.cache``), ``{"kind": "none"}``: no cache even there."""
    i2i_denoise_strength: float | None = None
    """Qwen only, 0 < strength <= 1 (LightX2V's field): how much of the input image is
    redrawn. The denoising starts from the input image's latents noised to the schedule's
    timestep at ``strength`` and runs the last ``infer_steps - int(infer_steps * (1 -
    strength))`` steps (diffusers' img2img). ``qwen_t2i``: image-to-image, with exactly one
    input image (diffusers' ``QwenImageImg2ImgPipeline``); the edits: the (one) input image
    is both the condition and the start. None: no input image for ``qwen_t2i``, the whole
    schedule from noise for the edits."""

    def __post_init__(self) -> None:
        spec = task_spec(self.task)
        # Lists of maps (the wire's form) become LoraRef / CacheSpec, checked.
        object.__setattr__(self, "loras", parse_loras(self.loras))
        if isinstance(self.cache, Mapping) and self.cache.get("kind") == "none":
            object.__setattr__(self, "cache", _NO_CACHE)
        elif self.cache != _NO_CACHE:
            object.__setattr__(self, "cache", parse_cache(self.cache))
        for name, default in spec.defaults.items():
            if getattr(self, name) is None and default is not None:
                object.__setattr__(self, name, default)
        # Accept ints where a float is meant (msgpack and JSON clients send 5 for 5.0).
        for name in ("guidance_scale", "true_cfg_scale", "i2i_denoise_strength",
                     "guidance_scale_2"):
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, name, float(value))
        self._validate(spec)

    # -- validation ---------------------------------------------------------------------------
    def _validate(self, spec: TaskSpec) -> None:
        def fail(message: str) -> NoReturn:
            raise InvalidRequestError(f"{self.task} request: {message}")

        def need_int(name: str, lo: int, hi: int) -> int:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                fail(f"{name} must be an integer, got {value!r}")
            if not lo <= value <= hi:
                fail(f"{name} must be between {lo} and {hi}, got {value}")
            return int(value)

        def need_float(name: str, lo: float) -> float:
            value = getattr(self, name)
            if not isinstance(value, float) or not math.isfinite(value):
                fail(f"{name} must be a finite number, got {value!r}")
            if value < lo:
                fail(f"{name} must be >= {lo}, got {value}")
            return float(value)

        if not isinstance(self.prompt, str) or not self.prompt.strip():
            fail("prompt must be a non-empty string")
        if not isinstance(self.negative_prompt, str):
            fail(f"negative_prompt must be a string, got {self.negative_prompt!r}")
        need_int("seed", 0, _MAX_SEED)
        steps = need_int("infer_steps", 1, _MAX_STEPS)
        if steps < spec.min_steps:
            fail(f"infer_steps must be at least {spec.min_steps} for {spec.family} models "
                 f"(their scheduler cannot run {steps}), got {steps}")

        if self.height is None or self.width is None:
            # Only a task without a default size (the edits) gets here: its output size may
            # come from the input image, but then for both sides.
            if (self.height is None) != (self.width is None):
                fail("give both height and width, or neither (size from the input image)")
        else:
            for name in ("height", "width"):
                value = need_int(name, spec.size_multiple, spec.max_side)
                if value % spec.size_multiple:
                    fail(f"{name} must be a multiple of {spec.size_multiple}, got {value}")
            if self.height * self.width > spec.max_pixels:
                fail(f"height x width {self.height}x{self.width} is "
                     f"{self.height * self.width / 1e6:.1f} megapixels; {spec.name} serves at "
                     f"most {spec.max_pixels / 1e6:.1f} (e.g. {_largest(spec)}): ask for a "
                     "smaller size")

        if spec.output == "video":
            frames = need_int("num_frames", 1, _MAX_FRAMES)
            if (frames - 1) % spec.temporal_multiple:
                fail(
                    f"num_frames must be {spec.temporal_multiple}k+1 (1, 5, 9, ... 81), "
                    f"got {frames}"
                )
            need_int("fps", 1, _MAX_FPS)
        else:
            if self.num_frames != 1:
                fail(f"num_frames must be 1 for an image task, got {self.num_frames!r}")
            if self.fps is not None:
                fail("fps applies to video tasks only; leave it unset")

        if spec.family == "wan":
            need_float("guidance_scale", 0.0)
            if self.true_cfg_scale is not None:
                fail("true_cfg_scale applies to Qwen tasks only; Wan uses guidance_scale")
            need_int("max_sequence_length", 1, 512)
            if spec.experts == 2:
                need_float("guidance_scale_2", 0.0)
            elif self.guidance_scale_2 is not None:
                fail("guidance_scale_2 applies to the two-expert Wan2.2-A14B tasks only "
                     "(the low-noise expert's scale); leave it unset")
            if spec.name == "wan_i2v" and self.max_sequence_length != 512:
                # The I2V DiT splits image from text context at a fixed 512 text tokens.
                fail(f"max_sequence_length must be 512 for wan_i2v, got {self.max_sequence_length}")
        elif spec.family == "qwen":
            need_float("true_cfg_scale", 0.0)
            if self.guidance_scale is not None:
                need_float("guidance_scale", 0.0)
            need_int("max_sequence_length", 1, 1024)
        else:  # synthetic: no guidance is run, but a given scale must still be a number
            for name in ("guidance_scale", "true_cfg_scale"):
                if getattr(self, name) is not None:
                    need_float(name, 0.0)
            need_int("max_sequence_length", 1, 1024)
        if spec.family != "wan" and self.guidance_scale_2 is not None:
            fail("guidance_scale_2 applies to the two-expert Wan2.2-A14B tasks only")

        if self.i2i_denoise_strength is not None:
            if not spec.denoise_strength:
                fail("i2i_denoise_strength applies to Qwen-Image pipelines only; leave it unset")
            strength = need_float("i2i_denoise_strength", 0.0)
            if not 0.0 < strength <= 1.0:
                fail(f"i2i_denoise_strength must be in (0, 1] (1: the input image is noised "
                     f"away completely), got {strength}")

    # -- conversions --------------------------------------------------------------------------
    @classmethod
    def defaults_for(cls, task: str) -> dict[str, Any]:
        """The defaults a request of ``task`` gets for the fields it leaves unset."""
        return dict(task_spec(task).defaults)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def to_dict(self) -> dict[str, Any]:
        """Every field as plain ``str`` / ``int`` / ``float`` / ``None`` (msgpack-able);
        ``loras``, ``cache``, ``i2i_denoise_strength`` and ``guidance_scale_2`` as lists, maps
        and numbers, and only when set (a request without them travels exactly as before they
        existed)."""
        out = {name: getattr(self, name) for name in self.field_names()}
        if out["i2i_denoise_strength"] is None:
            del out["i2i_denoise_strength"]
        for name in ("loras", "cache", "guidance_scale_2"):
            if not out[name]:
                del out[name]
        if self.loras:
            out["loras"] = [r.to_dict() for r in self.loras]
        if self.cache is not None:
            out["cache"] = self.cache.to_dict()
        return out

    @property
    def cache_off(self) -> bool:
        """The request asked for no cache at all (``{"kind": "none"}``), overriding the
        worker's default."""
        return self.cache == _NO_CACHE

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GenerationRequest:
        """Build from a map such as :meth:`to_dict`'s; missing optional fields take the task's
        defaults, unknown keys are an error that names them."""
        if not isinstance(data, Mapping):
            raise InvalidRequestError(f"a request must be a map, got {type(data).__name__}")
        names = set(cls.field_names())
        unknown = sorted(str(k) for k in data if k not in names)
        if unknown:
            raise InvalidRequestError(
                f"unknown request field(s): {', '.join(unknown)}; "
                f"known fields: {', '.join(cls.field_names())}"
            )
        for required in ("task", "prompt"):
            if required not in data:
                raise InvalidRequestError(f"request field {required!r} is required")
        return cls(**dict(data))

    def replace(self, **changes: Any) -> GenerationRequest:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @property
    def spec(self) -> TaskSpec:
        return task_spec(self.task)


def _largest(spec: TaskSpec) -> str:
    """A square-ish example of the largest size ``spec`` serves, for an error message."""
    side = math.isqrt(spec.max_pixels) // spec.size_multiple * spec.size_multiple
    return f"{side}x{side}"


_NO_CACHE = CacheSpec("none")
"""``cache`` of a request that turns the worker's default cache off."""


RESIZE_MODES = ("adaptive", "keep_ratio_fixed_area", "fixed_min_area", "fixed_max_area",
                "fixed_min_side", "fixed_shape")
"""LightX2V's ``resize_mode`` values: how a Wan I2V request's output size follows its input
image (the front door picks the size and crops the image: controller/http/resize.py)."""
_FRONT_DOOR_DEFAULTS = ("aspect_ratio", "resize_mode")
REQUEST_DEFAULT_KEYS = (
    "negative_prompt", "infer_steps", "height", "width", "num_frames", "fps",
    "guidance_scale", "true_cfg_scale", "guidance_scale_2", "max_sequence_length",
    *_FRONT_DOOR_DEFAULTS,
)
"""What a service's ``request_defaults`` may set: the request fields a model's config knows
(the front door's ``aspect_ratio`` and ``resize_mode`` among them)."""


def check_request_defaults(task: str, defaults: Mapping[str, Any]) -> None:
    """Refuse (:class:`InvalidRequestError`) defaults that no request of ``task`` could
    take: an unknown key, or a value a request would be refused for."""
    unknown = sorted(k for k in defaults if k not in REQUEST_DEFAULT_KEYS)
    if unknown:
        raise InvalidRequestError(f"unknown key(s) {', '.join(unknown)}; it takes "
                                  f"{', '.join(REQUEST_DEFAULT_KEYS)}")
    mode = defaults.get("resize_mode")
    if mode is not None and mode not in RESIZE_MODES:
        raise InvalidRequestError(f"resize_mode must be one of {', '.join(RESIZE_MODES)}, got "
                                  f"{mode!r}")
    ratio = defaults.get("aspect_ratio")
    if ratio is not None and not (isinstance(ratio, str) and re.fullmatch(r"\d+:\d+", ratio)):
        raise InvalidRequestError(f"aspect_ratio must be 'W:H', got {ratio!r}")
    fields = {k: v for k, v in defaults.items() if k not in _FRONT_DOOR_DEFAULTS}
    GenerationRequest(task=task, prompt="request_defaults", **fields)
