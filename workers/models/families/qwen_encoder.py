"""Qwen-Image, Qwen-Image-Edit and Edit-2509 / 2511 (EditPlus), stage 1: the prompt (and,
for the edits, the condition images; for Qwen-Image's image-to-image, the start image)
encoded as :mod:`workers.models.families.qwen` lays out the tensors to the transformer."""

from __future__ import annotations

from typing import Any

import torch

from contracts.errors import InvalidRequestError, StageInputError
from contracts.input_images import unpack_images
from contracts.request import GenerationRequest

from ..base import EncoderAdapter
from ..diffusers_glue import (
    cpu_generator,
    latent_stats,
    load_diffusers_model,
    load_transformers_model,
)
from ..media import decode_image
from .qwen_text import QwenEditProcessor, image_latents_name, picture_prompt, prompt_template

# Qwen-Image-Edit sizes its condition image to this many pixels (diffusers: 1024 * 1024).
_EDIT_CONDITION_AREA = 1024 * 1024


class QwenEncoder(EncoderAdapter):
    """Qwen2.5-VL prompt encoding; for the edits also the vision-language prompt with the
    input images and the VAE latents of those images (EditPlus: each image sized twice, as
    QwenImageEditPlusPipeline does: ~384x384 for the vision-language encoder, ~1024x1024
    for the VAE). Qwen-Image (T2I) with an input image and ``i2i_denoise_strength``:
    image-to-image, the start image's VAE latents sampled as ``QwenImageImg2ImgPipeline``
    does (its VAE loaded by the first such request)."""

    vae: Any = None

    def _load(self) -> None:
        from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

        self.edit = self.spec.needs_image
        self.plus = self.spec.multi_image
        self.text_sees_image = self.edit  # the VL prompt embeds the input images
        assert self.spec.pipeline_class is not None
        self.template, self.drop, self.max_tokens = prompt_template(self.spec.pipeline_class)
        if self.edit:
            self.processor: Any = self._component(
                lambda p: QwenEditProcessor.from_pretrained(p, local_files_only=True),
                "processor",
            )
            self._set_vae(self._component(self._vae_loader, "vae"))
        else:
            self.tokenizer: Any = self._component(
                lambda p: Qwen2Tokenizer.from_pretrained(p, local_files_only=True), "tokenizer"
            )
        self.text_encoder: Any = self._component(
            lambda p: load_transformers_model(
                Qwen2_5_VLForConditionalGeneration, p, self.placement
            ),
            "text_encoder",
        )

    def _vae_loader(self, path: str) -> Any:
        from diffusers import AutoencoderKLQwenImage

        return load_diffusers_model(AutoencoderKLQwenImage, path, self.placement)

    def _set_vae(self, vae: Any) -> None:
        from diffusers.image_processor import VaeImageProcessor

        self.vae = vae
        self.vae_scale_factor = 2 ** len(vae.temperal_downsample)
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor * 2)

    def load_image(self, req: GenerationRequest, image_bytes: bytes | None) -> Any:
        """Edit: (the condition image resized to ~1 megapixel, its VAE input pixels).
        EditPlus: (the images for the vision-language prompt, their VAE input pixels), both
        lists in "Picture" order. T2I: None, or image-to-image's start image (VAE input
        pixels at the output size)."""
        if not self.edit:
            return self._start_image(req, image_bytes)
        if self.plus:
            return self._plus_images(image_bytes)
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

        image = decode_image(image_bytes, self.task)
        width, height = image.size
        cond_w, cond_h, _ = calculate_dimensions(_EDIT_CONDITION_AREA, width / height)
        image = self.image_processor.resize(image, cond_h, cond_w)
        pixels = self.image_processor.preprocess(image, cond_h, cond_w).unsqueeze(2)
        return image, pixels

    def _start_image(self, req: GenerationRequest, image_bytes: bytes | None) -> Any:
        """Image-to-image's start image as ``QwenImageImg2ImgPipeline`` preprocesses it:
        resized to the output size, in [-1, 1], float32, a frame axis added."""
        strength = req.i2i_denoise_strength
        if image_bytes is None:
            if strength is not None:
                raise StageInputError(f"{self.task}: i2i_denoise_strength needs an input "
                                      "image (image-to-image); none was given")
            return None
        if strength is None:
            raise StageInputError(f"{self.task} takes an input image only with "
                                  "i2i_denoise_strength (image-to-image)")
        image = decode_image(image_bytes, self.task)
        if self.vae is None:  # the first image-to-image request of this worker
            self._set_vae(self._on_demand(self._vae_loader, "vae"))
        assert req.height is not None and req.width is not None
        pixels = self.image_processor.preprocess(image, height=req.height, width=req.width)
        return pixels.to(dtype=torch.float32).unsqueeze(2)

    def _plus_images(self, image_bytes: bytes | None) -> tuple[list[Any], list[Any]]:
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (
            CONDITION_IMAGE_SIZE,
            VAE_IMAGE_SIZE,
            calculate_dimensions,
        )

        files = unpack_images(image_bytes, self.task) if image_bytes else [image_bytes]
        conditions, pixels = [], []
        for data in files:
            image = decode_image(data, self.task)
            ratio = image.size[0] / image.size[1]
            cond_w, cond_h = calculate_dimensions(CONDITION_IMAGE_SIZE, ratio)
            vae_w, vae_h = calculate_dimensions(VAE_IMAGE_SIZE, ratio)
            conditions.append(self.image_processor.resize(image, cond_h, cond_w))
            # From the decoded image, not the resized one: the pipeline sizes each twice.
            pixels.append(self.image_processor.preprocess(image, vae_h, vae_w).unsqueeze(2))
        return conditions, pixels

    def guidance_on(self, req: GenerationRequest) -> bool:
        assert req.true_cfg_scale is not None
        return req.true_cfg_scale > 1.0

    def encode_text(self, req: GenerationRequest, image: Any) -> dict[str, torch.Tensor]:
        assert req.negative_prompt is not None and req.max_sequence_length is not None
        cfg = self.guidance_on(req)
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            if self.edit:
                cond_image = image[0]
                out["prompt_embeds"], out["prompt_embeds_mask"] = self._embeds(
                    req.prompt, cond_image)
                if cfg:
                    neg, neg_mask = self._embeds(req.negative_prompt, cond_image)
                    out["negative_prompt_embeds"] = neg
                    out["negative_prompt_embeds_mask"] = neg_mask
            else:
                limit = req.max_sequence_length
                embeds, mask = self._embeds(req.prompt, None)
                out["prompt_embeds"], out["prompt_embeds_mask"] = embeds[:, :limit], mask[:, :limit]
                if cfg:
                    neg, neg_mask = self._embeds(req.negative_prompt, None)
                    out["negative_prompt_embeds"] = neg[:, :limit]
                    out["negative_prompt_embeds_mask"] = neg_mask[:, :limit]
        return out

    def encode_image(self, req: GenerationRequest, image: Any) -> dict[str, torch.Tensor]:
        if not self.edit:
            return {} if image is None else self._start_latents(req, image)
        pixels = image[1] if self.plus else [image[1]]
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for index, one in enumerate(pixels):  # each at its own size, one VAE pass each
                latents = self._image_latents(one.to(self.device, self.dtype))
                out[image_latents_name(index)] = latents
        return out

    def _embeds(self, prompt: str, image: Any) -> tuple[torch.Tensor, torch.Tensor]:
        # EditPlus names each image ("Picture 1: <image> Picture 2: <image> ...") before the
        # prompt; the first Edit's template holds its one image itself.
        prefix = picture_prompt(len(image)) if self.plus else ""
        text = [self.template.format(prefix + prompt)]
        if self.edit:
            inputs = self.processor(text=text, images=image, padding=True, return_tensors="pt")
            inputs = inputs.to(self.device)
            result = self.text_encoder(
                input_ids=inputs["input_ids"],
                attention_mask=inputs["attention_mask"],
                pixel_values=inputs.get("pixel_values"),
                image_grid_thw=inputs.get("image_grid_thw"),
                output_hidden_states=True,
            )
            attention = inputs["attention_mask"]
        else:
            inputs = self.tokenizer(
                text,
                max_length=self.max_tokens + self.drop,
                padding=True,
                truncation=True,
                return_tensors="pt",
            ).to(self.device)
            result = self.text_encoder(
                input_ids=inputs.input_ids,
                attention_mask=inputs.attention_mask,
                output_hidden_states=True,
            )
            attention = inputs.attention_mask
        hidden = result.hidden_states[-1]
        # Keep the valid positions of the one prompt, minus the system prompt the pipeline cuts.
        valid = hidden[attention.bool()]
        kept = valid[self.drop :]
        if kept.shape[0] == 0:
            raise InvalidRequestError(f"{self.task} prompt left no tokens after the template cut")
        embeds = kept.unsqueeze(0).to(dtype=self.dtype, device=self.device)
        mask = torch.ones(1, kept.shape[0], dtype=torch.long, device=kept.device)
        return embeds, mask

    def _start_latents(self, req: GenerationRequest, pixels: torch.Tensor
                       ) -> dict[str, torch.Tensor]:
        """Image-to-image's start latents, as ``QwenImageImg2ImgPipeline`` makes them: a
        sample of the VAE's latent distribution drawn from the request's seeded generator,
        normalised (``* (1 / std)``, its order of operations). The generator then draws the
        initial noise, in the DiT stage: its state travels as ``init_generator``."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_img2img import retrieve_latents

        generator = cpu_generator(req.seed)
        with torch.no_grad():
            latents = retrieve_latents(self.vae.encode(pixels.to(self.device, self.dtype)),
                                       generator=generator)
            mean, std = latent_stats(self.vae.config, latents)
            latents = (latents - mean) * (1.0 / std)
        return {"init_latents": latents,
                "init_generator": generator.get_state().to(self.device)}

    def _image_latents(self, pixels: torch.Tensor) -> torch.Tensor:
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import retrieve_latents

        latents = retrieve_latents(self.vae.encode(pixels), generator=None, sample_mode="argmax")
        mean, std = latent_stats(self.vae.config, latents)
        return (latents - mean) / std
