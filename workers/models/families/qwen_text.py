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
def prompt_template(pipeline_class: str) -> PromptTemplate:
    """The prompt template of diffusers' pipeline ``pipeline_class`` (``QwenImagePipeline``,
    ``QwenImageEditPipeline``, ``QwenImageEditPlusPipeline``), read from a bare instance of
    the class itself so that it cannot drift from the installed diffusers."""
    import inspect

    import diffusers

    cls: Any = getattr(diffusers, pipeline_class)
    components = [n for n in inspect.signature(cls.__init__).parameters if n != "self"]
    bare = cls(**dict.fromkeys(components))
    return PromptTemplate(
        bare.prompt_template_encode,
        bare.prompt_template_encode_start_idx,
        bare.tokenizer_max_length,
    )


PICTURE_PROMPT = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
"""What QwenImageEditPlusPipeline puts before the prompt for each input image, numbered from
1 (a local of its prompt encoder in diffusers 0.42.1, so not readable like the templates; the
exact comparison with the pipeline in tests/integration/test_models.py would show a change)."""


def picture_prompt(count: int) -> str:
    """The image part of an EditPlus prompt for ``count`` input images."""
    return "".join(PICTURE_PROMPT.format(i + 1) for i in range(count))


def image_latents_name(index: int) -> str:
    """The tensor of the ``index``-th (from 0) condition image's VAE latents between the
    encoder and the DiT: ``image_latents`` for the first (the only one of the first Edit),
    ``image_latents_2``, ``image_latents_3``, ... after it ("Picture N")."""
    return "image_latents" if index == 0 else f"image_latents_{index + 1}"
