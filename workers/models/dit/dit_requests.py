"""What a DiT stage sets up around one request's denoising loop: its LoRA adapters
(:mod:`workers.models.dit.lora`) and its step cache (:mod:`workers.models.dit.step_cache`),
and what it refuses first (guidance on a CFG-distilled recipe: :mod:`contracts.recipes`).

:meth:`RequestOptions.scope` wraps the whole loop from outside (the loop body knows nothing
of either): inside, the request's adapters are active at their strengths and its cache's
hooks are on; after it, whatever happened inside, the DiT is the base model again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from contracts.dit_request import MAX_LORAS, CacheSpec
from contracts.errors import AdapterError, InvalidRequestError, ModelLoadError
from contracts.recipes import check_guidance, recipe
from contracts.request import GenerationRequest
from contracts.stage_options import StageOptions

from .lora import HotswapSlots, LoraLibrary, scan_half
from .step_cache import cache_enabled, check_kind, supported_kinds


class RequestOptions:
    """The request-level options of one loaded DiT."""

    def __init__(self, dits: Sequence[Any], family: str, task: str, options: StageOptions,
                 compiled: bool, recipe_name: str | None = None,
                 halves: Sequence[str] | None = None) -> None:
        transformer = dits[0]
        self.transformer = transformer
        self.two = len(dits) == 2 or halves is not None
        """Wan2.2-A14B: each expert has its own adapters (its half of each pair) and no
        step cache is offered (diffusers' cache hooks are per model: not served yet)."""
        self.recipe = recipe(recipe_name, family)
        self.fused = {r.name for r in options.fused}
        self.family = family
        self.task = task
        self.compiled = compiled
        # A step cache decides per rank whether to skip a block: under sequence parallelism
        # the ranks of one forward could decide differently and leave each other waiting in
        # a collective, so such a group offers none.
        self.sequence_parallel = options.layout.sequence > 1
        self.model = type(transformer).__name__
        self.default_cache = options.default_cache
        if self.default_cache is not None:
            if self.two:
                raise ModelLoadError(f"transformer.cache: {task} runs two experts, and step "
                                     "caches are not served for them yet; drop the option")
            check_kind(family, self.model, self.default_cache.kind)
        self.libraries: list[LoraLibrary | HotswapSlots] = []
        """One per DiT (Wan2.2-A14B: the high-noise expert's, then the low-noise one's)."""
        folder = Path(options.lora_dir) if options.lora_dir is not None else None
        # ``halves``: the experts this worker holds (split: one of them), else both / none.
        named: Sequence[str | None] = tuple(halves) if halves is not None else \
            ("high", "low") if self.two else (None,)
        # A folder holding only the fused adapters offers none per request: no library, so a
        # compiled worker compiles no slots (a distilled deployment pays nothing per step).
        if folder is not None and not (
                self.fused and set(scan_half(folder, named[0])) <= self.fused):
            for dit, half in zip(dits, named, strict=True):
                library: LoraLibrary | HotswapSlots
                if compiled:
                    library = HotswapSlots(dit, family, folder, task,
                                           min(options.lora_max_loaded, MAX_LORAS),
                                           options.lora_max_rank, options.fused, half)
                    library.prepare()  # before the compile: the slots are part of the graph
                else:
                    library = LoraLibrary(dit, family, folder, task, options.lora_max_loaded,
                                          options.lora_max_mb << 20, options.fused, half)
                self.libraries.append(library)
        self.loras: LoraLibrary | HotswapSlots | None = \
            self.libraries[0] if self.libraries else None
        """The (first) DiT's adapters: the names requests may give."""

    def lora_names(self) -> list[str]:
        return self.loras.names() if self.loras is not None else []

    def cache_kinds(self) -> list[str]:
        if self.compiled or self.sequence_parallel or self.two:
            return []
        return supported_kinds(self.family)

    def cache_for(self, req: GenerationRequest) -> CacheSpec | None:
        """The cache ``req`` runs with (its own, else the worker's default), checked."""
        if req.cache_off:
            return None
        spec = req.cache or self.default_cache
        if spec is not None:
            if self.two:
                raise InvalidRequestError(
                    f"step caches are not available on {self.task} (two experts, each with "
                    "its own steps: not served yet); send the request without a cache")
            if self.sequence_parallel:
                raise InvalidRequestError(
                    "step caches are not available on a sequence-parallel transformer group "
                    "(its ranks could skip different blocks of one forward); send the request "
                    "without a cache, or serve caches from single-device or cfg-only workers"
                )
            if self.compiled:
                raise InvalidRequestError(
                    "step caches are not available on a compiled transformer worker (their "
                    "hooks skip blocks by data-dependent branches); send the request without "
                    "cache, or to a worker without compile")
            check_kind(self.family, self.model, spec.kind)
        return spec

    @contextlib.contextmanager
    def scope(self, req: GenerationRequest) -> Iterator[None]:
        check_guidance(self.recipe, req.guidance_scale, req.true_cfg_scale)
        fused = [r.name for r in req.loras if r.name in self.fused]
        if fused:
            raise AdapterError(f"adapter {', '.join(fused)} is fused into this worker's "
                               "weights (transformer.lora_fuse): every request gets it; send "
                               "the request without it")
        if req.loras and self.loras is None:
            raise AdapterError(
                f"this transformer worker has no LoRA adapters (transformer.lora_dir unset); "
                f"send the request without loras ({', '.join(r.name for r in req.loras)})")
        spec = self.cache_for(req)
        assert req.infer_steps is not None
        with contextlib.ExitStack() as stack:
            for library in self.libraries:  # each expert its half of each pair
                stack.enter_context(library.applied(req.loras))
            stack.enter_context(cache_enabled(self.transformer, spec, req.infer_steps))
            yield

    def warm(self, denoise: Callable[..., Any], *args: Any) -> None:
        """With compiled adapter slots: a warm-up loop with the slots active (at strength
        0), so that the first request with an adapter does not compile."""
        slots = [lib for lib in self.libraries if isinstance(lib, HotswapSlots)]
        if slots:
            with contextlib.ExitStack() as stack:
                for lib in slots:
                    stack.enter_context(lib.warming())
                denoise(*args)
