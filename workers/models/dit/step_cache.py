"""Step caches per request on the DiT stage: diffusers' cache hooks (``CacheMixin``).

A request's cache (or the worker's ``transformer.cache`` default) is turned into diffusers'
config object (``FirstBlockCacheConfig``, ``MagCacheConfig``, ...) and enabled on the DiT
for that request only: ``enable_cache`` before the loop, ``disable_cache`` after it (also
when the loop fails or is cancelled), which removes the hooks and the state they held, so
no request starts from another's cache. diffusers' pipelines run the same hooks inside the
same ``cache_context`` names ("cond" / "uncond"), so a cached request gives the pixels of
the pipeline with that cache enabled.

Which kinds work with which model class was established by running each in diffusers'
own pipelines on the tiny models (tests/integration/test_lora.py keeps it so); the others
are refused with the reason.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from contracts.dit_request import CacheSpec
from contracts.errors import InvalidRequestError

_BATCHED_CFG = ("needs both guidance branches in one batch; diffusers' {model} pipelines "
                "run them as two forwards")
UNSUPPORTED: dict[str, dict[str, str]] = {
    "wan": {"faster_cache": _BATCHED_CFG.format(model="Wan")},
    "qwen": {
        "faster_cache": _BATCHED_CFG.format(model="Qwen-Image"),
        "pyramid_attention_broadcast": "its attention states are reused across the prompt "
        "and the negative prompt, which differ in length on Qwen-Image (the hook fails)",
    },
}
"""Family -> cache kind -> why the family's DiT cannot run it."""
_TIMESTEP_CALLBACK = ("pyramid_attention_broadcast", "faster_cache")
"""Kinds whose config wants the loop's current timestep (``current_timestep_callback``)."""


def supported_kinds(family: str) -> list[str]:
    from contracts.dit_request import CACHE_KINDS

    refused = UNSUPPORTED.get(family, {})
    return [k for k in CACHE_KINDS if k not in refused]


def check_kind(family: str, model: str, kind: str) -> None:
    why = UNSUPPORTED.get(family, {}).get(kind)
    if why is not None:
        raise InvalidRequestError(
            f"cache kind {kind!r} is not supported by {model}: {why}; use one of "
            f"{', '.join(supported_kinds(family))}")


def build_config(spec: CacheSpec, infer_steps: int, timestep: Any) -> Any:
    """diffusers' config object of ``spec`` (``timestep()``: the loop's current timestep)."""
    import diffusers.hooks as hooks
    import torch

    kwargs = spec.kwargs()
    if spec.kind == "mag_cache":
        kwargs.setdefault("num_inference_steps", infer_steps)  # the ratios' interpolation
    if kwargs.get("taylor_factors_dtype") is not None:
        kwargs["taylor_factors_dtype"] = getattr(torch, kwargs["taylor_factors_dtype"])
    for name, value in kwargs.items():
        if name.endswith("_range") and isinstance(value, list):
            kwargs[name] = tuple(value)
        if name.endswith("_identifiers") and isinstance(value, list):
            kwargs[name] = tuple(value)
    if spec.kind in _TIMESTEP_CALLBACK:
        kwargs["current_timestep_callback"] = timestep
    try:
        return getattr(hooks, spec.config_class)(**kwargs)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"cache {spec.kind}: {exc}") from None


@contextlib.contextmanager
def cache_enabled(transformer: Any, spec: CacheSpec | None, infer_steps: int
                  ) -> Iterator[None]:
    """``spec``'s hooks on ``transformer`` inside, none after."""
    if spec is None:
        yield
        return
    current: list[Any] = [None]

    def record(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        # What diffusers' pipelines expose as `current_timestep`: the scheduler's t, which
        # reaches the Wan DiT unscaled (a batch of one or two copies).
        t = kwargs.get("timestep")
        current[0] = t.flatten()[0] if t is not None else None

    handle = None
    if spec.kind in _TIMESTEP_CALLBACK:
        handle = transformer.register_forward_pre_hook(record, with_kwargs=True)
    config = build_config(spec, infer_steps, lambda: current[0])
    try:
        transformer.enable_cache(config)
    except Exception as exc:  # the hooks' own checks (a model too small for the kind, ...)
        if transformer.is_cache_enabled:
            transformer.disable_cache()
        if handle is not None:
            handle.remove()
        model = type(transformer).__name__
        raise InvalidRequestError(f"cache {spec.kind} cannot run on this {model}: "
                                  f"{type(exc).__name__}: {exc}") from None
    try:
        yield
    finally:
        transformer.disable_cache()
        if handle is not None:
            handle.remove()
