"""LoRA adapter files made locally with PEFT (random weights; nothing is downloaded), for
the tests and the LoRA benchmark.

    make_adapter(transformer, out_dir / "style.safetensors", rank=4, seed=1)
    make_adapter(transformer, out_dir / "orig.safetensors", rank=4, seed=1, fmt="wan")

``fmt="diffusers"`` saves what diffusers' ``save_lora_weights`` saves (``transformer.``
keys, the adapter's LoraConfig as metadata); ``fmt="wan"`` the original Wan2.1 layout
(``diffusion_model.blocks.N.self_attn.q.lora_down.weight`` ..., an ``.alpha`` per layer)
that diffusers' ``WanLoraLoaderMixin`` converts on load. With ``alpha == rank`` both carry
the same effective weights.
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


def make_adapter(transformer: Any, path: Path, *, rank: int = 4, alpha: float | None = None,
                 seed: int = 0, targets: tuple[str, ...] = ATTENTION, scale: float = 0.2,
                 fmt: str = "diffusers") -> Path:
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
    elif fmt == "wan":
        out: dict[str, torch.Tensor] = {}
        for key, value in state.items():
            new = key
            for a, b in _WAN_NAMES:
                new = new.replace(a, b)
            out[f"diffusion_model.{new}"] = value.contiguous()
            if ".lora_down." in new:
                out[f"diffusion_model.{new.split('.lora_down.')[0]}.alpha"] = torch.tensor(alpha)
        save_file(out, str(path))
    else:
        raise ValueError(f"fmt must be 'diffusers' or 'wan', got {fmt!r}")
    return path
