"""The family registry: which adapters serve a task (imported on first use, so that importing
this package imports neither torch nor diffusers)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from contracts.pipelines import TASKS, task_spec

if TYPE_CHECKING:
    from .base import DecoderAdapter, EncoderAdapter, TransformerAdapter


@dataclass(frozen=True)
class ModelFamily:
    """The adapters that serve one task."""

    task: str
    encoder: type[EncoderAdapter]
    transformer: type[TransformerAdapter]
    decoder: type[DecoderAdapter]
    pipeline_class: str | None
    """Name of diffusers' one-process pipeline for this task (the reference in tests); None
    for the synthetic family, which has no model."""


# task -> (module, encoder, transformer, decoder, diffusers pipeline class). Families are
# imported on first use, so that importing this package does not import torch or diffusers.
_FAMILIES: dict[str, tuple[str, str, str, str, str | None]] = {
    "wan_t2v": ("wan", "WanEncoder", "WanTransformer", "WanDecoder", "WanPipeline"),
    "wan_i2v": ("wan", "WanEncoder", "WanTransformer", "WanDecoder", "WanImageToVideoPipeline"),
    "qwen_t2i": ("qwen", "QwenEncoder", "QwenTransformer", "QwenDecoder", "QwenImagePipeline"),
    "qwen_i2i": ("qwen", "QwenEncoder", "QwenTransformer", "QwenDecoder", "QwenImageEditPipeline"),
    "synthetic": (
        "synthetic", "SyntheticEncoder", "SyntheticTransformer", "SyntheticDecoder", None
    ),
}
assert set(_FAMILIES) == set(TASKS)


def get_family(task: str) -> ModelFamily:
    """The adapters serving ``task``. Imports the family module, and with it torch."""
    module_name, enc, dit, dec, pipeline = _FAMILIES[task_spec(task).name]
    module = importlib.import_module(f"{__package__}.{module_name}")
    return ModelFamily(
        task=task,
        encoder=getattr(module, enc),
        transformer=getattr(module, dit),
        decoder=getattr(module, dec),
        pipeline_class=pipeline,
    )
