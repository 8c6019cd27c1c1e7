"""Shared vocabulary of the stage adapters: the request, the artifact, the errors, the adapter
interfaces and the helpers they use to load components.

Importing this module is cheap: torch, diffusers and transformers are imported inside the
functions that need them, so the controller and the front door can build and validate
:class:`GenerationRequest` objects without loading a deep-learning stack.

Stage contract (one request, batch size 1):

* encoder:      ``encode(req, image_bytes) -> tensors``  (text/image conditioning)
* transformer:  ``denoise(req, tensors) -> tensors``     (owns scheduler and initial noise)
* decoder:      ``decode(req, tensors) -> Artifact``     (VAE decode + media encoding)

Nothing but the request and the tensor dictionary travels between stages, so each stage can
run in its own process on its own device.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, NoReturn, TypeVar

from rings.errors import StageError

if TYPE_CHECKING:
    import numpy as np
    import torch

logger = logging.getLogger(__name__)

# =============================================================================================
# Errors, in the project's tree (rings.errors): every one says what to fix.
# =============================================================================================


class ModelError(StageError):
    """Base class of the stage adapters' errors."""


class ModelLoadError(ModelError):
    """A stage could not load its components: missing folder or component, unreadable weights,
    an unavailable device, dtype or attention backend."""


class InvalidRequestError(ModelError, ValueError):
    """A request field has a value the task or the loaded model cannot serve."""


class StageInputError(ModelError, ValueError):
    """A stage received inputs that do not fit its contract: a missing or misshapen tensor,
    an input image that is missing, unexpected or not decodable."""


class StageCancelled(ModelError):
    """The caller asked a running stage to stop (``should_stop()`` returned True)."""

    def __init__(self, message: str, completed_steps: int = 0, total_steps: int = 0) -> None:
        super().__init__(message)
        self.completed_steps = completed_steps
        self.total_steps = total_steps


# =============================================================================================
# Tasks
# =============================================================================================

TASKS: tuple[str, ...] = ("wan_t2v", "wan_i2v", "qwen_t2i", "qwen_i2i")


@dataclass(frozen=True)
class TaskSpec:
    """Static facts about a task that hold for every checkpoint of its family."""

    name: str
    family: Literal["wan", "qwen"]
    output: Literal["video", "image"]
    needs_image: bool
    # Height and width must be multiples of this (VAE spatial factor x DiT patch size).
    size_multiple: int
    # Video frame counts must be ``temporal_multiple * k + 1`` (VAE temporal factor).
    temporal_multiple: int
    defaults: Mapping[str, Any] = field(default_factory=dict)


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

TASK_SPECS: dict[str, TaskSpec] = {
    "wan_t2v": TaskSpec(
        name="wan_t2v",
        family="wan",
        output="video",
        needs_image=False,
        size_multiple=16,
        temporal_multiple=4,
        defaults=_WAN_DEFAULTS,
    ),
    "wan_i2v": TaskSpec(
        name="wan_i2v",
        family="wan",
        output="video",
        needs_image=True,
        size_multiple=16,
        temporal_multiple=4,
        defaults=_WAN_DEFAULTS,
    ),
    "qwen_t2i": TaskSpec(
        name="qwen_t2i",
        family="qwen",
        output="image",
        needs_image=False,
        size_multiple=16,
        temporal_multiple=1,
        defaults={
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
        },
    ),
    "qwen_i2i": TaskSpec(
        name="qwen_i2i",
        family="qwen",
        output="image",
        needs_image=True,
        size_multiple=16,
        temporal_multiple=1,
        defaults={
            "negative_prompt": " ",
            "infer_steps": 50,
            # None: output at ~1 megapixel with the input image's aspect ratio, as diffusers.
            "height": None,
            "width": None,
            "num_frames": 1,
            "fps": None,
            "guidance_scale": None,
            "true_cfg_scale": 4.0,
            "max_sequence_length": 512,
        },
    ),
}


def task_spec(task: str) -> TaskSpec:
    """The :class:`TaskSpec` of ``task``; an :class:`InvalidRequestError` names the known ones."""
    try:
        return TASK_SPECS[task]
    except (KeyError, TypeError):
        raise InvalidRequestError(
            f"unknown task {task!r}; expected one of {', '.join(TASKS)}"
        ) from None


# =============================================================================================
# Request
# =============================================================================================

_MAX_SIDE = 4096
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
    """One of ``wan_t2v``, ``wan_i2v``, ``qwen_t2i``, ``qwen_i2i``."""
    prompt: str
    """What to generate (or, for ``qwen_i2i``, how to edit the input image). Not empty."""
    negative_prompt: str | None = None
    """What to steer away from; used when guidance is on. Wan: "" by default; Qwen: " "."""
    seed: int = 0
    """Seed of the initial noise, 0 <= seed < 2**63. The noise is drawn from a CPU generator,
    so a seed gives the same result on any device."""
    infer_steps: int | None = None
    """Denoising steps, 1..1000 (real models: 50)."""
    height: int | None = None
    """Output height in pixels, a multiple of 16. ``qwen_i2i`` only: ``None`` together with
    ``width`` means ~1 megapixel with the input image's aspect ratio."""
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
    max_sequence_length: int | None = None
    """Text tokens given to the DiT. Wan: 512 (I2V checkpoints require exactly 512); Qwen:
    1..1024 (default 512)."""

    def __post_init__(self) -> None:
        spec = task_spec(self.task)
        for name, default in spec.defaults.items():
            if getattr(self, name) is None and default is not None:
                object.__setattr__(self, name, default)
        # Accept ints where a float is meant (msgpack and JSON clients send 5 for 5.0).
        for name in ("guidance_scale", "true_cfg_scale"):
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
        need_int("infer_steps", 1, _MAX_STEPS)

        if self.height is None or self.width is None:
            # Only a task without a default size (qwen_i2i) gets here: its output size may
            # come from the input image, but then for both sides.
            if (self.height is None) != (self.width is None):
                fail("give both height and width, or neither (size from the input image)")
        else:
            for name in ("height", "width"):
                value = need_int(name, spec.size_multiple, _MAX_SIDE)
                if value % spec.size_multiple:
                    fail(f"{name} must be a multiple of {spec.size_multiple}, got {value}")

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
            if spec.name == "wan_i2v" and self.max_sequence_length != 512:
                # The I2V DiT splits image from text context at a fixed 512 text tokens.
                fail(f"max_sequence_length must be 512 for wan_i2v, got {self.max_sequence_length}")
        else:
            need_float("true_cfg_scale", 0.0)
            if self.guidance_scale is not None:
                need_float("guidance_scale", 0.0)
            need_int("max_sequence_length", 1, 1024)

    # -- conversions --------------------------------------------------------------------------
    @classmethod
    def defaults_for(cls, task: str) -> dict[str, Any]:
        """The defaults a request of ``task`` gets for the fields it leaves unset."""
        return dict(task_spec(task).defaults)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def to_dict(self) -> dict[str, Any]:
        """Every field as plain ``str`` / ``int`` / ``float`` / ``None`` (msgpack-able)."""
        return {name: getattr(self, name) for name in self.field_names()}

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


# =============================================================================================
# Artifact
# =============================================================================================


@dataclass(frozen=True, eq=False)
class Artifact:
    """The decoded result: encoded media bytes plus the exact pixels they were made from."""

    data: bytes
    """The file: PNG for images, MP4 (H.264) for videos."""
    media_type: str
    """``image/png`` or ``video/mp4``."""
    extension: str
    """``png`` or ``mp4``."""
    frames: np.ndarray
    """uint8 pixels, (H, W, 3) for an image, (F, H, W, 3) for a video. MP4 is lossy; compare
    pixels here, not decoded MP4 frames."""
    fps: int | None = None
    """Frame rate of a video artifact."""


# =============================================================================================
# Settings helpers
# =============================================================================================

DTYPES: tuple[str, ...] = ("float32", "bfloat16")
ATTENTION_BACKENDS: tuple[str, ...] = ("sdpa", "flash_attn", "sage_attn")
_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")


def check_stage_settings(task: str, device: str, dtype: str) -> None:
    """Cheap checks of a stage's settings (no torch import), run in the constructor."""
    try:
        task_spec(task)
    except InvalidRequestError as e:
        raise ModelLoadError(str(e)) from None
    if not isinstance(device, str) or not _DEVICE_RE.match(device):
        raise ModelLoadError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")


def check_backend_name(backend: str) -> None:
    """Reject an unknown DiT attention backend name (availability is checked at load)."""
    if backend not in ATTENTION_BACKENDS:
        known = ", ".join(ATTENTION_BACKENDS)
        raise ModelLoadError(f"unknown attention backend {backend!r}; expected one of {known}")


def resolve_device(device: str) -> torch.device:
    """``torch.device`` for a stage setting, failing clearly if the GPU is not there."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(f"device {device!r} requested but CUDA is not available here")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ModelLoadError(
                f"device {device!r} requested but only {torch.cuda.device_count()} GPU(s) exist"
            )
        dev = torch.device("cuda", index)
    return dev


def resolve_dtype(dtype: str) -> torch.dtype:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


# =============================================================================================
# Loading helpers
# =============================================================================================

T = TypeVar("T")


def component_dir(model_dir: Path, component: str, task: str, role: str) -> Path:
    """The folder of one component, or a :class:`ModelLoadError` naming folder and component."""
    if not model_dir.is_dir():
        raise ModelLoadError(f"model folder {model_dir} does not exist (task {task})")
    path = model_dir / component
    if not path.is_dir():
        raise ModelLoadError(
            f"model folder {model_dir} has no {component!r} component (expected {path}); "
            f"the {role} stage of {task} needs it"
        )
    return path


def load_component(
    loader: Callable[[str], T], model_dir: Path, component: str, task: str, role: str
) -> T:
    """Run ``loader(path)`` on a component folder; any failure becomes a
    :class:`ModelLoadError` that names the component and the folder."""
    path = component_dir(model_dir, component, task, role)
    try:
        return loader(str(path))
    except ModelLoadError:
        raise
    except Exception as e:  # a corrupt or foreign folder: say which one
        raise ModelLoadError(
            f"could not load the {component!r} component from {path}: {type(e).__name__}: {e}"
        ) from e


def read_component_config(model_dir: Path, component: str, task: str, role: str) -> dict[str, Any]:
    """A component's ``config.json`` without loading its weights (the DiT stage reads the VAE's
    scale factors this way)."""
    path = component_dir(model_dir, component, task, role)
    for name in ("config.json", "scheduler_config.json"):
        file = path / name
        if file.is_file():
            try:
                data = json.loads(file.read_text())
            except (OSError, ValueError) as e:
                raise ModelLoadError(f"unreadable config {file}: {e}") from e
            if not isinstance(data, dict):
                raise ModelLoadError(f"config {file} is not a JSON object")
            return data
    raise ModelLoadError(f"component folder {path} has no config.json")


def read_model_index(model_dir: Path) -> dict[str, Any]:
    """``model_index.json`` of a diffusers folder, or ``{}`` if there is none."""
    file = model_dir / "model_index.json"
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"unreadable {file}: {e}") from e
    return data if isinstance(data, dict) else {}


def require_tensor(
    tensors: Mapping[str, torch.Tensor], name: str, stage: str, ndim: int | None = None
) -> torch.Tensor:
    """A named input tensor, or a :class:`StageInputError` that says which one is missing."""
    if name not in tensors:
        raise StageInputError(
            f"{stage} stage input is missing tensor {name!r} (got: {', '.join(sorted(tensors))})"
        )
    tensor = tensors[name]
    if ndim is not None and tensor.ndim != ndim:
        raise StageInputError(
            f"{stage} stage input {name!r} must have {ndim} dimensions, got shape "
            f"{tuple(tensor.shape)}"
        )
    return tensor


def check_request_task(req: GenerationRequest, task: str, stage: str) -> None:
    if not isinstance(req, GenerationRequest):
        raise StageInputError(f"{stage} stage expects a GenerationRequest, got {type(req)!r}")
    if req.task != task:
        raise StageInputError(f"{stage} stage was loaded for {task}, got a {req.task} request")


# =============================================================================================
# Adapter interfaces
# =============================================================================================

StepCallback = Callable[[int, int], None]
StopCheck = Callable[[], bool]


class StageAdapter(ABC):
    """Common part of the three stage adapters: settings, explicit ``load()``, guards.

    Constructors do no I/O and import nothing heavy; ``load()`` reads the folder.
    """

    role: ClassVar[str] = "?"

    def __init__(
        self, model_dir: str | Path, task: str, device: str = "cpu", dtype: str = "float32"
    ) -> None:
        check_stage_settings(task, device, dtype)
        self.model_dir = Path(model_dir)
        self.task = task
        self.spec = task_spec(task)
        self.device_name = device
        self.dtype_name = dtype
        self._loaded = False

    @property
    def loaded(self) -> bool:
        return self._loaded

    def load(self) -> None:
        """Load this stage's components (and only those) from the model folder."""
        if self._loaded:
            return
        if not self.model_dir.is_dir():
            raise ModelLoadError(f"model folder {self.model_dir} does not exist (task {self.task})")
        self.device = resolve_device(self.device_name)
        self.dtype = resolve_dtype(self.dtype_name)
        self._load()
        self._loaded = True

    @abstractmethod
    def _load(self) -> None:
        """Load the components; called once by :meth:`load`."""

    def _require_loaded(self) -> None:
        if not self._loaded:
            raise ModelLoadError(f"{self.role} stage of {self.task}: call load() first")

    def _component(self, loader: Callable[[str], T], component: str) -> T:
        return load_component(loader, self.model_dir, component, self.task, self.role)

    def _config(self, component: str) -> dict[str, Any]:
        return read_component_config(self.model_dir, component, self.task, self.role)


class EncoderAdapter(StageAdapter):
    """Stage 1: text (and image) conditioning for the DiT."""

    role = "encoder"

    @abstractmethod
    def encode(
        self, req: GenerationRequest, image_bytes: bytes | None = None
    ) -> dict[str, torch.Tensor]:
        """Everything the transformer stage needs, as contiguous tensors on this stage's
        device. ``image_bytes`` is the encoded input image (PNG/JPEG) of I2V / I2I tasks."""


class TransformerAdapter(StageAdapter):
    """Stage 2: the denoising loop. Owns the DiT, the whole scheduler and the initial noise."""

    role = "transformer"

    def __init__(
        self,
        model_dir: str | Path,
        task: str,
        device: str = "cpu",
        dtype: str = "float32",
        attention: str = "sdpa",
    ) -> None:
        super().__init__(model_dir, task, device, dtype)
        check_backend_name(attention)
        self.attention = attention

    @abstractmethod
    def denoise(
        self,
        req: GenerationRequest,
        tensors: Mapping[str, torch.Tensor],
        on_step: StepCallback | None = None,
        should_stop: StopCheck | None = None,
    ) -> dict[str, torch.Tensor]:
        """Run the denoising loop; returns ``{"latents": ...}`` in the VAE's latent layout.

        ``on_step(k, n)`` is called after step k of n; ``should_stop()`` is polled before
        every step and a True answer raises :class:`StageCancelled`.
        """

    @staticmethod
    def _check_stop(should_stop: StopCheck | None, done: int, total: int) -> None:
        if should_stop is not None and should_stop():
            raise StageCancelled(f"denoising cancelled after {done} of {total} steps", done, total)


class DecoderAdapter(StageAdapter):
    """Stage 3: VAE decode of the final latents and media encoding."""

    role = "decoder"

    @abstractmethod
    def decode_float(
        self, req: GenerationRequest, tensors: Mapping[str, torch.Tensor]
    ) -> np.ndarray:
        """Decoded pixels as float32 in [0, 1]: (H, W, 3) or (F, H, W, 3). Exactly what
        diffusers' pipeline returns with ``output_type="np"`` (minus the batch axis)."""

    def decode(self, req: GenerationRequest, tensors: Mapping[str, torch.Tensor]) -> Artifact:
        """Decode and encode the result as PNG (image) or MP4 (video)."""
        from .media import encode_mp4, encode_png, to_uint8

        pixels = to_uint8(self.decode_float(req, tensors))
        if self.spec.output == "image":
            return Artifact(encode_png(pixels), "image/png", "png", pixels)
        assert req.fps is not None  # validated for video tasks
        return Artifact(encode_mp4(pixels, req.fps), "video/mp4", "mp4", pixels, fps=req.fps)


@dataclass(frozen=True)
class ModelFamily:
    """The adapters that serve one task."""

    task: str
    encoder: type[EncoderAdapter]
    transformer: type[TransformerAdapter]
    decoder: type[DecoderAdapter]
    pipeline_class: str
    """Name of diffusers' one-process pipeline for this task (the reference in tests)."""
