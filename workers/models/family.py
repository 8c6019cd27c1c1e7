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


# task -> (module, encoder, transformer, decoder). Families are imported on first use, so that
# importing this package does not import torch or diffusers. The diffusers pipeline each row
# follows is the pipeline table's (contracts.pipelines.TaskSpec.pipeline_class).
_QWEN = ("qwen", "QwenEncoder", "QwenTransformer", "QwenDecoder")
_FAMILIES: dict[str, tuple[str, str, str, str]] = {
    "wan_t2v": ("wan", "WanEncoder", "WanTransformer", "WanDecoder"),
    "wan_i2v": ("wan", "WanEncoder", "WanTransformer", "WanDecoder"),
    "qwen_t2i": _QWEN,
    "qwen_i2i": _QWEN,
    "qwen_i2i_plus": _QWEN,
    "synthetic": ("synthetic", "SyntheticEncoder", "SyntheticTransformer", "SyntheticDecoder"),
}
assert set(_FAMILIES) == set(TASKS)


def get_family(task: str) -> ModelFamily:
    """The adapters serving ``task``. Imports the family module, and with it torch."""
    spec = task_spec(task)
    module_name, enc, dit, dec = _FAMILIES[spec.name]
    module = importlib.import_module(f"{__package__}.{module_name}")
    return ModelFamily(
        task=task,
        encoder=getattr(module, enc),
        transformer=getattr(module, dit),
        decoder=getattr(module, dec),
        pipeline_class=spec.pipeline_class,
    )
