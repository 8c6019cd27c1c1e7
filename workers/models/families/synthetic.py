"""The ``synthetic`` model family: three stages that take a configured time and produce tensors
of configured shapes, with no model library, so that the runtime's own cost (rings, control
channel, tensor hops) can be measured and scaled.

Its "model folder" holds one JSON file, ``synthetic.json`` (:class:`SyntheticConfig`)::

    {
      "format": "diffring-synthetic", "version": 1,
      "mode": "sleep",                 # or "busy": spin the CPU / keep the GPU busy instead
      "encoder_s": 0.005,              # seconds per request in the encoder
      "step_s": 0.1,                   # seconds per denoising step (infer_steps steps)
      "decoder_s": 0.005,              # seconds per request in the decoder
      "phase1": {"prompt_embeds": {"shape": [1, 64, 256], "dtype": "float32"}},
      "phase2": {"latents": {"shape": [1, 16, 8, 8], "dtype": "float32"}}
    }

Each stage's time is the configured one from the start of its ``encode`` / ``denoise`` step /
``decode`` to its end, the work of making the tensors included (a stage only runs longer when
that work alone takes longer). The transformer reports each of its ``infer_steps`` steps, so
progress events flow as with a real DiT.

Outputs are deterministic: the phase1 tensors from the seed; the phase2 tensors from the seed
and a CRC of every phase1 byte; the decoded PNG (``height`` x ``width``, a gradient pattern)
from the seed and a CRC of every phase2 byte. So a byte lost or changed on either tensor hop
changes the result, and the same request always gives the same PNG bytes.
"""

from __future__ import annotations

import json
import math
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Final, Literal

import numpy as np

if TYPE_CHECKING:  # annotations only: a synthetic worker never imports torch
    import torch

from contracts.errors import InvalidRequestError, ModelLoadError, StageInputError
from contracts.request import GenerationRequest

from .. import loop_state
from ..base import (
    Artifact,
    DecoderAdapter,
    EncoderAdapter,
    StepCallback,
    StopCheck,
    TransformerAdapter,
)
from ..components import check_request_task
from ..loop_state import LoopHooks
from ..media import encode_png

CONFIG_NAME: Final = "synthetic.json"
FORMAT: Final = "diffring-synthetic"
VERSION: Final = 1
MODES: Final = ("sleep", "busy")
# Tensor dtypes a synthetic stage can produce (what the tensor plane can carry).
DTYPES: Final = ("float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8")
_PATTERN: Final = 4096
"""Random values drawn per tensor; the tensor repeats them (drawing 100 MB of random numbers
would take longer than the stage times worth measuring)."""


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor a synthetic stage produces."""

    shape: tuple[int, ...]
    """Dimensions, each >= 1."""
    dtype: str = "float32"
    """One of :data:`DTYPES`."""

    def __post_init__(self) -> None:
        if not isinstance(self.shape, tuple) or not self.shape or any(
            not isinstance(d, int) or isinstance(d, bool) or d < 1 for d in self.shape
        ):
            raise ModelLoadError(
                f"tensor shape must be a list of positive integers, got {self.shape!r}"
            )
        if self.dtype not in DTYPES:
            raise ModelLoadError(f"tensor dtype must be one of {', '.join(DTYPES)}, "
                                 f"got {self.dtype!r}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _default_phase1() -> dict[str, TensorSpec]:
    return {"prompt_embeds": TensorSpec((1, 64, 256))}


def _default_phase2() -> dict[str, TensorSpec]:
    return {"latents": TensorSpec((1, 16, 8, 8))}


@dataclass(frozen=True)
class SyntheticConfig:
    """The contents of ``synthetic.json``: stage times and tensor shapes."""

    mode: str = "sleep"
    """``sleep`` (the stage waits: costs no CPU, so many workers fit on few cores) or ``busy``
    (the stage spins the CPU, or on a GPU device keeps the GPU busy with matmuls)."""
    encoder_s: float = 0.005
    """Seconds the encoder takes per request."""
    step_s: float = 0.1
    """Seconds the transformer takes per denoising step (a request runs ``infer_steps``)."""
    decoder_s: float = 0.005
    """Seconds the decoder takes per request (the PNG encoding included)."""
    phase1: Mapping[str, TensorSpec] = field(default_factory=_default_phase1)
    """Tensors the encoder hands to the transformer, by name."""
    phase2: Mapping[str, TensorSpec] = field(default_factory=_default_phase2)
    """Tensors the transformer hands to the decoder, by name."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ModelLoadError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        for name in ("encoder_s", "step_s", "decoder_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not (
                0 <= value <= 3600
            ):
                raise ModelLoadError(f"{name} must be a number of seconds in [0, 3600], "
                                     f"got {value!r}")
        for phase in ("phase1", "phase2"):
            tensors = getattr(self, phase)
            if not tensors:
                raise ModelLoadError(f"{phase} must name at least one tensor")
            for name, spec in tensors.items():
                if not isinstance(name, str) or not name:
                    raise ModelLoadError(f"{phase} tensor names must be non-empty strings")
                if not isinstance(spec, TensorSpec):
                    raise ModelLoadError(f"{phase}.{name} must be a TensorSpec")

    # -- file ------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": FORMAT, "version": VERSION}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("phase1", "phase2"):
                value = {n: {"shape": list(s.shape), "dtype": s.dtype} for n, s in value.items()}
            out[f.name] = value
        return out

    @classmethod
    def from_json(cls, data: Any, where: str) -> SyntheticConfig:
        """Parse a ``synthetic.json`` map; an unknown key or a bad value is an error that
        names the file and the key."""
        if not isinstance(data, dict):
            raise ModelLoadError(f"{where} must hold a JSON object")
        data = dict(data)
        if data.pop("format", None) != FORMAT or data.pop("version", None) != VERSION:
            raise ModelLoadError(
                f"{where} is not a synthetic model config (want \"format\": \"{FORMAT}\", "
                f"\"version\": {VERSION}); write one with `python -m modelkit.tiny "
                "--tasks synthetic --out DIR`"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ModelLoadError(f"{where}: unknown key(s) {', '.join(unknown)} "
                                 f"(known: {', '.join(sorted(known))})")
        try:
            for phase in ("phase1", "phase2"):
                if phase in data:
                    data[phase] = _tensor_specs(data[phase], f"{where}: {phase}")
            return cls(**data)
        except ModelLoadError as exc:
            raise ModelLoadError(f"{where}: {exc}") from None

    @classmethod
    def read(cls, folder: Path) -> SyntheticConfig:
        path = folder / CONFIG_NAME
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise ModelLoadError(
                f"model folder {folder} has no readable {CONFIG_NAME} ({exc}); the synthetic "
                "pipeline's folder holds only that file: write one with `python "
                "-m modelkit.tiny --tasks synthetic --out DIR`"
            ) from exc
        except ValueError as exc:
            raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
        return cls.from_json(data, str(path))

    def write(self, folder: Path) -> Path:
        """Write ``folder/synthetic.json`` (creating the folder)."""
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / CONFIG_NAME
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path


def _tensor_specs(raw: Any, where: str) -> dict[str, TensorSpec]:
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{where} must map tensor names to {{shape, dtype}}")
    out = {}
    for name, spec in raw.items():
        if not isinstance(spec, dict) or set(spec) - {"shape", "dtype"} or "shape" not in spec:
            raise ModelLoadError(f"{where}.{name} must be {{\"shape\": [...], \"dtype\": ...}}")
        shape = spec["shape"]
        out[str(name)] = TensorSpec(tuple(shape) if isinstance(shape, list) else shape,
                                    spec.get("dtype", "float32"))
    return out


def write_config(folder: str | Path, **settings: Any) -> Path:
    """Write a synthetic model folder: :class:`SyntheticConfig` defaults with ``settings``
    (phase1 / phase2 as ``{name: {"shape": [...], "dtype": ...}}``) applied."""
    for phase in ("phase1", "phase2"):
        if phase in settings:
            settings[phase] = _tensor_specs(settings[phase], phase)
    return SyntheticConfig(**settings).write(Path(folder))


# -- tensors -----------------------------------------------------------------------------------
def _seed_words(*parts: int | str) -> list[int]:
    """Seed material for numpy's generator: ints as they are, strings through crc32."""
    return [p if isinstance(p, int) else zlib.crc32(p.encode()) for p in parts]


def _make(spec: TensorSpec, *seed: int | str) -> np.ndarray:
    """A deterministic array of ``spec``'s shape: a random pattern, repeated."""
    rng = np.random.default_rng(_seed_words(*seed))
    n = min(spec.numel, _PATTERN)
    if spec.dtype in ("float32", "float16", "bfloat16"):
        base: np.ndarray = rng.standard_normal(n, dtype=np.float32)
    else:
        info = np.iinfo(np.dtype(spec.dtype))
        base = rng.integers(info.min, info.max, n, dtype=np.dtype(spec.dtype), endpoint=True)
    return np.resize(base, spec.shape)


def _host_bytes(tensor: Any) -> memoryview:
    """The raw bytes of a tensor (numpy array or torch tensor on any device)."""
    if isinstance(tensor, np.ndarray):
        return np.ascontiguousarray(tensor).reshape(-1).view(np.uint8).data
    import torch

    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return flat.numpy().data


def digest(tensors: Mapping[str, Any]) -> int:
    """CRC32 over every byte of ``tensors`` (in name order, names included)."""
    crc = 0
    for name in sorted(tensors):
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(_host_bytes(tensors[name]), crc)
    return crc


class _SyntheticStage:
    """What the three synthetic stages share: the config, the device and the time spent.

    On ``cpu`` with numpy dtypes only (no bfloat16) the stages take and return numpy arrays,
    so a synthetic worker never imports torch; otherwise torch tensors on the device.
    """

    torch_model: ClassVar[bool] = False
    model_dir: Path
    device_name: str
    cfg: SyntheticConfig
    _require_loaded: Callable[[], None]

    def _resolve_settings(self) -> None:
        # No torch device or dtype objects: only the config file (the tensor dtypes are
        # its own; the service's dtype setting does not apply).
        self.cfg = SyntheticConfig.read(self.model_dir)

    def _load(self) -> None:
        pass

    @property
    def tensor_kind(self) -> Literal["torch", "numpy"]:
        self._require_loaded()
        specs = [*self.cfg.phase1.values(), *self.cfg.phase2.values()]
        if self.device_name == "cpu" and all(s.dtype != "bfloat16" for s in specs):
            return "numpy"
        return "torch"

    def _to_device(self, arrays: dict[str, np.ndarray], specs: Mapping[str, TensorSpec]
                   ) -> dict[str, Any]:
        if self.tensor_kind == "numpy":
            return {name: np.ascontiguousarray(arr.astype(specs[name].dtype, copy=False))
                    for name, arr in arrays.items()}
        import torch

        out = {}
        for name, arr in arrays.items():
            dtype = getattr(torch, specs[name].dtype)
            out[name] = torch.from_numpy(np.ascontiguousarray(arr)).to(self.device_name, dtype)
        return out

    def _spend(self, deadline: float) -> None:
        """Take up the stage's time until ``deadline`` (time.monotonic)."""
        if self.cfg.mode == "sleep":
            left = deadline - time.monotonic()
            if left > 0:
                time.sleep(left)
            return
        if self.device_name.startswith("cuda"):
            self._busy_gpu(deadline)
            return
        while time.monotonic() < deadline:  # busy: hold a core (and the GIL), as compute would
            pass

    def _busy_gpu(self, deadline: float) -> None:
        import torch

        a = torch.ones(1024, 1024, device=self.device_name)
        while time.monotonic() < deadline:
            a = a @ a * (1.0 / 1024)
            torch.cuda.synchronize(self.device_name)


class SyntheticEncoder(_SyntheticStage, EncoderAdapter):
    """Encoder stage: the phase1 tensors, from the seed, after ``encoder_s``."""

    def encode(self, req: GenerationRequest, image_bytes: bytes | None = None
               ) -> dict[str, Any]:
        self._require_loaded()
        check_request_task(req, self.task, "encoder")
        deadline = time.monotonic() + self.cfg.encoder_s
        arrays = {name: _make(spec, req.seed, "phase1", name)
                  for name, spec in self.cfg.phase1.items()}
        out = self._to_device(arrays, self.cfg.phase1)
        self._spend(deadline)
        return out


class SyntheticTransformer(_SyntheticStage, TransformerAdapter):
    """Transformer stage: ``infer_steps`` steps of ``step_s`` each, each reported; the phase2
    tensors from the seed and the phase1 bytes."""

    def _denoise(
        self,
        req: GenerationRequest,
        tensors: Mapping[str, Any],
        on_step: StepCallback | None = None,
        should_stop: StopCheck | None = None,
        loop: LoopHooks | None = None,
    ) -> dict[str, Any]:
        self._require_loaded()
        check_request_task(req, self.task, "transformer")
        if req.loras or (req.cache is not None and not req.cache_off):
            raise InvalidRequestError(f"{self.task} runs no model: it takes no loras or cache")
        _require(tensors, self.cfg.phase1, "transformer")
        steps = req.infer_steps
        assert steps is not None  # the request's defaults fill it
        start = time.monotonic()
        if loop is not None and loop.resume is not None:
            # The loop's state is its outputs and the step reached: from a checkpoint.
            out, first = dict(loop.resume.tensors), loop.resume.step
        else:
            crc = digest(tensors)
            arrays = {name: _make(spec, req.seed, "phase2", crc, name)
                      for name, spec in self.cfg.phase2.items()}
            out, first = self._to_device(arrays, self.cfg.phase2), 0
        for k in range(first + 1, steps + 1):
            self._check_stop(should_stop, k - 1, steps)
            # Step k ends (k - first) x step_s after the start (the first one also absorbs
            # making the outputs): the stage takes its configured time, and the oversleeping
            # of a busy host does not pile up over the steps. (Progress reports leave the
            # worker's loop in the background; they cost a step nothing.)
            self._spend(start + (k - first) * self.cfg.step_s)
            if on_step is not None:
                on_step(k, steps)
            loop_state.boundary(loop, k, steps, None, lambda: out)
        return out


    def warmup_inputs(self, req: GenerationRequest, variant: int) -> dict[str, torch.Tensor]:
        arrays = {name: _make(spec, variant, "phase1", name)
                  for name, spec in self.cfg.phase1.items()}
        return self._to_device(arrays, self.cfg.phase1)


class SyntheticDecoder(_SyntheticStage, DecoderAdapter):
    """Decoder stage: a ``height`` x ``width`` gradient picture from the seed and the phase2
    bytes, after ``decoder_s`` (PNG encoding included)."""

    def pixels(self, req: GenerationRequest, tensors: Mapping[str, Any]) -> np.ndarray:
        check_request_task(req, self.task, "decoder")
        _require(tensors, self.cfg.phase2, "decoder")
        assert req.height is not None and req.width is not None
        a, b, c, d0, d1, d2 = np.random.default_rng(
            _seed_words(req.seed, "pixels", digest(tensors))
        ).integers(1, 256, 6)
        y, x = np.mgrid[0 : req.height, 0 : req.width]
        rgb = np.stack([x * a + d0, y * b + d1, (x + y) * c + d2], axis=-1) % 256
        return rgb.astype(np.uint8)

    def decode_float(self, req: GenerationRequest, tensors: Mapping[str, Any]) -> np.ndarray:
        self._require_loaded()
        out: np.ndarray = self.pixels(req, tensors).astype(np.float32) / 255
        return out

    def decode_tensor(self, req: GenerationRequest, tensors: Mapping[str, Any]) -> torch.Tensor:
        import torch  # only benchmarks ask for a tensor; a synthetic worker runs without torch

        return torch.from_numpy(self.decode_float(req, tensors))

    def decode_pixels(self, req: GenerationRequest, tensors: Mapping[str, Any]) -> np.ndarray:
        """The decoder's critical path when it writes files in the background
        (``encode_queue``): ``decoder_s``, the PNG written afterwards off that path."""
        self._require_loaded()
        deadline = time.monotonic() + self.cfg.decoder_s
        pixels = self.pixels(req, tensors)
        self._spend(deadline)
        return pixels

    def decode(self, req: GenerationRequest, tensors: Mapping[str, Any]) -> Artifact:
        self._require_loaded()
        deadline = time.monotonic() + self.cfg.decoder_s
        pixels = self.pixels(req, tensors)
        artifact = Artifact(encode_png(pixels), "image/png", "png", pixels)
        self._spend(deadline)
        return artifact


def _require(tensors: Mapping[str, Any], specs: Mapping[str, TensorSpec], stage: str) -> None:
    """The inputs a stage expects, with the configured shapes; else a StageInputError."""
    for name, spec in specs.items():
        if name not in tensors:
            raise StageInputError(f"{stage} stage input is missing tensor {name!r} "
                                  f"(got: {', '.join(sorted(tensors))})")
        shape = tuple(int(d) for d in tensors[name].shape)
        if shape != spec.shape:
            raise StageInputError(f"{stage} stage input {name!r} has shape {shape}, the "
                                  f"synthetic config says {spec.shape}")
