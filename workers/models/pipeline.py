"""All three stages in one process: the reference for fidelity and the ``--service all``
baseline's model side."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from contracts.request import GenerationRequest
from contracts.stage_options import StageOptions

from .base import (
    Artifact,
    DecoderAdapter,
    EncoderAdapter,
    StepCallback,
    StopCheck,
    TransformerAdapter,
)
from .media import VideoSettings
from .prompt_cache import PromptCache


class LocalPipeline:
    """Encoder, transformer and decoder of one task in this process. Load once, then
    :meth:`run` any number of requests of its task."""

    def __init__(
        self,
        model_dir: str | Path,
        task: str,
        device: str = "cpu",
        dtype: str = "float32",
        attention: str = "sdpa",
        *,
        compile: bool = False,
        cfg_batch: bool = False,
        video: VideoSettings | None = None,
        prompt_cache_bytes: int = 0,
        stage_options: Mapping[str, StageOptions] | None = None,
        budget_shapes: Sequence[str] = (),
        attention_fallback: str | None = None,
        dit_file: str | None = None,
        vae_file: str | None = None,
    ) -> None:
        """``stage_options``: each stage's memory and precision options by role name
        ("encoder", "transformer", "decoder"; a missing one: all off). One process has one
        memory cap: each stage's ``max_vram_gb`` is checked against its own estimate, and
        the process is capped at the largest of them."""
        opts = stage_options or {}
        self.encoder = EncoderAdapter.for_task(
            model_dir, task, device, dtype, options=opts.get("encoder"))
        if prompt_cache_bytes:
            self.encoder.cache = PromptCache(prompt_cache_bytes)
        self.transformer = TransformerAdapter.for_task(
            model_dir, task, device, dtype, attention=attention, compile=compile,
            cfg_batch=cfg_batch, options=opts.get("transformer"), budget_shapes=budget_shapes,
            attention_fallback=attention_fallback, dit_file=dit_file,
        )
        self.decoder = DecoderAdapter.for_task(
            model_dir, task, device, dtype, video=video, options=opts.get("decoder"))
        for stage in (self.encoder, self.transformer, self.decoder):
            stage.vae_file = vae_file  # ``vae_path``: the same view of the folder for all
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
