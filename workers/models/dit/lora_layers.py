"""LoRA adapters on every weight format the DiT stage serves.

PEFT puts an adapter beside a layer (``lora.Linear`` wraps the layer as ``base_layer`` and adds
``x @ A.T @ B.T * scale`` to its output); diffusers' loaders inject it. What the layer under it
is decides what else has to happen, and each case uses the libraries' own mechanism:

* FP8 linear layers (``transformer.linear: "fp8"``): torchao keeps each converted layer an
  ``nn.Linear`` whose weight is a float8 tensor subclass. PEFT's dispatcher recognises such a
  weight and wraps the layer in its ``TorchaoLoraLinear`` (peft/tuners/lora/torchao.py): the
  base matmul stays FP8, the adapter's two small matmuls run in the stage's dtype beside it.
  Nothing to do here; one thing PEFT refuses: an adapter with bias deltas (``lora_B.bias``,
  the ``diff_b`` keys of LightX2V's distill LoRAs) on an FP8 layer. Such an adapter is
  served fused (``lora_fuse``: merged before the conversion) or on another weight format.
* FP8 storage (``weight_storage: "fp8"``, diffusers' layerwise casting): each layer's weight
  is kept in float8 and upcast around its forward by a hook on that layer. PEFT creates an
  adapter in its base layer's dtype, which would put the adapter in float8 too (a lossy copy,
  and a matmul CPUs cannot run). PEFT reads a base layer's ``compute_dtype`` attribute first
  (its hook for layers that store in one dtype and compute in another, as bitsandbytes'
  4-bit layers do): :func:`prepare` sets it on every cast layer, so an adapter loaded later
  is made in the compute dtype -- what diffusers builds when layerwise casting is enabled
  after the adapter is loaded (it skips PEFT's layers), checked equal in the tests.
* Offload (``offload: "block" | "leaf"``, diffusers' group offloading): the hooks move the
  tensors they were given at setup between host and GPU (with a copy stream, from pinned host
  copies made then); an adapter loaded later would be left out of its group. diffusers'
  pipeline-level ``load_lora_weights`` re-applies group offloading after a load for this
  reason (and ``delete_adapters`` / ``unload_lora`` do on their own): :func:`regroup` is the
  same call after the worker's own loads. Re-applying keeps the pinned copies already made
  (pinning a pinned tensor returns it), so a load pins only the new adapter's weights.

The order of the hooks: FP8 storage is applied before offload (workers/models/memory.py), and
an adapter's layers are added inside both: the cast hook stays on the base layer PEFT wraps,
the offload hook's groups are rebuilt around the wrapped layers.
"""

from __future__ import annotations

from typing import Any

_CAST_HOOK = "layerwise_casting"
"""The name diffusers registers its layerwise-casting hook under (hooks/layerwise_casting)."""


def _cast_hook(module: Any) -> Any:
    registry = getattr(module, "_diffusers_hook", None)
    return registry.get_hook(_CAST_HOOK) if registry is not None else None


def prepare(transformer: Any) -> int:
    """Before any adapter is loaded into ``transformer``: give every layer that layerwise
    casting stores in another dtype its ``compute_dtype`` (what PEFT makes adapters in).
    Returns how many layers got one (0: no FP8 storage)."""
    count = 0
    for module in transformer.modules():
        hook = _cast_hook(module)
        if hook is not None:
            module.compute_dtype = hook.compute_dtype
            count += 1
    return count


def offloaded(transformer: Any) -> bool:
    """Whether group offloading is applied to ``transformer``."""
    from diffusers.hooks.group_offloading import _is_group_offload_enabled

    return bool(_is_group_offload_enabled(transformer))


def regroup(transformer: Any) -> None:
    """After adapter layers were added to an offloaded ``transformer``: rebuild the offload
    groups so that they move the new layers too (diffusers' own re-application, as its
    pipelines' ``load_lora_weights`` does). No-op without offload."""
    if offloaded(transformer):
        from diffusers.hooks.group_offloading import (
            _maybe_remove_and_reapply_group_offloading,
        )

        _maybe_remove_and_reapply_group_offloading(transformer)


def adapter_bytes(transformer: Any, adapter_name: str) -> int:
    """Bytes of one loaded adapter's weights."""
    return sum(p.numel() * p.element_size() for n, p in transformer.named_parameters()
               if ".lora_" in n and n.endswith(f".{adapter_name}.weight"))
