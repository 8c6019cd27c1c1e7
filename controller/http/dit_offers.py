"""The front door's view of what the DiT workers serve: LoRA adapters, step caches, the
adapters fused into their weights, and their recipe.

Transformer workers report their ``lora_dir``'s adapters, the cache kinds their model runs,
their fused adapters and their recipe when they register
(:class:`~controller.ownership.registry.WorkerRegistry`); a request naming an adapter none of
them has, an adapter they run fused (every request gets it), or a cache kind none of them
runs, is refused here (422, listing what is on offer) rather than failed later by a worker.
While no transformer worker is registered nothing can be judged: the request is queued and
the worker that takes it checks.
"""

from __future__ import annotations

from typing import Any

from contracts.errors import ConfigError
from contracts.recipes import Recipe, recipe
from contracts.request import GenerationRequest
from controller.http.schemas import TaskRequest, http_error
from controller.ownership.registry import WorkerRegistry


def lora_fields(body: TaskRequest) -> dict[str, Any]:
    """The request fields of a body's adapters and cache: LightX2V's one ``lora_name`` /
    ``lora_strength``, or the list ``loras``; ``cache`` as given."""
    out: dict[str, Any] = {}
    if body.lora_name not in (None, ""):
        if body.loras:
            raise http_error(422, "give lora_name (one adapter) or loras (a list), not both")
        strength = 1.0 if body.lora_strength is None else body.lora_strength
        out["loras"] = [{"name": body.lora_name, "strength": strength}]
    elif body.lora_strength is not None:
        raise http_error(422, "lora_strength needs lora_name (the adapter it applies to)")
    elif body.loras:
        out["loras"] = body.loras
    if body.cache is not None:
        out["cache"] = body.cache
    return out


def check_offers(req: GenerationRequest,
                 offers: tuple[dict[str, list[str]], set[str]] | None,
                 fused: dict[str, list[tuple[str, float]]] | None = None) -> None:
    """422 for an adapter or cache kind no registered DiT worker serves, or an adapter they
    run fused."""
    if offers is None:
        return
    loras, caches = offers
    always = [r.name for r in req.loras if r.name not in loras and r.name in (fused or {})]
    if always:
        assert fused is not None
        worker, strength = fused[always[0]][0]
        raise http_error(
            422, f"LoRA adapter {', '.join(always)} is fused into the transformer workers' "
                 f"weights ({worker}: strength {strength:g}): every request gets it; send the "
                 "request without it (GET /v1/loras)")
    missing = [r.name for r in req.loras if r.name not in loras]
    if missing:
        raise http_error(
            422, f"unknown LoRA adapter(s) {', '.join(missing)}; the transformer workers "
                 f"serve {', '.join(loras) or 'none (no lora_dir configured)'} "
                 "(GET /v1/loras)")
    if req.cache is not None and not req.cache_off and req.cache.kind not in caches:
        raise http_error(
            422, f"cache kind {req.cache.kind!r} is not run by the transformer workers of "
                 f"{req.task}; they run {', '.join(sorted(caches)) or 'none'} "
                 "(GET /v1/loras)")


def workers_recipe(registry: WorkerRegistry) -> Recipe | None:
    """The recipe the registered transformer workers declare, when they all declare the same
    one (None: none registered, none declared, or they differ)."""
    names = registry.dit_recipes()
    if len(names) != 1:
        return None
    (name,) = names
    try:
        return recipe(name)
    except ConfigError:  # a worker of a newer build naming a recipe this one does not know
        return None


def listing(registry: WorkerRegistry) -> dict[str, Any]:
    """``GET /v1/loras``: the adapters on offer, who serves each, the cache kinds, and the
    adapters fused into the workers' weights."""
    offers = registry.dit_offers()
    loras, caches = offers if offers is not None else ({}, set())
    return {
        "loras": [{"name": name, "workers": workers} for name, workers in loras.items()],
        "fused": [{"name": name, "workers": [{"worker": w, "strength": s} for w, s in held]}
                  for name, held in registry.dit_fused().items()],
        "caches": sorted(caches),
        "transformer_workers": sum(1 for w in registry if w.role == "transformer"),
    }
