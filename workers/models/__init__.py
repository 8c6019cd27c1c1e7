"""Stage adapters for the diffusion models diffring serves.

Tasks: ``wan_t2v`` and ``wan_i2v`` (Wan2.1), ``wan22_a14b_t2v`` / ``_i2v`` and
``wan22_5b_t2v`` / ``_i2v`` (Wan2.2), ``qwen_t2i`` (Qwen-Image), ``qwen_i2i`` and
``qwen_i2i_plus`` (Qwen-Image-Edit). Each request is split into three stages that can run in
three processes:

    EncoderAdapter.for_task(folder, task).encode(req, image_bytes)   -> tensors
    TransformerAdapter.for_task(folder, task).denoise(req, tensors)  -> tensors
    DecoderAdapter.for_task(folder, task).decode(req, tensors)       -> Artifact

Only the :class:`~contracts.request.GenerationRequest` and the tensor dictionaries travel
between stages. Importing this package is cheap; torch, diffusers and transformers are
imported when a family's adapter is first asked for.
"""

from .base import (
    Artifact,
    DecoderAdapter,
    EncoderAdapter,
    ModelFamily,
    PendingMedia,
    StageAdapter,
    TransformerAdapter,
    get_family,
)
from .pipeline import LocalPipeline, run_pipeline

__all__ = [
    "Artifact",
    "DecoderAdapter",
    "EncoderAdapter",
    "LocalPipeline",
    "ModelFamily",
    "PendingMedia",
    "StageAdapter",
    "TransformerAdapter",
    "get_family",
    "run_pipeline",
]
