"""Qwen-Image text-to-image, Qwen-Image-Edit and Edit-2509 / 2511, split into three stages.

This follows diffusers' ``QwenImagePipeline``, ``QwenImageEditPipeline`` and
``QwenImageEditPlusPipeline`` (0.42.1) operation by operation, so that for a seed the three
stages give the same pixels as the one-process pipeline (given a CPU generator seeded with
the same seed).

Tensors between the stages (batch size 1):

encoder -> transformer
    ``prompt_embeds``                (1, L, D), text-encoder dtype: last hidden states of
                                     Qwen2.5-VL after the pipeline's system-prompt cut
    ``prompt_embeds_mask``           (1, L) int64; all ones for one prompt (the transformer
                                     stage then passes no mask, as the pipeline does)
    ``negative_prompt_embeds`` / ``negative_prompt_embeds_mask``
                                     same, present when ``true_cfg_scale > 1``
    ``image_latents``                (1, z, 1, h', w'), edits only: normalised VAE latents of
                                     the (first) input image resized to ~1 megapixel
    ``image_latents_2``, ``_3``, ... EditPlus only: the same for each further input image
                                     ("Picture 2", ...), each at its own ~1 megapixel size
    ``init_latents``                 (1, z, 1, h, w), T2I image-to-image only: normalised
                                     VAE latents of the start image at the output size,
                                     sampled from the latent distribution
    ``init_generator``               (5056,) uint8, with ``init_latents``: the state of the
                                     request's generator after that sample; it draws the
                                     initial noise (one generator, as in the pipeline)
transformer -> decoder
    ``latents``                      (1, z, 1, h, w) in the transformer's dtype: unpacked
                                     (VAE layout), normalised (VAE stats not applied)

with h, w = height / 8, width / 8 for the published VAE. Edit requests without a size get
the pipeline's default, the (last) condition image's ~1 megapixel size, which the
transformer stage reads from its latents. Edit-2511's ``zero_cond_t`` (the condition
images' tokens modulated at timestep 0) is the DiT's own: it follows from ``img_shapes``.

``i2i_denoise_strength`` (LightX2V's field): the loop runs the last steps of the schedule
(``QwenImageImg2ImgPipeline.get_timesteps``) from a start image's latents noised to the first
of them (the scheduler's ``scale_noise``). T2I: the start is ``init_latents``, and the
result that of ``QwenImageImg2ImgPipeline``. The edits (LightX2V's meaning of the field):
the start is the (one) condition image's latents, resized bilinearly where the output size
differs, as LightX2V does; no diffusers pipeline does this (its checks: the edit pipeline
given the same truncated schedule and start).

The encoder stage is :mod:`workers.models.families.qwen_encoder`; this module is the family's
(:func:`workers.models.get_family`): transformer and decoder here, all three exported.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any, NamedTuple

import numpy as np
import torch

from contracts.errors import (
    InvalidRequestError,
    StageInputError,
)
from contracts.request import GenerationRequest

from .. import loop_state
from ..base import (
    DecoderAdapter,
    StepCallback,
    StopCheck,
    TransformerAdapter,
)
from ..components import (
    check_request_task,
    require_tensor,
)
from ..diffusers_glue import (
    check_schedule,
    cpu_generator,
    decode_latents,
    fresh_scheduler,
    load_diffusers_model,
    load_scheduler,
)
from ..dit.attention import apply_attention_backend
from ..loop_state import LoopHooks
from .qwen_encoder import QwenEncoder
from .qwen_text import image_latents_name

logger = logging.getLogger(__name__)


def _vae_scale_factor(vae_config: Mapping[str, Any]) -> int:
    # As the pipelines compute it: one spatial halving per temporal-downsample entry.
    return int(2 ** len(vae_config.get("temperal_downsample", [False, True, True])))


class QwenTransformer(TransformerAdapter):
    """QwenImageTransformer2DModel + FlowMatchEuler scheduler with resolution-dependent shift."""

    def _load(self) -> None:
        from diffusers import QwenImageTransformer2DModel

        self.edit = self.spec.needs_image
        self.plus = self.spec.multi_image  # EditPlus: several condition images
        self.vae_scale_factor = _vae_scale_factor(self._config("vae"))  # config only
        self.transformer: Any = self._component(
            lambda p: load_diffusers_model(QwenImageTransformer2DModel, p, self.placement),
            "transformer",
        )
        overrides = self.scheduler_overrides()  # a recipe's (Qwen-Image-Lightning's)
        self.scheduler: Any = self._component(lambda p: load_scheduler(p, **overrides),
                                              "scheduler")
        config = self.transformer.config
        self.attention = apply_attention_backend(
            self.transformer, self.attention, self.device, self.dtype, config.attention_head_dim,
            fallback=self.attention_fallback)

    def _output_size(
        self, req: GenerationRequest, image_latents: torch.Tensor | None
    ) -> tuple[int, int]:
        if req.height is not None and req.width is not None:
            height, width = req.height, req.width
        else:
            # Edit without a size: the condition image's size, as the pipeline defaults to.
            assert image_latents is not None
            height = image_latents.shape[-2] * self.vae_scale_factor
            width = image_latents.shape[-1] * self.vae_scale_factor
        multiple = self.vae_scale_factor * 2
        if height % multiple or width % multiple:
            raise InvalidRequestError(
                f"{self.task} request does not fit the model: height/width must be multiples "
                f"of {multiple}, got {height}x{width}"
            )
        return height, width

    def _denoise(
        self,
        req: GenerationRequest,
        tensors: Mapping[str, torch.Tensor],
        on_step: StepCallback | None = None,
        should_stop: StopCheck | None = None,
        loop: LoopHooks | None = None,
    ) -> dict[str, torch.Tensor]:
        from diffusers import QwenImagePipeline

        self._require_loaded()
        check_request_task(req, self.task, self.role)
        assert req.true_cfg_scale is not None and req.infer_steps is not None
        true_cfg = req.true_cfg_scale
        cfg = true_cfg > 1.0
        inp = self._inputs(req, tensors, cfg)
        self._check_fp8_rows((inp.lat_h // 2) * (inp.lat_w // 2))  # the packed 2x2 patches
        guidance = self._guidance(req)
        scheduler = fresh_scheduler(self.scheduler)
        with torch.no_grad():
            # The schedule depends only on the packed sequence length: (lat_h/2) x (lat_w/2).
            self._schedule(scheduler, (inp.lat_h // 2) * (inp.lat_w // 2), req.infer_steps)
            timesteps = scheduler.timesteps
            if req.i2i_denoise_strength is not None:
                timesteps = self._strength_steps(scheduler, req)
            # The packed initial latents, or the latents and scheduler state of a checkpoint.
            latents, first = loop_state.start(
                loop, scheduler, lambda: self._initial(req, tensors, inp, scheduler, timesteps),
                self.device)
            total = len(timesteps)
            for i in range(first, total):
                t = timesteps[i]
                self._check_stop(should_stop, i, total)
                model_input = latents
                if inp.image_latents is not None:
                    model_input = torch.cat([latents, inp.image_latents], dim=1)
                timestep = t.expand(latents.shape[0]).to(latents.dtype)
                n_tokens = latents.size(1)

                noise_pred, neg_pred = self._branches(
                    cfg, self._predict,
                    (model_input, timestep, inp.prompt, inp.prompt_mask, "cond", guidance,
                     inp.img_shapes, n_tokens),
                    (model_input, timestep, inp.negative, inp.negative_mask, "uncond", guidance,
                     inp.img_shapes, n_tokens),
                    self._predict_both, (model_input, timestep, inp, guidance, n_tokens))
                if neg_pred is not None:
                    combined = neg_pred + true_cfg * (noise_pred - neg_pred)
                    # Rescale the guided prediction back to the conditional one's norm.
                    cond_norm = torch.norm(noise_pred, dim=-1, keepdim=True)
                    combined_norm = torch.norm(combined, dim=-1, keepdim=True)
                    noise_pred = combined * (cond_norm / combined_norm)
                latents = scheduler.step(noise_pred, t, latents, return_dict=False)[0]
                if on_step is not None:
                    on_step(i + 1, total)
                loop_state.boundary(loop, i + 1, total, scheduler,
                                    functools.partial(dict, latents=latents))
            latents = QwenImagePipeline._unpack_latents(
                latents, inp.height, inp.width, self.vae_scale_factor
            ).contiguous()
        self._synchronize()
        return {"latents": latents}

    def _strength_steps(self, scheduler: Any, req: GenerationRequest) -> Any:
        """The last timesteps of the schedule, as many as ``i2i_denoise_strength`` asks;
        the scheduler begins at the first of them."""
        from diffusers import QwenImageImg2ImgPipeline

        assert req.infer_steps is not None
        # diffusers' own arithmetic (a pipeline method that reads only the scheduler):
        # infer_steps - int(infer_steps * (1 - strength)) steps, never fewer than one.
        timesteps, _ = QwenImageImg2ImgPipeline.get_timesteps(
            SimpleNamespace(scheduler=scheduler), req.infer_steps, req.i2i_denoise_strength,
            self.device)
        return timesteps

    def _initial(self, req: GenerationRequest, tensors: Mapping[str, torch.Tensor],
                 inp: _DitInputs, scheduler: Any, timesteps: Any) -> torch.Tensor:
        """The packed latents the loop starts from: the initial noise (from the request's
        seed), or with ``i2i_denoise_strength`` the start image's latents noised to the
        first timestep left (the pipelines' ``scale_noise``)."""
        from diffusers import QwenImagePipeline
        from diffusers.utils.torch_utils import randn_tensor

        generator = cpu_generator(req.seed)
        start = None
        if req.i2i_denoise_strength is not None:
            start = self._start(tensors, inp, generator)
        latents = randn_tensor((1, 1, inp.channels, inp.lat_h, inp.lat_w), generator=generator,
                               device=self.device, dtype=inp.prompt.dtype)
        if start is not None:
            latents = scheduler.scale_noise(start, timesteps[:1], latents)
        return QwenImagePipeline._pack_latents(latents, 1, inp.channels, inp.lat_h, inp.lat_w)

    def _start(self, tensors: Mapping[str, torch.Tensor], inp: _DitInputs,
               generator: torch.Generator) -> torch.Tensor:
        """The start image's latents (1, 1, z, h, w) of a strength request. T2I: the
        encoder's ``init_latents``, and ``generator`` set to the state the encoder's sample
        left (the pipeline draws both from one generator). Edits: the condition image's."""
        if self.edit:
            if inp.conditions != 1:
                raise InvalidRequestError(
                    f"{self.task}: i2i_denoise_strength redraws one input image, got "
                    f"{inp.conditions}")
            start = inp.first_condition
            assert start is not None
            if start.shape[-2:] != (inp.lat_h, inp.lat_w):
                # Another output size than the image's: LightX2V resizes the latents so.
                start = torch.nn.functional.interpolate(
                    start[:, :, 0], size=(inp.lat_h, inp.lat_w), mode="bilinear",
                    align_corners=False).unsqueeze(2)
        else:
            start = require_tensor(tensors, "init_latents", self.role, ndim=5)
            state = require_tensor(tensors, "init_generator", self.role, ndim=1)
            want = (1, inp.channels, 1, inp.lat_h, inp.lat_w)
            if tuple(start.shape) != want:
                raise StageInputError(f"transformer stage input 'init_latents' has shape "
                                      f"{tuple(start.shape)}, expected {want}")
            generator.set_state(state.cpu())
            start = start.to(self.device, dtype=inp.prompt.dtype)
        return start.transpose(1, 2)

    def _predict_both(
        self,
        model_input: torch.Tensor,
        timestep: torch.Tensor,
        inp: _DitInputs,
        guidance: torch.Tensor | None,
        n_tokens: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Both CFG branches as one batch-2 forward. Prompts of different lengths are padded
        to the longer one and masked (Qwen's text RoPE and attention honour the mask), which
        is what diffusers does for a batch of prompts."""
        assert inp.negative is not None
        texts = [inp.prompt, inp.negative]
        masks = [inp.prompt_mask, inp.negative_mask]
        length = max(t.shape[1] for t in texts)
        if all(m is None for m in masks) and all(t.shape[1] == length for t in texts):
            embeds, mask = torch.cat(texts), None
        else:
            padded, valid = [], []
            for text, m in zip(texts, masks, strict=True):
                pad = length - text.shape[1]
                padded.append(torch.nn.functional.pad(text, (0, 0, 0, pad)))
                m = m if m is not None else torch.ones(text.shape[:2], device=text.device,
                                                       dtype=torch.long)
                valid.append(torch.nn.functional.pad(m, (0, pad)))
            embeds, mask = torch.cat(padded), torch.cat(valid)
        pred = self._predict(
            torch.cat([model_input, model_input]), timestep.expand(2), embeds, mask, "cond",
            None if guidance is None else guidance.expand(2), inp.img_shapes * 2, n_tokens,
        )
        cond, uncond = pred.chunk(2)
        return cond, uncond

    def warmup_inputs(self, req: GenerationRequest, variant: int) -> dict[str, torch.Tensor]:
        """Random encoder outputs for ``req``; variant 1 has a longer text than variant 0, so
        that a compiled DiT also gets the text length as a dynamic dimension."""
        dim = self.transformer.config.joint_attention_dim
        dtype = self.transformer.dtype
        gen = torch.Generator("cpu").manual_seed(variant)
        out: dict[str, torch.Tensor] = {}
        for name, length in (("prompt_embeds", 12 + 7 * variant),
                             ("negative_prompt_embeds", 5 + 3 * variant)):
            out[name] = torch.randn((1, length, dim), generator=gen).to(self.device, dtype)
            out[f"{name}_mask"] = torch.ones((1, length), dtype=torch.long, device=self.device)
        if self.edit:
            assert req.height is not None and req.width is not None
            channels = self.transformer.config.in_channels // 4
            lat = (1, channels, 1, req.height // self.vae_scale_factor,
                   req.width // self.vae_scale_factor)
            out["image_latents"] = torch.randn(lat, generator=gen).to(self.device, dtype)
        return out

    warmup_variants = 2

    def _inputs(
        self, req: GenerationRequest, tensors: Mapping[str, torch.Tensor], cfg: bool
    ) -> _DitInputs:
        """The stage's inputs on this device, checked, with the output geometry."""
        from diffusers import QwenImagePipeline

        dtype = self.transformer.dtype

        def text(name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
            embeds = require_tensor(tensors, name, self.role, ndim=3).to(self.device).to(dtype)
            mask = require_tensor(tensors, f"{name}_mask", self.role, ndim=2).to(self.device)
            # The pipeline passes no mask when every position is valid; a mask of ones would
            # take a different (masked) attention path and change the numbers.
            return embeds, (None if bool(mask.all()) else mask)

        prompt_embeds, prompt_mask = text("prompt_embeds")
        negative_embeds, negative_mask = text("negative_prompt_embeds") if cfg else (None, None)
        conditions = [
            c.to(self.device, dtype=prompt_embeds.dtype) for c in self._condition_latents(tensors)
        ]
        # The output size defaults to the last condition image's (EditPlus: image[-1]).
        height, width = self._output_size(req, conditions[-1] if conditions else None)

        vsf = self.vae_scale_factor
        channels = self.transformer.config.in_channels // 4
        shapes: list[tuple[int, int, int]] = [(1, height // vsf // 2, width // vsf // 2)]
        packed = []
        for index, latents in enumerate(conditions):
            if latents.shape[1] != channels:
                raise StageInputError(
                    f"transformer stage input {image_latents_name(index)!r} has "
                    f"{latents.shape[1]} channels, the DiT expects {channels}"
                )
            cond_h, cond_w = latents.shape[-2:]
            packed.append(QwenImagePipeline._pack_latents(latents, 1, channels, cond_h, cond_w))
            shapes.append((1, cond_h // 2, cond_w // 2))
        return _DitInputs(
            conditions=len(conditions),
            first_condition=conditions[0] if conditions else None,
            prompt=prompt_embeds,
            prompt_mask=prompt_mask,
            negative=negative_embeds,
            negative_mask=negative_mask,
            # One sequence of every condition image's tokens, in "Picture" order.
            image_latents=torch.cat(packed, dim=1) if packed else None,
            img_shapes=[shapes],  # one list of (frames, rows, cols) token grids per item
            height=height,
            width=width,
            lat_h=2 * (height // (vsf * 2)),
            lat_w=2 * (width // (vsf * 2)),
            channels=channels,
        )

    def _condition_latents(self, tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """The condition images' latents, in order: none (T2I), one (Edit), one or more
        (EditPlus: ``image_latents``, ``image_latents_2``, ...)."""
        if not self.edit:
            return []
        found = [require_tensor(tensors, image_latents_name(0), self.role, ndim=5)]
        while self.plus and image_latents_name(len(found)) in tensors:
            found.append(require_tensor(tensors, image_latents_name(len(found)), self.role,
                                        ndim=5))
        return found

    def _guidance(self, req: GenerationRequest) -> torch.Tensor | None:
        """The embedded guidance of guidance-distilled checkpoints (None for the others)."""
        if self.transformer.config.guidance_embeds:
            if req.guidance_scale is None:
                raise InvalidRequestError(
                    f"{self.task}: this checkpoint is guidance-distilled; set guidance_scale"
                )
            guidance = torch.full([1], req.guidance_scale, device=self.device, dtype=torch.float32)
            return guidance.expand(1)
        if req.guidance_scale is not None:
            logger.warning("guidance_scale ignored: this checkpoint is not guidance-distilled")
        return None

    def _schedule(self, scheduler: Any, seq_len: int, steps: int) -> Any:
        """The timesteps of a request, with the resolution-dependent shift of the pipeline."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import (
            calculate_shift,
            retrieve_timesteps,
        )

        sigmas = np.linspace(1.0, 1 / steps, steps)
        mu = calculate_shift(
            seq_len,
            scheduler.config.get("base_image_seq_len", 256),
            scheduler.config.get("max_image_seq_len", 4096),
            scheduler.config.get("base_shift", 0.5),
            scheduler.config.get("max_shift", 1.15),
        )
        with np.errstate(divide="ignore", invalid="ignore"):  # checked just below
            timesteps, _ = retrieve_timesteps(
                scheduler,
                steps,
                self.device,
                sigmas=sigmas,  # type: ignore[arg-type]  # an ndarray, as the pipeline's
                mu=mu,
            )
        check_schedule(scheduler, steps, self.task)
        scheduler.set_begin_index(0)
        return timesteps

    def _predict(
        self,
        model_input: torch.Tensor,
        timestep: torch.Tensor,
        embeds: torch.Tensor,
        mask: torch.Tensor | None,
        branch: str,
        guidance: torch.Tensor | None,
        img_shapes: list[list[tuple[int, int, int]]],
        n_tokens: int,
    ) -> torch.Tensor:
        """One DiT forward of one CFG branch."""
        with self.transformer.cache_context(branch):
            pred = self.transformer(
                hidden_states=model_input,
                timestep=timestep / 1000,
                guidance=guidance,
                encoder_hidden_states_mask=mask,
                encoder_hidden_states=embeds,
                img_shapes=img_shapes,
                attention_kwargs={},
                return_dict=False,
            )[0]
        # Edit: the DiT also returns the condition image's tokens; keep the target's.
        out: torch.Tensor = pred[:, :n_tokens] if self.edit else pred
        return out


class _DitInputs(NamedTuple):
    conditions: int
    """How many condition images (edits)."""
    first_condition: torch.Tensor | None
    """The first condition image's latents (1, z, 1, h', w'), unpacked (edits)."""
    prompt: torch.Tensor
    prompt_mask: torch.Tensor | None
    negative: torch.Tensor | None
    negative_mask: torch.Tensor | None
    image_latents: torch.Tensor | None
    """Packed condition-image latents (edit), else None."""
    img_shapes: list[list[tuple[int, int, int]]]
    height: int
    width: int
    lat_h: int
    lat_w: int
    channels: int


class QwenDecoder(DecoderAdapter):
    """AutoencoderKLQwenImage decode to an RGB image."""

    def _load(self) -> None:
        from diffusers import AutoencoderKLQwenImage
        from diffusers.image_processor import VaeImageProcessor

        self.vae: Any = self._component(
            lambda p: load_diffusers_model(AutoencoderKLQwenImage, p, self.placement),
            "vae",
        )
        self.image_processor = VaeImageProcessor(
            vae_scale_factor=2 ** len(self.vae.temperal_downsample) * 2
        )

    def decode_tensor(
        self, req: GenerationRequest, tensors: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        self._require_loaded()
        check_request_task(req, self.task, self.role)
        latents = require_tensor(tensors, "latents", self.role, ndim=5)
        if latents.shape[1] != self.vae.config.z_dim or latents.shape[2] != 1:
            raise StageInputError(
                f"decoder stage input 'latents' has shape {tuple(latents.shape)}, expected "
                f"(1, {self.vae.config.z_dim}, 1, h, w)"
            )
        with torch.no_grad():
            image = decode_latents(self.vae, latents, self.device)[:, :, 0]
            pixels = self.image_processor.postprocess(image, output_type="pt")
        # (1, C, H, W) -> (H, W, C), what the "np" output type's conversion does.
        out: torch.Tensor = pixels[0].permute(1, 2, 0)
        return out


__all__ = ["QwenDecoder", "QwenEncoder", "QwenTransformer"]
