"""Recipes: the request defaults and scheduler settings a step-distilled model is served with.

A step-distilled DiT (LightX2V's 4-step Wan2.1 distill, as a model or as the base model plus
its LoRA; Qwen-Image-Lightning's 4- and 8-step LoRAs) is trained for one schedule: few steps,
one scheduler shift, and (CFG-distilled) no classifier-free guidance. A service names its
recipe with the top-level ``recipe`` key of its file, or a model folder declares it in a
``diffring_recipe.json`` (``{"recipe": "<name>"}``) that its transformer worker reads:

* the front door fills what a request leaves unset from the recipe's ``request_defaults``
  (below the service's own ``request_defaults``), so a plain request gets the recipe;
* the DiT runs the recipe's scheduler settings (Wan: ``flow_shift`` unless
  ``transformer.flow_shift`` is set; Qwen-Image: the scheduler config the Lightning LoRAs
  were distilled with);
* a CFG-distilled recipe refuses a request asking for guidance (scale above 1), at the front
  door and again in the DiT, naming the reason.

The values are the published ones: LightX2V's distill configs (4 steps, ``sample_shift`` 5,
``enable_cfg`` false) and Qwen-Image-Lightning's diffusers script (8 or 4 steps, CFG 1.0, a
FlowMatchEuler scheduler with dynamic shifting pinned at shift 3: ``base_shift`` =
``max_shift`` = ln 3, no terminal shift). Nothing here imports a model library.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from contracts.errors import ConfigError, InvalidRequestError

__all__ = ["RECIPES", "RECIPE_FILE", "Recipe", "check_guidance", "folder_recipe", "recipe"]

RECIPE_FILE: Final = "diffring_recipe.json"
"""The file by which a model folder declares its recipe (``{"recipe": "<name>"}``)."""


@dataclass(frozen=True)
class Recipe:
    """How one distilled model is served."""

    name: str
    family: str
    """``wan`` or ``qwen``: the pipelines it applies to."""
    request_defaults: Mapping[str, Any]
    """What a request leaving the field unset gets (the keys ``request_defaults`` takes)."""
    cfg_distilled: bool = False
    """The model was distilled to run without classifier-free guidance: a request asking
    for guidance (scale above 1) is refused."""
    flow_shift: float | None = None
    """Wan: the UniPC scheduler's shift."""
    scheduler: Mapping[str, Any] = field(default_factory=dict)
    """Qwen-Image: scheduler config values replacing the folder's."""

    @property
    def guidance_key(self) -> str:
        return "guidance_scale" if self.family == "wan" else "true_cfg_scale"


_LIGHTNING_SCHEDULER: Final[dict[str, Any]] = {
    "base_image_seq_len": 256, "max_image_seq_len": 8192,
    "base_shift": math.log(3), "max_shift": math.log(3), "shift": 1.0,
    "shift_terminal": None, "use_dynamic_shifting": True, "time_shift_type": "exponential",
    "invert_sigmas": False, "stochastic_sampling": False, "use_beta_sigmas": False,
    "use_exponential_sigmas": False, "use_karras_sigmas": False,
}

RECIPES: Final[dict[str, Recipe]] = {r.name: r for r in (
    Recipe("wan2.1-distill-4step", "wan", {"infer_steps": 4, "guidance_scale": 1.0},
           cfg_distilled=True, flow_shift=5.0),
    Recipe("qwen-image-lightning-8step", "qwen", {"infer_steps": 8, "true_cfg_scale": 1.0},
           cfg_distilled=True, scheduler=_LIGHTNING_SCHEDULER),
    Recipe("qwen-image-lightning-4step", "qwen", {"infer_steps": 4, "true_cfg_scale": 1.0},
           cfg_distilled=True, scheduler=_LIGHTNING_SCHEDULER),
)}
"""The recipes served, by name."""


def recipe(name: str | None, family: str | None = None) -> Recipe | None:
    """The recipe called ``name`` (None: none), refused when unknown or (``family`` given)
    made for the other family."""
    if name is None:
        return None
    found = RECIPES.get(name)
    if found is None:
        raise ConfigError(f"recipe must be one of {', '.join(RECIPES)}, got {name!r}")
    if family is not None and found.family != family:
        raise ConfigError(f"recipe {name!r} is for the {found.family} pipelines, this service "
                          f"serves a {family} one")
    return found


def folder_recipe(folder: Path) -> str | None:
    """The recipe a model folder declares in :data:`RECIPE_FILE` (None: none)."""
    path = folder / RECIPE_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} is not readable JSON: {exc}") from None
    name = data.get("recipe") if isinstance(data, dict) else None
    if not isinstance(name, str) or name not in RECIPES:
        raise ConfigError(f"{path} must hold {{\"recipe\": <one of {', '.join(RECIPES)}>}}, "
                          f"got {data!r}")
    return name


def check_guidance(found: Recipe | None, guidance_scale: float | None,
                   true_cfg_scale: float | None) -> None:
    """Refuse guidance on a CFG-distilled recipe (:class:`InvalidRequestError`, the reason
    and what to send instead)."""
    if found is None or not found.cfg_distilled:
        return
    scale = guidance_scale if found.family == "wan" else true_cfg_scale
    if scale is not None and scale > 1.0:
        raise InvalidRequestError(
            f"{found.guidance_key} {scale:g} asks for classifier-free guidance, but this "
            f"service runs {found.name}, a CFG-distilled model (it was trained to run "
            f"without guidance): send {found.guidance_key} 1.0 or leave it unset")
