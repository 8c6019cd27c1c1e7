"""The three stages as task-independent objects, and the one-process baseline.

Each stage is a thin facade over its family's adapter (``wan.py`` / ``qwen.py``): the
constructor only checks its settings; ``load()`` imports the model stack and reads the
stage's own components from the diffusers folder.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Generic, TypeVar

from .base import (
    Artifact,
    DecoderAdapter,
    EncoderAdapter,
    GenerationRequest,
    ModelLoadError,
    StageAdapter,
    StepCallback,
    StopCheck,
    TransformerAdapter,
    check_backend_name,
    check_stage_settings,
)
from .registry import get_family

if TYPE_CHECKING:
    import numpy as np
    import torch

A = TypeVar("A", bound=StageAdapter)


class _Stage(Generic[A]):
    role = "?"

    def __init__(self, model_dir: str | Path, task: str, device: str, dtype: str) -> None:
        check_stage_settings(task, device, dtype)
        self.model_dir = Path(model_dir)
        self.task = task
        self.device = device
        self.dtype = dtype
        self._adapter: A | None = None

    @property
    def loaded(self) -> bool:
        return self._adapter is not None

    def load(self) -> None:
        """Import the family and load this stage's components (idempotent)."""
        if self._adapter is None:
            adapter = self._make_adapter()
            adapter.load()
            self._adapter = adapter

    def _make_adapter(self) -> A:
        raise NotImplementedError

    @property
    def adapter(self) -> A:
        """The loaded family adapter (for tests and diagnostics)."""
        if self._adapter is None:
            raise ModelLoadError(f"{self.role} stage of {self.task}: call load() first")
        return self._adapter

    def __repr__(self) -> str:
        state = "loaded" if self.loaded else "not loaded"
        return (
            f"{type(self).__name__}({str(self.model_dir)!r}, {self.task!r}, "
            f"device={self.device!r}, dtype={self.dtype!r}; {state})"
        )


class EncoderStage(_Stage[EncoderAdapter]):
    """Stage 1: prompt (and input image) -> conditioning tensors for the DiT.

    Loads only the text encoder and tokenizer, plus for Wan I2V the CLIP image encoder, its
    processor and the VAE (for its encoder), plus for Qwen-Image-Edit the processor and VAE.
    """

    role = "encoder"

    def __init__(
        self, model_dir: str | Path, task: str, device: str = "cpu", dtype: str = "float32"
    ) -> None:
        super().__init__(model_dir, task, device, dtype)

    def _make_adapter(self) -> EncoderAdapter:
        return get_family(self.task).encoder(self.model_dir, self.task, self.device, self.dtype)

    def encode(
        self, req: GenerationRequest, image_bytes: bytes | None = None
    ) -> dict[str, torch.Tensor]:
        """Conditioning tensors (contiguous, on this stage's device). ``image_bytes``: the
        PNG/JPEG input image of I2V / I2I requests, ``None`` otherwise."""
        return self.adapter.encode(req, image_bytes)


class TransformerStage(_Stage[TransformerAdapter]):
    """Stage 2: the denoising loop. Loads the DiT and the scheduler; draws the initial noise
    from ``req.seed``; returns ``{"latents": ...}``."""

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

    def _make_adapter(self) -> TransformerAdapter:
        return get_family(self.task).transformer(
            self.model_dir, self.task, self.device, self.dtype, self.attention
        )

    def denoise(
        self,
        req: GenerationRequest,
        tensors: Mapping[str, torch.Tensor],
        on_step: StepCallback | None = None,
        should_stop: StopCheck | None = None,
    ) -> dict[str, torch.Tensor]:
        """Denoise; ``on_step(k, n)`` after each step, ``should_stop()`` polled before each
        step (True raises :class:`~workers.models.base.StageCancelled`)."""
        return self.adapter.denoise(req, tensors, on_step=on_step, should_stop=should_stop)


class DecoderStage(_Stage[DecoderAdapter]):
    """Stage 3: final latents -> PNG image or MP4 video. Loads only the VAE."""

    role = "decoder"

    def __init__(
        self, model_dir: str | Path, task: str, device: str = "cpu", dtype: str = "float32"
    ) -> None:
        super().__init__(model_dir, task, device, dtype)

    def _make_adapter(self) -> DecoderAdapter:
        return get_family(self.task).decoder(self.model_dir, self.task, self.device, self.dtype)

    def decode(self, req: GenerationRequest, tensors: Mapping[str, torch.Tensor]) -> Artifact:
        return self.adapter.decode(req, tensors)

    def decode_float(
        self, req: GenerationRequest, tensors: Mapping[str, torch.Tensor]
    ) -> np.ndarray:
        """The decoded pixels before uint8 conversion (float32 in [0, 1])."""
        return self.adapter.decode_float(req, tensors)


class LocalPipeline:
    """All three stages in one process: the ``--service all`` baseline. Load once, then
    :meth:`run` any number of requests of its task."""

    def __init__(
        self,
        model_dir: str | Path,
        task: str,
        device: str = "cpu",
        dtype: str = "float32",
        attention: str = "sdpa",
    ) -> None:
        self.encoder = EncoderStage(model_dir, task, device, dtype)
        self.transformer = TransformerStage(model_dir, task, device, dtype, attention)
        self.decoder = DecoderStage(model_dir, task, device, dtype)
        self.task = task

    def load(self) -> None:
        for stage in (self.encoder, self.transformer, self.decoder):
            stage.load()

    def run(
        self,
        req: GenerationRequest,
        image_bytes: bytes | None = None,
        on_step: StepCallback | None = None,
        should_stop: StopCheck | None = None,
    ) -> Artifact:
        self.load()
        conditioning = self.encoder.encode(req, image_bytes)
        latents = self.transformer.denoise(req, conditioning, on_step, should_stop)
        return self.decoder.decode(req, latents)


def run_pipeline(
    model_dir: str | Path,
    task: str,
    req: GenerationRequest,
    image_bytes: bytes | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    attention: str = "sdpa",
) -> Artifact:
    """Load the three stages and run one request in this process (encode -> denoise ->
    decode). For many requests keep a :class:`LocalPipeline` instead."""
    pipeline = LocalPipeline(model_dir, task, device, dtype, attention)
    pipeline.load()
    return pipeline.run(req, image_bytes)
