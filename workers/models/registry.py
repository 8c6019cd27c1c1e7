"""Task name -> stage adapters. Families are imported on first use, so that importing
``workers.models`` does not import torch, diffusers or transformers."""

from __future__ import annotations

import importlib

from .base import TASKS, InvalidRequestError, ModelFamily

# task -> (module, encoder, transformer, decoder, diffusers pipeline class)
_FAMILIES: dict[str, tuple[str, str, str, str, str]] = {
    "wan_t2v": ("wan", "WanEncoder", "WanTransformer", "WanDecoder", "WanPipeline"),
    "wan_i2v": ("wan", "WanEncoder", "WanTransformer", "WanDecoder", "WanImageToVideoPipeline"),
    "qwen_t2i": ("qwen", "QwenEncoder", "QwenTransformer", "QwenDecoder", "QwenImagePipeline"),
    "qwen_i2i": ("qwen", "QwenEncoder", "QwenTransformer", "QwenDecoder", "QwenImageEditPipeline"),
}
assert set(_FAMILIES) == set(TASKS)


def get_family(task: str) -> ModelFamily:
    """The adapters serving ``task`` (one of ``wan_t2v``, ``wan_i2v``, ``qwen_t2i``,
    ``qwen_i2i``). Imports the family module, and with it torch and diffusers."""
    try:
        module_name, enc, dit, dec, pipeline = _FAMILIES[task]
    except (KeyError, TypeError):
        raise InvalidRequestError(
            f"unknown task {task!r}; expected one of {', '.join(TASKS)}"
        ) from None
    module = importlib.import_module(f"{__package__}.{module_name}")
    return ModelFamily(
        task=task,
        encoder=getattr(module, enc),
        transformer=getattr(module, dit),
        decoder=getattr(module, dec),
        pipeline_class=pipeline,
    )
