"""A DiT stage spread over the ranks of a transformer group (:mod:`contracts.parallel`).

Each rank runs the same denoising loop on its own device with the same inputs and the same
seed; the ranks differ only inside a step:

* **CFG-parallel** (``cfg=2``): the ranks at cfg index 0 run the conditional forward, those at
  index 1 the unconditional one; :class:`CfgSplit` all-gathers the two predictions over the
  cfg dimension, so every rank combines the same pair with the loop's own arithmetic and all
  ranks step their schedulers to the same latents. A prediction is the batch-1 forward the
  single-device loop runs, so a CFG-2 group's output equals one device's bit for bit.
  diffusers 0.42.1 has no CFG parallelism (its ``_modeling_parallel`` lists "CFG/Data
  Parallel" as to do), hence this class.
* **Sequence-parallel** (``ulysses``, ``ring``): diffusers' own context parallelism, applied
  by :func:`attach_group` with ``ModelMixin.enable_parallelism`` and the model's ``_cp_plan``
  (WanTransformer3DModel, QwenImageTransformer2DModel): the tokens are split after the patch
  embedding, attention runs as Ulysses all-to-all or ring attention, and the output is
  gathered at ``proj_out``, so every rank of a forward ends with the whole prediction.

Both combine: the group's mesh is (cfg, ring, ulysses) and each cfg index has its own
sequence-parallel sub-mesh. What diffusers lacks and this module adds, each with its reason
beside it: the CFG split, the choice between diffusers' even split and its "anything" split
per forward (:func:`_choose_split`), and a CPU group's device count (:func:`_cpu_as_device`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from contracts.errors import InvalidRequestError, ModelLoadError
from contracts.parallel import ParallelLayout, head_refusal

log = logging.getLogger("diffring.group")

__all__ = ["CfgSplit", "GroupMesh", "attach_group"]

MESH_DIMS = ("cfg", "ring", "ulysses")
# Backends whose diffusers attention returns the log-sum-exp that ring attention merges by.
_RING_BACKENDS = ("sdpa_cudnn", "sdpa_flash", "flash_attn", "sage_attn")


@dataclass(frozen=True)
class GroupMesh:
    """This rank's place in its group: the layout and the (cfg, ring, ulysses) device mesh
    over the default process group (which :mod:`workers.group.dist` sets up)."""

    layout: ParallelLayout
    rank: int
    mesh: Any
    """torch DeviceMesh of shape (cfg, ring, ulysses)."""

    @classmethod
    def build(cls, layout: ParallelLayout, device_type: str) -> GroupMesh:
        """The mesh of the whole (already initialised) default group. Every rank calls this
        at the same point: creating the sub-groups is collective. The sequence sub-mesh is
        flattened here too (diffusers flattens it again in ``enable_parallelism``, which then
        finds it made), so that loading the model, whose duration differs from rank to rank,
        involves no collective."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if dist.get_world_size() != layout.size:
            raise ModelLoadError(f"parallel {layout} needs {layout.size} ranks, the process "
                                 f"group has {dist.get_world_size()}")
        mesh = init_device_mesh(device_type, (layout.cfg, layout.ring, layout.ulysses),
                                mesh_dim_names=MESH_DIMS)
        mesh["ring", "ulysses"]._flatten()
        return cls(layout, dist.get_rank(), mesh)

    @property
    def cfg_index(self) -> int:
        return self.layout.coords(self.rank)[0]

    @property
    def sequence_mesh(self) -> Any:
        return self.mesh["ring", "ulysses"]


class CfgSplit:
    """Both guidance predictions of a step from the two halves of a CFG-2 group."""

    def __init__(self, group: GroupMesh) -> None:
        self.index = group.cfg_index
        self.group = group.mesh["cfg"].get_group()

    def both(self, forward: Callable[..., torch.Tensor], cond: Sequence[Any],
             uncond: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward(*cond)`` and ``forward(*uncond)``: this rank runs its own branch and
        receives the other's (all-gather over the cfg dimension, cfg index 0 = cond)."""
        import torch.distributed as dist

        mine = forward(*(uncond if self.index else cond)).contiguous()
        both = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(both, mine, group=self.group)
        return both[0], both[1]


def attach_group(adapter: Any) -> None:
    """Spread a loaded transformer stage over its group (``adapter.group``): refuse a layout
    the DiT cannot run, by name; set ``adapter.cfg_split`` for cfg=2; enable diffusers'
    context parallelism for ulysses / ring."""
    group: GroupMesh = adapter.group
    layout = group.layout
    model = adapter.transformer
    name = f"{adapter.model_dir}/transformer ({type(model).__name__})"
    refusal = head_refusal(layout, int(model.config.num_attention_heads), name)
    if refusal is not None:
        raise ModelLoadError(refusal)
    adapter.cfg_split = CfgSplit(group) if layout.cfg == 2 else None
    if layout.sequence == 1:
        return
    _check_backend(adapter, layout, model, name)
    from diffusers.models._modeling_parallel import ContextParallelConfig

    config = ContextParallelConfig(ulysses_degree=layout.ulysses, ring_degree=layout.ring,
                                   mesh=group.sequence_mesh)
    quiet = logging.getLogger("diffusers.models.modeling_utils")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # "experimental feature" on every rank
    try:
        with _cpu_as_device(adapter.device):
            model.enable_parallelism(config=config)
    except (ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"parallel {layout} on {name}: {exc}") from exc
    finally:
        quiet.setLevel(level)
    model.register_forward_pre_hook(_choose_split(config, layout, adapter.device.type),
                                    with_kwargs=True)


def _check_backend(adapter: Any, layout: ParallelLayout, model: Any, name: str) -> None:
    from .kernels import KernelAttnProcessor

    if any(isinstance(getattr(m, "processor", None), KernelAttnProcessor)
           for m in model.modules()):
        raise ModelLoadError(
            f"parallel {layout}: attention_backend {adapter.attention!r} runs diffring's own "
            "attention processors, which diffusers' context parallelism does not drive; use "
            "sdpa, sdpa_cudnn, sdpa_flash or flash_attn (or sageattention >= 2.1.1)"
        )
    if layout.ring > 1 and adapter.attention not in _RING_BACKENDS:
        raise ModelLoadError(
            f"parallel {layout}: ring attention merges the partial attentions by their "
            f"log-sum-exp, which attention_backend {adapter.attention!r} (diffusers' native "
            f"SDPA) does not return; use one of {', '.join(_RING_BACKENDS)} (CUDA), or ulysses "
            "instead of ring"
        )
    splits_text = "encoder_hidden_states" in str(getattr(model, "_cp_plan", {}))
    if layout.ring > 1 and layout.ulysses > 1 and splits_text:
        # diffusers' unified ring x Ulysses attention has only the even split, and this DiT
        # splits the prompt too, whose length is whatever the prompt gives.
        raise ModelLoadError(
            f"parallel {layout}: {name} splits the prompt's tokens across the ranks as well, "
            "and a prompt's length is arbitrary, which only a pure ulysses or a pure ring "
            "layout splits (unevenly); use ulysses=N or ring=N with cfg"
        )


def _choose_split(config: Any, layout: ParallelLayout, device_type: str
                  ) -> Callable[..., None]:
    """A pre-forward hook that picks diffusers' split for this forward's sequences.

    diffusers splits evenly (``EquipartitionSharder``: each rank 1/N of the tokens, asserting
    that N divides them) unless ``ulysses_anything`` / ``ring_anything`` is set, which splits
    any length (``tensor_split``) at the price of a size exchange before each all-to-all.
    Qwen-Image has sequences no layout divides (a prompt's tokens; 83 x 83 image tokens at
    1328x1328), Wan mostly has even ones: so even where it divides, "anything" where it does
    not and the layout is pure Ulysses or pure ring, a request error otherwise. The flags are
    read at call time from this one config object (the split hooks and the attention
    processors hold it), and every rank of a forward sees the same shapes, so they agree.

    On CPU (gloo) the output's gather must be even too: gloo's all-gather takes equal shards
    only (NCCL's takes uneven ones), and the output is the image / video tokens."""
    n = layout.sequence

    def hook(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        lengths = _split_lengths(model, kwargs)
        if all(length % n == 0 for length in lengths):
            config.ulysses_anything = config.ring_anything = False
            return
        if device_type == "cpu" and lengths[0] % n:
            raise InvalidRequestError(
                f"parallel {layout} on CPU: {lengths[0]} image/video tokens do not divide by "
                f"{n}, and gloo gathers equal shards only (a CUDA group gathers uneven ones); "
                f"choose a size whose token count divides by {n}"
            )
        if min(lengths) < n or (layout.ring > 1 and layout.ulysses > 1):
            raise InvalidRequestError(
                f"parallel {layout}: this request's token counts {lengths} cannot be split "
                f"over {n} ranks{' evenly' if min(lengths) >= n else ''}; choose a size "
                f"whose token count divides by {n}, or a worker without sequence parallelism"
            )
        config.ulysses_anything = layout.ring == 1
        config.ring_anything = layout.ulysses == 1

    return hook


def _split_lengths(model: Any, kwargs: dict[str, Any]) -> list[int]:
    """The lengths the model's ``_cp_plan`` splits: the image/video tokens (Wan: frames x
    rows x columns after the patch embedding), and Qwen-Image's prompt tokens."""
    hidden = kwargs["hidden_states"]
    if hidden.ndim == 5:
        pt, ph, pw = model.config.patch_size
        lengths = [hidden.shape[2] // pt * (hidden.shape[3] // ph) * (hidden.shape[4] // pw)]
    else:
        lengths = [hidden.shape[1]]
    text = kwargs.get("encoder_hidden_states")
    if text is not None and "encoder_hidden_states" in str(model._cp_plan):
        lengths.append(text.shape[1])
    return lengths


@contextlib.contextmanager
def _cpu_as_device(device: torch.device) -> Iterator[None]:
    """diffusers 0.42.1 (``ModelMixin._resolve_parallel_config``) records each rank's device
    as ``torch.device(accelerator, rank % torch.accelerator.device_count())``; on a machine
    without an accelerator that count is 0, a ZeroDivisionError, although the device is only
    recorded (the mesh passed in decides where the collectives run, and nothing reads it).
    For a CPU group (the tests, a layout tried without GPUs) the CPU counts as one device
    while ``enable_parallelism`` runs; a CUDA group goes through untouched."""
    if device.type != "cpu":
        yield
        return
    real = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = real
