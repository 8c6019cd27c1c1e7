"""Stage adapters for the diffusion models diffring serves.

Tasks: ``wan_t2v`` and ``wan_i2v`` (Wan2.1), ``qwen_t2i`` (Qwen-Image) and ``qwen_i2i``
(Qwen-Image-Edit). Each request is split into three stages that can run in three processes:

    EncoderStage.encode(req, image_bytes)  -> tensors   # text / image conditioning
    TransformerStage.denoise(req, tensors)  -> tensors  # DiT loop, scheduler, noise
    DecoderStage.decode(req, tensors)       -> Artifact # VAE decode, PNG / MP4

Only the :class:`GenerationRequest` and the tensor dictionaries travel between stages.
Importing this package is cheap; torch, diffusers and transformers are imported by ``load()``.
"""

from .base import (
    ATTENTION_BACKENDS,
    DTYPES,
    TASK_SPECS,
    TASKS,
    Artifact,
    DecoderAdapter,
    EncoderAdapter,
    GenerationRequest,
    InvalidRequestError,
    ModelError,
    ModelFamily,
    ModelLoadError,
    StageCancelled,
    StageInputError,
    TaskSpec,
    TransformerAdapter,
    task_spec,
)
from .registry import get_family
from .stages import DecoderStage, EncoderStage, LocalPipeline, TransformerStage, run_pipeline

__all__ = [
    "ATTENTION_BACKENDS",
    "DTYPES",
    "TASKS",
    "TASK_SPECS",
    "Artifact",
    "DecoderAdapter",
    "DecoderStage",
    "EncoderAdapter",
    "EncoderStage",
    "GenerationRequest",
    "InvalidRequestError",
    "LocalPipeline",
    "ModelError",
    "ModelFamily",
    "ModelLoadError",
    "StageCancelled",
    "StageInputError",
    "TaskSpec",
    "TransformerAdapter",
    "TransformerStage",
    "get_family",
    "run_pipeline",
    "task_spec",
]
