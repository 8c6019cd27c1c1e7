"""Wan2.1 and Wan2.2 text-to-video and image-to-video, split into three stages.

This follows diffusers' ``WanPipeline`` and ``WanImageToVideoPipeline`` (0.42.1) operation by
operation, so that for a seed the three stages give the same pixels as the one-process
pipeline (given a CPU generator seeded with the same seed). The checkpoints differ in:

* Wan2.1: one DiT; I2V adds CLIP image embeddings to the DiT's context.
* Wan2.2-A14B (T2V, I2V): two DiTs, the high-noise expert for the steps at or above the
  boundary timestep and the low-noise expert for the rest, each with its own guidance scale
  (``guidance_scale``, ``guidance_scale_2``); where they live is the ``transformer.experts``
  option (:mod:`workers.models.dit.experts`). I2V has no CLIP: the first frame reaches the
  DiT through the VAE condition alone.
* Wan2.2-TI2V-5B: one DiT over the Wan2.2 VAE (48 channels, 16x spatial compression) with a
  timestep per latent token (``expand_timesteps``). Its I2V condition is the first frame's
  latents alone; the first latent frame is held at them (timestep 0) through the loop.

Tensors between the stages (batch size 1):

encoder -> transformer
    ``prompt_embeds``           (1, L, text_dim), text-encoder dtype; zero past the prompt
    ``negative_prompt_embeds``  same, present when ``guidance_scale > 1``
    ``image_embeds``            (1, N, image_dim), Wan2.1 I2V only: CLIP penultimate states
    ``condition``               I2V only, float32: (1, 4 + z, T, h, w) first-frame mask +
                                normalised VAE latents of the input image followed by zeros;
                                TI2V-5B: (1, z, 1, h, w) the input image's latents
transformer -> decoder
    ``latents``                 (1, z, T, h, w) float32, normalised (VAE stats not applied)

with L = ``max_sequence_length`` (512), T = (num_frames - 1) / 4 + 1, h, w = height / s,
width / s for the VAE's spatial factor s (8; 16 for the Wan2.2 VAE).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from contracts.errors import (
    CheckpointError,
    InvalidRequestError,
    ModelLoadError,
    StageInputError,
    StageYielded,
)
from contracts.request import GenerationRequest
from contracts.stage_options import SPLIT_EXPERTS

from .. import loop_state
from ..base import (
    DecoderAdapter,
    EncoderAdapter,
    FrameChunks,
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
    latent_stats,
    load_diffusers_model,
    load_scheduler,
    load_transformers_model,
)
from ..dit.attention import apply_attention_backend
from ..dit.experts import Experts, check_placement
from ..loop_state import LoopHooks
from ..media import decode_image
from ..model_folder import read_json


def _geometry_error(task: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"{task} request does not fit the model: {message}")


def _clip(spec: Any) -> bool:
    """Whether the DiT takes CLIP image embeddings: Wan2.1's I2V only."""
    return bool(spec.needs_image and spec.model_cls == "wan2.1")


class WanEncoder(EncoderAdapter):
    """UMT5 prompt encoding; for I2V also the VAE-encoded first frame condition, and for
    Wan2.1 I2V CLIP image embeddings."""

    def _load(self) -> None:
        from transformers import AutoTokenizer, UMT5EncoderModel

        self.tokenizer: Any = self._component(
            lambda p: AutoTokenizer.from_pretrained(p, local_files_only=True), "tokenizer"
        )
        self.text_encoder: Any = self._component(
            lambda p: load_transformers_model(UMT5EncoderModel, p, self.placement),
            "text_encoder",
        )
        if _clip(self.spec):
            from transformers import CLIPImageProcessor, CLIPVisionModel

            self.image_processor: Any = self._component(
                lambda p: CLIPImageProcessor.from_pretrained(p, local_files_only=True),
                "image_processor",
            )
            self.image_encoder: Any = self._component(
                lambda p: load_transformers_model(CLIPVisionModel, p, self.placement),
                "image_encoder",
            )
        if self.spec.needs_image:
            from diffusers import AutoencoderKLWan
            from diffusers.video_processor import VideoProcessor

            self.vae: Any = self._component(
                lambda p: load_diffusers_model(AutoencoderKLWan, p, self.placement),
                "vae",
            )
            self.video_processor = VideoProcessor(
                vae_scale_factor=self.vae.config.scale_factor_spatial
            )

    def load_image(self, req: GenerationRequest, image_bytes: bytes | None) -> Any:
        if self.spec.needs_image:
            return decode_image(image_bytes, self.task)
        return super().load_image(req, image_bytes)

    def guidance_on(self, req: GenerationRequest) -> bool:
        assert req.guidance_scale is not None
        return req.guidance_scale > 1.0

    def encode_text(self, req: GenerationRequest, image: Any) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        assert req.max_sequence_length is not None
        with torch.no_grad():
            out["prompt_embeds"] = self._text_embeds(req.prompt, req.max_sequence_length)
            if self.guidance_on(req):
                out["negative_prompt_embeds"] = self._text_embeds(
                    req.negative_prompt or "", req.max_sequence_length
                )
        return out

    def encode_image(self, req: GenerationRequest, image: Any) -> dict[str, torch.Tensor]:
        if not self.spec.needs_image:
            return {}
        with torch.no_grad():
            out = {"condition": self._condition(image, req)}
            if _clip(self.spec):
                out["image_embeds"] = self._image_embeds(image)
            return out

    def _text_embeds(self, text: str, max_len: int) -> torch.Tensor:
        if self.spec.needs_image:
            from diffusers.pipelines.wan.pipeline_wan_i2v import prompt_clean
        else:
            from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        tokens = self.tokenizer(
            [prompt_clean(text)],
            padding="max_length",
            max_length=max_len,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        ids, mask = tokens.input_ids, tokens.attention_mask
        length = int(mask.gt(0).sum())
        hidden = self.text_encoder(ids.to(self.device), mask.to(self.device)).last_hidden_state
        hidden = hidden.to(dtype=self.dtype, device=self.device)
        # Wan's DiT sees padding positions as exact zeros, not as the encoder's pad outputs.
        embeds = torch.zeros_like(hidden)
        embeds[:, :length] = hidden[:, :length]
        return embeds

    def _image_embeds(self, image: Any) -> torch.Tensor:
        pixels = self.image_processor(images=image, return_tensors="pt").to(self.device)
        hidden = self.image_encoder(**pixels, output_hidden_states=True).hidden_states
        return hidden[-2].to(self.device)

    def _condition(self, image: Any, req: GenerationRequest) -> torch.Tensor:
        from diffusers.pipelines.wan.pipeline_wan_i2v import retrieve_latents

        assert req.height is not None and req.width is not None and req.num_frames is not None
        height, width, frames = req.height, req.width, req.num_frames
        temporal = self.vae.config.scale_factor_temporal
        spatial = self.vae.config.scale_factor_spatial
        if (frames - 1) % temporal or height % spatial or width % spatial:
            raise _geometry_error(
                self.task,
                f"{frames} frames of {height}x{width} do not divide by the VAE's factors "
                f"({temporal} in time, {spatial} in space)",
            )
        lat_h, lat_w = height // spatial, width // spatial

        first = self.video_processor.preprocess(image, height=height, width=width)
        first = first.to(self.device, dtype=torch.float32).unsqueeze(2)  # (1, 3, 1, H, W)
        if self.spec.expand_timesteps:  # TI2V-5B: the first frame alone
            video = first.to(device=self.device, dtype=self.vae.dtype)
        else:
            video = torch.cat(
                [first, first.new_zeros(first.shape[0], first.shape[1], frames - 1, height,
                                        width)],
                dim=2,
            ).to(device=self.device, dtype=self.vae.dtype)
        latent = retrieve_latents(self.vae.encode(video), sample_mode="argmax")
        latent = latent.to(device=self.device, dtype=torch.float32)
        mean, std = latent_stats(self.vae.config, latent)
        latent = (latent - mean) * (1.0 / std)
        if self.spec.expand_timesteps:
            return latent

        # Mask over pixel frames (1 = given), folded into `temporal` channels per latent frame;
        # the first latent frame stands for one pixel frame, hence the repeat.
        mask = torch.ones(1, 1, frames, lat_h, lat_w)
        mask[:, :, 1:] = 0
        first_mask = torch.repeat_interleave(mask[:, :, 0:1], dim=2, repeats=temporal)
        mask = torch.cat([first_mask, mask[:, :, 1:]], dim=2)
        mask = mask.view(1, -1, temporal, lat_h, lat_w).transpose(1, 2).to(latent.device)
        return torch.cat([mask, latent], dim=1)


class WanTransformer(TransformerAdapter):
    """WanTransformer3DModel (two of them for Wan2.2-A14B) + its scheduler (UniPC for the
    published checkpoints)."""

    experts: Experts
    """The DiTs and the rule that picks the one of a step (:mod:`..dit.experts`)."""
    active_expert: str | None = None
    """The expert of the step that ran last (``high`` / ``low``; None: a one-DiT model):
    what the worker's progress reports carry."""

    def _load(self) -> None:
        from diffusers import WanTransformer3DModel

        # A folder of another pipeline and a DiT of the other task were refused before this
        # (model_folder.py).
        vae_config = self._config("vae")  # latent geometry only; the weights stay unread
        self.temporal = int(vae_config.get("scale_factor_temporal") or 4)
        self.spatial = int(vae_config.get("scale_factor_spatial") or 8)
        self.z_dim = int(vae_config.get("z_dim", 16))

        two = self.spec.experts == 2
        if two:
            check_placement(self.options, 2, self.compile)
            if self.group is not None:
                raise ModelLoadError(f"{self.task}: a transformer group (parallel) cannot run "
                                     "a two-expert DiT yet; serve it on one device per worker")
        high = low = self.placement
        if two and self.options.fused:  # each expert gets its half of a fused pair
            high = dataclasses.replace(high, before=functools.partial(self._fuse, half="high"))
            low = dataclasses.replace(low, before=functools.partial(self._fuse, half="low"))
        # split ('high' / 'low'): this worker loads its own expert only.
        dits: list[Any] = [None, None] if two else [None]
        if self.options.experts != "low":
            dits[0] = self._component(
                lambda p: load_diffusers_model(WanTransformer3DModel, p, high), "transformer")
        if two and self.options.experts != "high":
            # With swap the low-noise expert is built in host memory: the device never holds
            # both (the point of swap on a card that cannot).
            if self.options.experts == "swap":
                low = dataclasses.replace(low, device=torch.device("cpu"))
            self.transformer_2: Any = self._component(
                lambda p: load_diffusers_model(WanTransformer3DModel, p, low), "transformer_2")
            dits[1] = self.transformer_2
        # The DiT whose configuration and dtype the loop reads (the experts share them).
        self.transformer: Any = next(d for d in dits if d is not None)
        overrides = self.scheduler_overrides()  # flow_shift: the option's, else the recipe's
        self.scheduler: Any = self._component(lambda p: load_scheduler(p, **overrides),
                                              "scheduler")
        config = self.transformer.config
        self.patch = tuple(config.patch_size)
        for dit in self.held(dits):
            self.attention = apply_attention_backend(
                dit, self.attention, self.device, self.dtype, config.attention_head_dim,
                fallback=self.attention_fallback)
        limit = None if self.options.max_vram_gb is None else \
            int(self.options.max_vram_gb * (1 << 30))
        self.experts = Experts(dits, self._boundary() if two else None, self.options.experts,
                               self.device, limit)
        self.experts.placed()

    def _boundary(self) -> float:
        """The boundary timestep: the folder's ``boundary_ratio`` (model_index.json) times
        the scheduler's ``num_train_timesteps``, as diffusers' pipelines compute it."""
        index = read_json(self.source_dir / "model_index.json") or {}
        ratio = index.get("boundary_ratio")
        if not isinstance(ratio, int | float) or isinstance(ratio, bool) or not 0 < ratio < 1:
            raise ModelLoadError(f"{self.model_dir}/model_index.json: {self.task} needs "
                                 f"boundary_ratio between 0 and 1, got {ratio!r}")
        return float(ratio) * float(self.scheduler.config.num_train_timesteps)

    def dits(self) -> list[Any]:
        return self.experts.all()

    @staticmethod
    def held(dits: list[Any]) -> list[Any]:
        return [d for d in dits if d is not None]

    def warm_up(self, shapes: Sequence[str], steps: int = 2) -> float:
        """``split``: the held expert runs every warm-up step (outputs thrown away), so a
        worker of one expert warms up without a worker of the other."""
        with self.experts.standing_in():
            return super().warm_up(shapes, steps)

    def dit_halves(self) -> list[str] | None:
        return [self.options.experts] if self.options.experts in SPLIT_EXPERTS else None

    def resident_components(self) -> list[str]:
        """With ``swap`` one expert is on the device at a time (they are the same size);
        with ``high`` / ``low`` this worker holds one (``split``)."""
        found = super().resident_components()
        other = {"swap": "transformer_2", "high": "transformer_2", "low": "transformer"}
        return [c for c in found if c != other.get(self.options.experts)]

    def _check_geometry(self, req: GenerationRequest) -> tuple[int, int, int]:
        assert req.height is not None and req.width is not None and req.num_frames is not None
        h_mult, w_mult = self.spatial * self.patch[1], self.spatial * self.patch[2]
        if req.height % h_mult or req.width % w_mult:
            raise _geometry_error(self.task, f"height/width must be multiples of {h_mult}/{w_mult}")
        if (req.num_frames - 1) % self.temporal:
            raise _geometry_error(self.task, f"num_frames must be {self.temporal}k+1")
        frames = (req.num_frames - 1) // self.temporal + 1
        return frames, req.height // self.spatial, req.width // self.spatial

    def _denoise(
        self,
        req: GenerationRequest,
        tensors: Mapping[str, torch.Tensor],
        on_step: StepCallback | None = None,
        should_stop: StopCheck | None = None,
        loop: LoopHooks | None = None,
    ) -> dict[str, torch.Tensor]:
        from diffusers.utils.torch_utils import randn_tensor

        self._require_loaded()
        check_request_task(req, self.task, self.role)
        frames, lat_h, lat_w = self._check_geometry(req)
        pt, ph, pw = self.patch
        self._check_fp8_rows((frames // pt) * (lat_h // ph) * (lat_w // pw))
        assert req.guidance_scale is not None and req.infer_steps is not None
        i2v, expand = self.spec.needs_image, self.spec.expand_timesteps
        dtype = self.transformer.dtype
        # The high-noise expert's scale, then the low-noise one's; CFG runs or not by the
        # first alone, as in diffusers.
        scales = (req.guidance_scale, req.guidance_scale_2 if self.experts.two
                  else req.guidance_scale)
        cfg = req.guidance_scale > 1.0

        def text(name: str) -> torch.Tensor:
            return require_tensor(tensors, name, self.role, ndim=3).to(self.device).to(dtype)

        prompt_embeds = text("prompt_embeds")
        negative_embeds = text("negative_prompt_embeds") if cfg else None
        extra: dict[str, torch.Tensor] = {}
        if _clip(self.spec):
            extra["encoder_hidden_states_image"] = text("image_embeds")
        channels = self.z_dim if i2v else self.transformer.config.in_channels
        shape = (1, channels, frames, lat_h, lat_w)
        condition = self._condition(tensors, frames, lat_h, lat_w) if i2v else None
        # expand_timesteps: a timestep per token, 0 where the frame is given (TI2V-5B's I2V
        # first latent frame); ``::2``: one per 2x2 patch, as diffusers takes it.
        keep = None
        if expand:
            keep = torch.ones(1, 1, frames, lat_h, lat_w, dtype=torch.float32,
                              device=self.device)
            if i2v:
                keep[:, :, 0] = 0

        scheduler = fresh_scheduler(self.scheduler)
        with torch.no_grad():
            scheduler.set_timesteps(req.infer_steps, device=self.device)
            check_schedule(scheduler, req.infer_steps, self.task)
            if not i2v:
                # WanPipeline pins the step index; WanImageToVideoPipeline looks it up from the
                # timestep. Both give the same schedule, but mirror each exactly.
                scheduler.set_begin_index(0)
            # The initial noise, or the latents and scheduler state of a checkpoint.
            latents, first = loop_state.start(loop, scheduler, lambda: randn_tensor(
                shape, generator=cpu_generator(req.seed), device=self.device, dtype=torch.float32
            ), self.device)
            timesteps = scheduler.timesteps
            total = len(timesteps)
            self._check_resume(loop, timesteps, first)
            if first < total and not self.experts.holds(self.experts.index_at(timesteps[first])):
                # split: a task whose next step is the other expert's (a checkpoint routed
                # to the wrong kind of worker): handed back untouched, rerouted by its state.
                name = self.experts.name(self.experts.index_at(timesteps[first]))
                raise StageYielded(f"step {first + 1} runs the {name}-noise expert, which "
                                   "this worker does not hold", first, total, "other expert")
            for i in range(first, total):
                t = timesteps[i]
                self._check_stop(should_stop, i, total)
                index = self.experts.index_at(t)
                if i + 1 < total:  # swap: the other expert may move in during this step
                    self.experts.upcoming(self.experts.index_at(timesteps[i + 1]))
                dit = self.experts.get(index)
                if keep is not None and condition is not None:
                    model_input = ((1 - keep) * condition + keep * latents).to(dtype)
                elif condition is not None:
                    model_input = torch.cat([latents, condition], dim=1).to(dtype)
                else:
                    model_input = latents.to(dtype)
                if keep is not None:
                    timestep = (keep[0][0][:, ::2, ::2] * t).flatten().unsqueeze(0).expand(
                        latents.shape[0], -1)
                else:
                    timestep = t.expand(latents.shape[0])
                cache_kwargs: dict[str, Any] = {} if i2v else {
                    "step_index": i,
                    "sigma": float(scheduler.sigmas[i]),
                    "num_inference_steps": total,
                }
                noise_pred, noise_uncond = self._branches(
                    cfg, self._forward,
                    (dit, model_input, timestep, prompt_embeds, extra, "cond", cache_kwargs),
                    (dit, model_input, timestep, negative_embeds, extra, "uncond", cache_kwargs),
                    self._forward_both,
                    (dit, model_input, timestep, prompt_embeds, negative_embeds, extra,
                     cache_kwargs))
                if noise_uncond is not None:
                    scale = scales[index]
                    assert scale is not None
                    noise_pred = noise_uncond + scale * (noise_pred - noise_uncond)
                latents = scheduler.step(noise_pred, t, latents, return_dict=False)[0]
                self.active_expert = self.experts.name(index)
                if on_step is not None:
                    on_step(i + 1, total)
                upcoming = self.experts.name(self.experts.index_at(timesteps[i + 1])) \
                    if i + 1 < total else None
                loop_state.boundary(loop, i + 1, total, scheduler,
                                    functools.partial(dict, latents=latents), upcoming)
                if upcoming is not None and not self.experts.holds(
                        self.experts.index_at(timesteps[i + 1])):
                    # split: the boundary; the state goes to a worker holding the other one.
                    loop_state.hand_over(loop, i + 1, total, scheduler,
                                         functools.partial(dict, latents=latents), upcoming)
            if keep is not None and condition is not None:
                latents = (1 - keep) * condition + keep * latents
            latents = latents.contiguous()
        self._synchronize()
        self.experts.finished()  # after the sync: the copy back is off the request's path
        return {"latents": latents}

    def _condition(self, tensors: Mapping[str, torch.Tensor], frames: int, lat_h: int,
                   lat_w: int) -> torch.Tensor:
        """The I2V condition, checked against the request's geometry."""
        condition = require_tensor(tensors, "condition", self.role, ndim=5).to(self.device)
        want = (1, self.z_dim, 1, lat_h, lat_w) if self.spec.expand_timesteps else \
            (1, self.temporal + self.z_dim, frames, lat_h, lat_w)
        if tuple(condition.shape) != want:
            raise StageInputError(
                f"transformer stage input 'condition' has shape {tuple(condition.shape)}, "
                f"expected {want} for this request"
            )
        return condition

    def _check_resume(self, loop: LoopHooks | None, timesteps: torch.Tensor, step: int) -> None:
        """A resumed two-expert loop continues on the expert its checkpoint names: a
        schedule that puts the step on the other one (another boundary) is refused."""
        state = loop.resume if loop is not None else None
        if state is None or state.expert is None or step >= len(timesteps):
            return
        here = self.experts.name(self.experts.index_at(timesteps[step]))
        if here != state.expert:
            raise CheckpointError(
                f"{self.task}: the checkpoint continues at step {step} on the {state.expert}-"
                f"noise expert, but this worker's schedule runs that step on the {here}-noise "
                "one (another boundary_ratio or flow_shift?)")

    def _forward(
        self,
        dit: Any,
        model_input: torch.Tensor,
        timestep: torch.Tensor,
        text: torch.Tensor,
        extra: Mapping[str, torch.Tensor | None],
        branch: str,
        cache_kwargs: Mapping[str, Any],
    ) -> torch.Tensor:
        """One DiT forward (one CFG branch, or both as a batch of two)."""
        with dit.cache_context(branch, **cache_kwargs):
            out: torch.Tensor = dit(
                hidden_states=model_input,
                timestep=timestep,
                encoder_hidden_states=text,
                attention_kwargs=None,
                return_dict=False,
                **extra,
            )[0]
        return out

    def _forward_both(
        self,
        dit: Any,
        model_input: torch.Tensor,
        timestep: torch.Tensor,
        text: torch.Tensor,
        negative: torch.Tensor,
        extra: Mapping[str, torch.Tensor | None],
        cache_kwargs: Mapping[str, Any],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Both CFG branches as one batch-2 forward (``cfg_batch``)."""
        cond, uncond = self._forward(
            dit,
            torch.cat([model_input, model_input]),
            timestep.expand(2, *timestep.shape[1:]),
            torch.cat([text, negative]),
            {k: torch.cat([v, v]) for k, v in extra.items() if v is not None},
            "cond",
            cache_kwargs,
        ).chunk(2)
        return cond, uncond

    def warmup_inputs(self, req: GenerationRequest, variant: int) -> dict[str, torch.Tensor]:
        """Random conditioning of the shapes the encoder produces for ``req``."""
        config = self.transformer.config
        dtype = self.transformer.dtype
        assert req.max_sequence_length is not None
        gen = torch.Generator("cpu").manual_seed(variant)

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(shape, generator=gen).to(self.device, dtype)

        text = (1, req.max_sequence_length, config.text_dim)
        out = {"prompt_embeds": rand(*text), "negative_prompt_embeds": rand(*text)}
        if self.spec.needs_image:
            frames, lat_h, lat_w = self._check_geometry(req)
            if _clip(self.spec):
                # CLIP ViT-H/14 at 224 px: 256 patches + the class token.
                out["image_embeds"] = rand(1, 257, config.image_dim)
            shape = (1, self.z_dim, 1, lat_h, lat_w) if self.spec.expand_timesteps else \
                (1, self.temporal + self.z_dim, frames, lat_h, lat_w)
            out["condition"] = torch.randn(shape, generator=gen).to(self.device)
        return out


class WanDecoder(DecoderAdapter):
    """AutoencoderKLWan decode to frames."""

    def _load(self) -> None:
        from diffusers import AutoencoderKLWan
        from diffusers.video_processor import VideoProcessor

        self.vae: Any = self._component(
            lambda p: load_diffusers_model(AutoencoderKLWan, p, self.placement), "vae"
        )
        self.video_processor = VideoProcessor(vae_scale_factor=self.vae.config.scale_factor_spatial)

    def decode_tensor(
        self, req: GenerationRequest, tensors: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        latents = self._latents(req, tensors)
        with torch.no_grad():
            video = decode_latents(self.vae, latents, self.device)
            return self._channels_last(video)

    def frame_chunks(
        self, req: GenerationRequest, tensors: Mapping[str, torch.Tensor]
    ) -> FrameChunks | None:
        """One chunk per latent frame (:mod:`.wan_stream`); None for a tiled decode."""
        from .wan_stream import decode_by_latent_frame, streams

        latents = self._latents(req, tensors)
        if not streams(self.vae, latents):
            return None
        frames = 1 + (latents.shape[2] - 1) * self.vae.config.scale_factor_temporal

        def run(each: Callable[[torch.Tensor], None]) -> None:
            decode_by_latent_frame(self.vae, latents, self.device,
                                   lambda video: each(self._channels_last(video)))

        return FrameChunks(frames, run)

    def _latents(self, req: GenerationRequest, tensors: Mapping[str, torch.Tensor]
                 ) -> torch.Tensor:
        self._require_loaded()
        check_request_task(req, self.task, self.role)
        latents = require_tensor(tensors, "latents", self.role, ndim=5)
        if latents.shape[1] != self.vae.config.z_dim:
            raise StageInputError(
                f"decoder stage input 'latents' has {latents.shape[1]} channels, the VAE "
                f"expects {self.vae.config.z_dim}"
            )
        return latents

    def _channels_last(self, video: torch.Tensor) -> torch.Tensor:
        """The VAE's (1, C, F, H, W) output -> (F, H, W, C) in [0, 1], as the pipelines'
        postprocessing makes it (elementwise: a part of the video gives its part)."""
        with torch.no_grad():
            frames = self.video_processor.postprocess_video(video, output_type="pt")
        # (1, F, C, H, W) -> (F, H, W, C), what the "np" output type's conversion does.
        pixels: torch.Tensor = frames[0].permute(0, 2, 3, 1)
        return pixels
