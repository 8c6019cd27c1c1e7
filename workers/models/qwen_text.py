"""How Qwen-Image's text encoder is fed: the Edit processor and the pipelines' prompt
templates (read from the installed diffusers, so they cannot drift)."""

from __future__ import annotations

from functools import cache
from typing import Any, NamedTuple

from transformers import Qwen2VLProcessor


class QwenEditProcessor(Qwen2VLProcessor):
    """Qwen2-VL processor made of an image processor and a tokenizer only.

    transformers 5's ``Qwen2VLProcessor`` also insists on a video processor, which needs
    torchvision; Qwen-Image-Edit never feeds video, so this subclass drops that part. It loads
    from the ``processor`` folder of a Qwen-Image-Edit checkpoint.
    """

    def __init__(
        self,
        image_processor: Any = None,
        tokenizer: Any = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            image_processor=image_processor,
            tokenizer=tokenizer,
            video_processor=None,
            chat_template=chat_template,
            **kwargs,
        )


class PromptTemplate(NamedTuple):
    """How diffusers' Qwen pipelines wrap a prompt for the text encoder."""

    template: str
    """Chat template with ``{}`` for the prompt."""
    drop: int
    """Leading hidden states (the system prompt) the pipeline drops."""
    max_length: int
    """Token limit after the drop (the tokenizer gets ``max_length + drop``)."""


@cache
def prompt_template(edit: bool) -> PromptTemplate:
    """The prompt template of diffusers' pipeline, read from the pipeline class itself so that
    it cannot drift from the installed diffusers."""
    from diffusers import QwenImageEditPipeline, QwenImagePipeline

    bare: Any
    if edit:
        bare = QwenImageEditPipeline(
            scheduler=None,
            vae=None,
            text_encoder=None,
            tokenizer=None,
            processor=None,
            transformer=None,
        )
    else:
        bare = QwenImagePipeline(
            scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=None
        )
    return PromptTemplate(
        bare.prompt_template_encode,
        bare.prompt_template_encode_start_idx,
        bare.tokenizer_max_length,
    )
