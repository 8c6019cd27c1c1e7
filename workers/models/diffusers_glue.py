"""Loading helpers shared by the Wan and Qwen adapters (imports torch and diffusers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from contracts.errors import InvalidRequestError, ModelLoadError

from .layouts import source_of
from .memory import Placement, place


def load_diffusers_model(cls: Any, path: str, placement: Placement) -> Any:
    """A diffusers model (DiT or VAE) in eval mode, placed on the stage's device with its
    memory options (:func:`workers.models.memory.place`). A view's component (a folder in
    another layout) is converted from its files (:mod:`workers.models.convert`)."""
    return place(_load(cls, path, placement).eval(), placement)


def load_transformers_model(cls: Any, path: str, placement: Placement) -> Any:
    """A transformers model (text / image encoder) in eval mode, placed likewise."""
    return place(_load(cls, path, placement).eval(), placement)


def _load(cls: Any, path: str, placement: Placement) -> Any:
    source = source_of(Path(path))
    if source is not None:
        from .convert import load_converted

        return load_converted(cls, Path(path), source, placement.dtype)
    return cls.from_pretrained(path, dtype=placement.dtype, local_files_only=True)


def load_scheduler(path: str, **overrides: Any) -> Any:
    """The scheduler class named in ``scheduler_config.json`` (what diffusers' pipelines load;
    Wan2.1 ships UniPC, Qwen-Image FlowMatchEuler). ``overrides``: config values to change
    (``flow_shift``), diffusers' way: the scheduler built with them instead of the file's."""
    import diffusers
    from diffusers import SchedulerMixin

    config_file = Path(path) / "scheduler_config.json"
    try:
        class_name = json.loads(config_file.read_text())["_class_name"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{config_file} does not name a scheduler class: {e}") from e
    cls = getattr(diffusers, str(class_name), None)
    if not (isinstance(cls, type) and issubclass(cls, SchedulerMixin)):
        raise ModelLoadError(f"{config_file} names {class_name!r}, not a diffusers scheduler")
    return cls.from_pretrained(path, local_files_only=True, **overrides)


def fresh_scheduler(template: Any) -> Any:
    """A new scheduler per request: multistep schedulers (UniPC) keep solver history and step
    indices, which must never leak from one request into the next."""
    return type(template).from_config(template.config)


def check_schedule(scheduler: Any, steps: int, task: str) -> None:
    """Refuse a schedule with NaN/inf sigmas instead of denoising into NaN latents (e.g.
    Qwen-Image's terminal shift divides by zero for a single step)."""
    sigmas = getattr(scheduler, "sigmas", None)
    if sigmas is not None and not bool(torch.isfinite(torch.as_tensor(sigmas)).all()):
        plural = "step" if steps == 1 else "steps"
        raise InvalidRequestError(
            f"{task}: the scheduler ({type(scheduler).__name__}) gives no valid noise schedule "
            f"for {steps} {plural}; use more steps"
        )


def cpu_generator(seed: int) -> torch.Generator:
    """The initial-noise generator. A CPU generator makes the noise independent of the device
    (diffusers' ``randn_tensor`` draws on the CPU and moves the result)."""
    return torch.Generator("cpu").manual_seed(seed)


def latent_stats(vae_config: Any, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) of the VAE latents, shaped for (B, C, T, H, W) and cast like ``like``.

    Callers that need ``1 / std`` take the reciprocal after this cast, as the pipelines do,
    so that bf16 rounding is the same.
    """
    z = vae_config.z_dim
    mean = torch.tensor(vae_config.latents_mean).view(1, z, 1, 1, 1).to(like.device, like.dtype)
    std = torch.tensor(vae_config.latents_std).view(1, z, 1, 1, 1).to(like.device, like.dtype)
    return mean, std


def decode_latents(vae: Any, latents: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The VAE's output for normalised ``latents`` (B, C, T, H, W), decoded as the pipelines
    do it: on ``device`` in the VAE's dtype, un-normalised (``latents / (1 / std) + mean``),
    without autograd."""
    with torch.no_grad():
        latents = latents.to(device=device, dtype=vae.dtype)
        mean, std = latent_stats(vae.config, latents)
        latents = latents / (1.0 / std) + mean
        decoded: torch.Tensor = vae.decode(latents, return_dict=False)[0]
        return decoded
