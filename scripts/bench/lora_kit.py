"""LoRA adapter files made locally with PEFT (random weights; nothing is downloaded), for
the tests and the LoRA benchmark.

    make_adapter(transformer, out_dir / "style.safetensors", rank=4, seed=1)
    make_adapter(transformer, out_dir / "orig.safetensors", rank=4, seed=1, fmt="wan")

``fmt="diffusers"`` saves what diffusers' ``save_lora_weights`` saves (``transformer.``
keys, the adapter's LoraConfig as metadata); ``fmt="wan"`` the original Wan2.1 layout
(``diffusion_model.blocks.N.self_attn.q.lora_down.weight`` ..., an ``.alpha`` per layer)
that diffusers' ``WanLoraLoaderMixin`` converts on load. With ``alpha == rank`` both carry
the same effective weights.

The layouts the distilled LoRAs people download are published in, as diffusers' converters
read them (``lora_conversion_utils``), written from their key naming:

* ``fmt="lightx2v"``: LightX2V's Wan2.1 step/CFG-distill LoRAs: the original Wan names with
  ``lora_down`` / ``lora_up`` and no ``.alpha`` (alpha = rank), a bias delta ``.diff_b`` per
  layer (diffusers: ``lora_B.bias``), and the norms' and modulation's ``.diff`` /
  ``.diff_b`` / ``.diff_m`` keys, which diffusers' converter drops (so do we, through it).
* ``fmt="lightning"``: Qwen-Image-Lightning's LoRAs: the DiT's own parameter names with
  ``.lora_down.weight`` / ``.lora_up.weight`` / ``.alpha`` (``prefix="diffusion_model."``:
  the variant with ComfyUI's prefix).

:func:`block_linears` gives the targets of a distill-shaped adapter (every linear layer of
every block: ``targets=block_linears(dit)``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

ATTENTION = ("to_q", "to_k", "to_v", "to_out.0")
"""Default target layers: the attention projections (of every block)."""
_WAN_NAMES = (
    ("attn1.", "self_attn."), ("attn2.", "cross_attn."), ("to_out.0", "o"), ("to_q", "q"),
    ("to_k", "k"), ("to_v", "v"), ("add_k_proj", "k_img"), ("add_v_proj", "v_img"),
    ("ffn.net.0.proj", "ffn.0"), ("ffn.net.2", "ffn.2"),
    ("lora_A", "lora_down"), ("lora_B", "lora_up"),
)


def block_linears(transformer: Any) -> tuple[str, ...]:
    """The names (inside a block) of every linear layer of the DiT's repeated blocks: the
    targets of a distill-shaped adapter (LightX2V's and Lightning's cover them all)."""
    import torch

    blocks = set(getattr(transformer, "_repeated_blocks", ()) or ())
    names: set[str] = set()
    for block in transformer.modules():
        if type(block).__name__ in blocks:
            names.update(n for n, m in block.named_modules() if isinstance(m, torch.nn.Linear))
    return tuple(sorted(names))


def make_adapter(transformer: Any, path: Path, *, rank: int = 4, alpha: float | None = None,
                 seed: int = 0, targets: tuple[str, ...] = ATTENTION, scale: float = 0.2,
                 fmt: str = "diffusers", prefix: str = "") -> Path:
    """Add a random LoRA to ``transformer`` (a diffusers DiT), save it to ``path`` and remove
    it again (the model is left as it was). ``scale`` multiplies the up weights: random
    LoRAs at full size would swamp a tiny model."""
    import torch
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    alpha = float(rank if alpha is None else alpha)
    config = LoraConfig(r=rank, lora_alpha=alpha,  # type: ignore[arg-type]  # a float works
                        target_modules=list(targets),
                        init_lora_weights=False)
    torch.manual_seed(seed)
    name = f"make_{seed}"
    transformer.add_adapter(config, adapter_name=name)
    try:
        state = {k: v.detach().to("cpu", torch.float32).clone() for k, v in
                 get_peft_model_state_dict(transformer, adapter_name=name).items()}
    finally:
        transformer.delete_adapters(name)
    state = {k: v * scale if "lora_B" in k else v for k, v in state.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "diffusers":
        from diffusers.loaders import lora_pipeline

        wan = type(transformer).__name__.startswith("Wan")
        loader = lora_pipeline.WanLoraLoaderMixin if wan else \
            lora_pipeline.QwenImageLoraLoaderMixin
        loader.save_lora_weights(str(path.parent), transformer_lora_layers=state,
                                 weight_name=path.name,
                                 transformer_lora_adapter_metadata=config.to_dict())
    elif fmt in ("wan", "lightx2v"):
        out: dict[str, torch.Tensor] = {}
        gen = torch.Generator().manual_seed(seed + 1)
        for key, value in state.items():
            new = key
            for a, b in _WAN_NAMES:
                new = new.replace(a, b)
            out[f"diffusion_model.{new}"] = value.contiguous()
            layer = new.split(".lora_down.")[0] if ".lora_down." in new else None
            if layer is not None and fmt == "wan":
                out[f"diffusion_model.{layer}.alpha"] = torch.tensor(alpha)
            elif layer is not None:  # LightX2V: alpha = rank (none written), bias deltas
                rows = state[key.replace("lora_A", "lora_B")].shape[0]
                out[f"diffusion_model.{layer}.diff_b"] = scale * 0.1 * torch.randn(
                    rows, generator=gen)
        if fmt == "lightx2v":
            _lightx2v_extras(transformer, out, gen)
        save_file(out, str(path))
    elif fmt == "lightning":
        out = {}
        for key, value in state.items():
            new = key.replace("lora_A", "lora_down").replace("lora_B", "lora_up")
            out[f"{prefix}{new}"] = value.contiguous()
            if ".lora_down." in new:
                out[f"{prefix}{new.split('.lora_down.')[0]}.alpha"] = torch.tensor(alpha)
        save_file(out, str(path))
    else:
        raise ValueError(f"fmt must be 'diffusers', 'wan', 'lightx2v' or 'lightning', got "
                         f"{fmt!r}")
    return path


def _lightx2v_extras(transformer: Any, out: dict[str, Any], gen: Any) -> None:
    """The keys of LightX2V's distill LoRAs that diffusers' Wan converter reads and drops:
    per block the norm's weight and bias deltas (``norm3.diff`` / ``.diff_b``) and the
    modulation table's (``diff_m``)."""
    import torch

    for i, block in enumerate(transformer.blocks):
        dim = block.scale_shift_table.shape[-1]
        out[f"diffusion_model.blocks.{i}.norm3.diff"] = torch.zeros(dim)
        out[f"diffusion_model.blocks.{i}.norm3.diff_b"] = torch.zeros(dim)
        out[f"diffusion_model.blocks.{i}.diff_m"] = 0.01 * torch.randn(
            tuple(block.scale_shift_table.shape), generator=gen)


def distill_shaped(arch: str, path: Path, *, rank: int = 64, seed: int = 0,
                   scale: float = 0.02, dtype: str = "bfloat16") -> Path:
    """A distill-shaped adapter for a published architecture (``modelkit.real``'s ``--arch``):
    rank ``rank`` over every linear layer of every block, as LightX2V's and Lightning's
    distill LoRAs are, random weights, in diffusers' format. The DiT is built on the meta
    device (shapes only: no weights are made or read), so this takes seconds for the 14B."""
    import torch

    from modelkit.real import qwen_dit, wan_dit

    if arch.endswith("-i2v"):
        raise SystemExit("build the T2V adapter (--arch wan-14b): diffusers widens it for the "
                         "I2V DiT on load, as it does LightX2V's")
    with torch.device("meta"):
        dit = wan_dit(arch) if arch.startswith("wan") else qwen_dit()
    torch_dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(seed)
    targets = block_linears(dit)
    state: dict[str, Any] = {}
    for name, module in dit.named_modules():
        if isinstance(module, torch.nn.Linear) and name.split(".")[0] in (
                "blocks", "transformer_blocks"):
            a = torch.randn(rank, module.in_features, generator=gen) / module.in_features ** 0.5
            b = scale * torch.randn(module.out_features, rank, generator=gen) / rank ** 0.5
            state[f"{name}.lora_A.weight"] = a.to(torch_dtype)
            state[f"{name}.lora_B.weight"] = b.to(torch_dtype)
    from diffusers.loaders import lora_pipeline

    loader = (lora_pipeline.WanLoraLoaderMixin if arch.startswith("wan")
              else lora_pipeline.QwenImageLoraLoaderMixin)
    path.parent.mkdir(parents=True, exist_ok=True)
    loader.save_lora_weights(str(path.parent), transformer_lora_layers=state,
                             weight_name=path.name, transformer_lora_adapter_metadata={
                                 "r": rank, "lora_alpha": rank, "target_modules": list(targets)})
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m scripts.bench.lora_kit --arch wan-14b --rank 64 --out DIR/distill.safetensors``:
    the benchmarks' distill-shaped adapter (:func:`distill_shaped`)."""
    import argparse

    from modelkit.real import ARCHS

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--arch", choices=ARCHS, required=True)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dry-run", action="store_true", help="check the arguments, write nothing")
    args = ap.parse_args(argv)
    if args.dry_run:
        print(f"adapter: {args.arch} rank {args.rank} over every block's linear layers -> "
              f"{args.out}")
        return 0
    path = distill_shaped(args.arch, args.out, rank=args.rank, seed=args.seed)
    print(f"wrote {path} ({path.stat().st_size / 2**20:.0f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
