"""Per-stage options of the work inside a stage: weight storage, offload, a memory budget,
and the DiT's precision (``encoder`` / ``transformer`` / ``decoder`` sections of a service's
file).

Every option is off by default, and with every option off a stage computes exactly what it
computed before they existed (bit-identical outputs). The options name diffusers' and
torch's own mechanisms:

* ``weight_storage: "fp8"``: weights stored as ``float8_e4m3fn`` and upcast layer by layer
  to the stage's dtype for compute (diffusers' layerwise casting). Lossy (the weights are
  rounded to FP8); the compute stays in the stage's dtype.
* ``offload: "block" | "leaf"``: weights live in pinned host memory and are moved to the
  GPU ahead of use on a copy stream (diffusers' group offloading, block or leaf level).
  Exact (the same weights, moved).
* ``max_vram_gb``: the stage's GPU memory budget: checked against an estimate at load (the
  stage refuses to start when it cannot fit, naming the options that would) and enforced
  for the process (``torch.cuda.set_per_process_memory_fraction``).
* ``vae_tiling`` (decoder): tiled VAE decode where the VAE class offers it (less memory for
  large videos; tile seams are blended, so not bit-identical).
* ``linear: "fp8"`` (transformer): the DiT's linear layers as FP8 matmuls with rowwise
  dynamic activation scales (torchao), fused by ``compile``. Lossy.
* ``compile_cache_dir`` (transformer): where torch's compile caches live, so that a second
  start of a worker with ``compile`` reuses the first start's compiled kernels.
* ``lora_dir`` (transformer): a local folder of LoRA adapters (``<name>.safetensors``)
  requests may name; the most recently used stay loaded, bounded by ``lora_max_loaded`` and
  ``lora_max_mb``; with ``compile``, ``lora_max_rank`` is the rank the compiled slots hold
  (docs/lora.md). A request without adapters computes exactly what the base model does.
  Adapters work on every weight format the stage serves (``linear: "fp8"``,
  ``weight_storage: "fp8"``, ``offload``): :mod:`workers.models.dit.lora_layers` says how.
* ``lora_fuse`` (transformer): adapters of ``lora_dir`` merged into the DiT's weights once at
  load, before any FP8 conversion, at their strengths (``[{"name": ..., "strength": ...}]``):
  a distilled deployment's adapter at no cost per step. Lossless up to float rounding of the
  merge; requests cannot name them (they are always on) but may add others.
* ``cache`` (transformer): the default step cache of the worker's requests (``{"kind":
  ..., <parameters>}`` in diffusers' names, :mod:`contracts.dit_request`). Lossy.
* ``checkpoint_every_s`` / ``checkpoint_every_steps`` (transformer): the denoising loop's
  state is checkpointed to the controller every so many seconds of DiT time and/or steps, so
  a lost DiT attempt resumes at its last checkpoint on any DiT worker, a drained or
  preempted one hands its task back at a step boundary, and the final latents are kept until
  the result is written (docs/operations.md, "What survives what"). Exact: a resumed loop
  computes the same bytes.
* ``experts`` (transformer, Wan2.2-A14B): where its two DiTs live: ``"both"`` on the device,
  or ``"swap"``: one on the device and the other in pinned host memory, swapped at the
  boundary (:mod:`workers.models.dit.experts`); or ``"high"`` / ``"low"``: the ``split``
  placement, a worker holding one expert, the request handed from a high-noise worker to a
  low-noise one at the boundary through the controller (:mod:`workers.checkpoints`).
  Exact in every placement (the same weights; the same loop state, moved).
* ``parallel`` (transformer): the layout of a transformer group, one DiT worker over several
  devices (``"cfg=2,ulysses=2"``: :mod:`contracts.parallel`; the devices are the service's
  ``devices``), with ``group_timeout_s`` and ``group_restarts`` for its faults.

The attention kernel (``attention_backend``, e.g. ``"fp8_cudnn"``), ``compile``,
``cfg_batch`` and ``warmup_shapes`` stay top-level keys of the file, as before.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Final

from contracts.dit_request import CacheSpec, LoraRef, parse_cache, parse_loras
from contracts.errors import ConfigError, InvalidRequestError
from contracts.parallel import ParallelLayout

__all__ = ["EXPERT_PLACEMENTS", "LINEAR_MODES", "OFFLOAD_MODES", "SPLIT_EXPERTS",
           "WEIGHT_STORAGE", "StageOptions"]

WEIGHT_STORAGE: Final[tuple[str, ...]] = ("dtype", "fp8")
OFFLOAD_MODES: Final[tuple[str, ...]] = ("none", "block", "leaf")
LINEAR_MODES: Final[tuple[str, ...]] = ("dtype", "fp8")
EXPERT_PLACEMENTS: Final[tuple[str, ...]] = ("both", "swap", "high", "low")
SPLIT_EXPERTS: Final[tuple[str, ...]] = ("high", "low")
"""The ``experts`` values of the ``split`` placement: a worker holding one expert."""
_TRANSFORMER_ONLY = ("linear", "compile_cache_dir", "lora_dir", "lora_fuse", "lora_max_loaded",
                     "lora_max_mb", "lora_max_rank", "cache", "parallel", "group_timeout_s",
                     "group_restarts", "checkpoint_every_s", "checkpoint_every_steps",
                     "flow_shift", "experts")
_DECODER_ONLY = ("vae_tiling",)


@dataclass(frozen=True)
class StageOptions:
    """What one stage holds on its GPU and how its model computes."""

    weight_storage: str = "dtype"
    """'dtype': weights in the stage's dtype (exact); 'fp8': float8_e4m3fn storage, compute
    in the stage's dtype (diffusers' layerwise casting; about half the weight memory)."""
    offload: str = "none"
    """'none': weights on the GPU; 'block': blocks of layers in pinned host memory, each
    moved in ahead of use on a copy stream; 'leaf': the same per layer (least memory,
    slowest)."""
    offload_blocks: int = 1
    """With offload 'block': blocks per group moved in at once."""
    max_vram_gb: float | None = None
    """GPU memory budget of this stage in GiB (None: the whole device)."""
    vae_tiling: bool = False
    """Decoder: tiled VAE decode (where the VAE class offers it)."""
    linear: str = "dtype"
    """Transformer: 'fp8' runs the DiT's linear layers as FP8 matmuls (torchao float8,
    rowwise dynamic activation scaling); needs a CUDA GPU of compute capability 8.9+."""
    compile_cache_dir: str | None = None
    """Transformer: folder of torch's compile caches (Inductor, AOTAutograd, Triton) kept
    across worker starts; None leaves torch's default (a per-user temporary folder)."""
    lora_dir: str | None = None
    """Transformer: local folder of LoRA adapters, one ``<name>.safetensors`` each
    (diffusers' format or a format diffusers' loader converts); None: no adapters."""
    lora_fuse: tuple[dict[str, Any], ...] = ()
    """Transformer: adapters of ``lora_dir`` merged into the weights at load (``{"name":
    ..., "strength": 1.0}`` each, at most 4), before FP8 storage or FP8 linear layers are
    applied: no cost per step. Requests may add other adapters on top."""
    lora_max_loaded: int = 4
    """Transformer: adapters kept loaded at most (least recently used first out)."""
    lora_max_mb: int = 4096
    """Transformer: MiB of adapter weights kept loaded at most."""
    lora_max_rank: int | None = None
    """Transformer with ``compile``: the rank the compiled adapter slots are padded to
    (diffusers' ``enable_lora_hotswap(target_rank=...)``); None: the largest rank in
    ``lora_dir`` at start."""
    cache: dict[str, Any] | None = None
    """Transformer: default step cache of every request that names none, e.g.
    ``{"kind": "first_block_cache", "threshold": 0.05}``; None: no cache."""
    parallel: str | None = None
    """Transformer: the layout of a transformer group (``"cfg=2"``, ``"ulysses=2"``,
    ``"cfg=2,ulysses=2"``, ...; :mod:`contracts.parallel`); None: one device."""
    group_timeout_s: float = 120.0
    """Transformer group: the longest any rank waits in a collective for the others, and the
    longest a rank may go without a heartbeat, before the group is taken down (and restarted).
    Must exceed the longest step of one rank between two collectives (a DiT forward) and,
    with checkpoints, rank 0's sending of the checkpoint it hands a task back with (the other
    ranks wait for its word at the next step meanwhile)."""
    group_restarts: int = 3
    """Transformer group: restarts of the whole group after a rank died or hung, before its
    supervisor gives up and exits with an error naming the rank."""
    checkpoint_every_s: float | None = None
    """Transformer: checkpoint a request's denoising state (latents, the scheduler's whole
    state, the step, the encoder's outputs) to the controller after a step boundary once this
    many seconds of DiT time passed since the last checkpoint. Either checkpoint option turns
    checkpointing on: a lost attempt then resumes from its last checkpoint, SIGTERM and
    preemption hand the task back at the next step boundary, and the final latents are kept
    until the result is written. In a transformer group rank 0 checkpoints for the group (every
    rank holds the same loop state). None (with ``checkpoint_every_steps`` None): off, as
    before."""
    checkpoint_every_steps: int | None = None
    """Transformer: checkpoint every this many denoising steps (see ``checkpoint_every_s``;
    with both set, whichever comes first)."""
    recipe: str | None = dataclasses.field(default=None, metadata={"from_file": False})
    """Transformer: the service's ``recipe`` (:mod:`contracts.recipes`), set from the
    file's top-level key by the config reader: the DiT's scheduler settings and whether it
    refuses guidance (a CFG-distilled model)."""
    flow_shift: float | None = None
    """Transformer, Wan: the UniPC scheduler's ``flow_shift`` instead of the one in the
    folder's scheduler config (diffusers' way of changing it: the scheduler built with
    ``flow_shift=...``); LightX2V's ``sample_shift``. None: the folder's (3.0 for Wan2.1
    480p)."""

    experts: str = "both"
    """Transformer, Wan2.2-A14B: where its two experts live. 'both': on the device (twice
    one expert's memory); 'swap': the one running on the device, the other in pinned host
    memory, swapped when the schedule crosses the boundary (on a copy stream, overlapped
    with the last high-noise step where both fit) and back after the loop. Not with
    ``linear: "fp8"``, offload or ``compile``. 'high' / 'low' (the ``split`` placement): this
    worker holds that expert alone and runs its steps; at the boundary a high-noise worker
    hands the loop state to the controller, and a low-noise worker takes it from there (a
    group needs both kinds, and a controller that keeps checkpoints)."""

    def __post_init__(self) -> None:
        if self.experts not in EXPERT_PLACEMENTS:
            raise ConfigError(f"experts must be one of {', '.join(EXPERT_PLACEMENTS)}, got "
                              f"{self.experts!r}")
        layout = ParallelLayout.parse(self.parallel)  # a bad layout is refused by name
        if self.cache is not None and layout.sequence > 1:
            raise ConfigError(
                "transformer.cache cannot be a sequence-parallel group's default (its ranks "
                "could skip different blocks of one forward); use it with parallel 'cfg=2' "
                "or one device")
        if self.checkpoint_every_s is not None and not self.checkpoint_every_s > 0:
            raise ConfigError("checkpoint_every_s must be a positive number of seconds (or "
                              f"null: off), got {self.checkpoint_every_s}")
        if self.checkpoint_every_steps is not None and self.checkpoint_every_steps < 1:
            raise ConfigError("checkpoint_every_steps must be at least 1 (or null: off), got "
                              f"{self.checkpoint_every_steps}")
        if self.flow_shift is not None and not self.flow_shift > 0:
            raise ConfigError(f"flow_shift must be positive, got {self.flow_shift}")
        if not self.group_timeout_s > 0 or self.group_restarts < 0:
            raise ConfigError("group_timeout_s must be positive and group_restarts >= 0")
        if self.weight_storage not in WEIGHT_STORAGE:
            raise ConfigError(
                f"weight_storage must be one of {', '.join(WEIGHT_STORAGE)}, got "
                f"{self.weight_storage!r}"
            )
        if self.offload not in OFFLOAD_MODES:
            raise ConfigError(
                f"offload must be one of {', '.join(OFFLOAD_MODES)}, got {self.offload!r}"
            )
        if self.linear not in LINEAR_MODES:
            raise ConfigError(f"linear must be one of {', '.join(LINEAR_MODES)}, got "
                              f"{self.linear!r}")
        if self.offload_blocks < 1:
            raise ConfigError("offload_blocks must be at least 1")
        if self.max_vram_gb is not None and not self.max_vram_gb > 0:
            raise ConfigError(f"max_vram_gb must be positive (GiB), got {self.max_vram_gb}")
        if self.linear == "fp8" and self.weight_storage == "fp8":
            raise ConfigError(
                "linear 'fp8' already stores the DiT's linear weights in FP8; drop "
                "weight_storage 'fp8' (layerwise casting) or use one of the two"
            )
        if self.linear == "fp8" and self.offload != "none":
            raise ConfigError("linear 'fp8' cannot be combined with offload; use "
                              "weight_storage 'fp8' with offload instead")
        if self.lora_max_loaded < 1 or self.lora_max_mb < 1:
            raise ConfigError("lora_max_loaded and lora_max_mb must be at least 1")
        if self.lora_max_rank is not None and self.lora_max_rank < 1:
            raise ConfigError(f"lora_max_rank must be at least 1, got {self.lora_max_rank}")
        try:
            fused = self.fused
        except InvalidRequestError as exc:
            raise ConfigError(f"lora_fuse: {exc}") from None
        if fused and self.lora_dir is None:
            raise ConfigError("lora_fuse names adapters of lora_dir: set lora_dir to the folder "
                              "that holds them")
        try:
            parse_cache(self.cache, "cache")
        except InvalidRequestError as exc:
            raise ConfigError(str(exc)) from None

    def check_role(self, role: str) -> None:
        """Refuse options that mean nothing for ``role`` (named in the error)."""
        defaults = StageOptions()
        misplaced = [
            name for name in (*_TRANSFORMER_ONLY, *_DECODER_ONLY)
            if getattr(self, name) != getattr(defaults, name)
            and not (name in _TRANSFORMER_ONLY and role == "transformer")
            and not (name in _DECODER_ONLY and role == "decoder")
        ]
        if misplaced:
            raise ConfigError(
                f"{role}: {', '.join(misplaced)} apply to the "
                f"{'transformer' if misplaced[0] in _TRANSFORMER_ONLY else 'decoder'} stage "
                "only"
            )

    @property
    def checkpointing(self) -> bool:
        """Whether the DiT checkpoints its loops (either checkpoint option is set)."""
        return self.checkpoint_every_s is not None or self.checkpoint_every_steps is not None

    @property
    def default_cache(self) -> CacheSpec | None:
        """The parsed ``cache`` option."""
        return parse_cache(self.cache, "cache")

    @property
    def fused(self) -> tuple[LoraRef, ...]:
        """The parsed ``lora_fuse``: the adapters merged into the weights at load."""
        return parse_loras(list(self.lora_fuse))

    @property
    def layout(self) -> ParallelLayout:
        """The transformer group's layout (size 1: one device, no group)."""
        return ParallelLayout.parse(self.parallel)

    @property
    def exact(self) -> bool:
        """Whether outputs stay bit-identical to the stage without options."""
        return (self.weight_storage == "dtype" and self.linear == "dtype"
                and not self.vae_tiling and self.default_cache is None
                and self.layout.sequence == 1)
