"""Real-size random-weight models of the published architectures, built locally.

    python -m modelkit.real --arch wan-1.3b|wan-14b|qwen-image|qwen-image-edit-2511 --out DIR
                            [--device cuda:0] [--dtype bfloat16] [--layers N]

Nothing is downloaded: the configs below are those of the published checkpoints'
``config.json`` files (Wan2.1-T2V-1.3B, Wan2.1-T2V-14B, Qwen-Image, Qwen-Image-Edit-2511: the
Qwen-Image DiT with ``zero_cond_t``, served by QwenImageEditPlusPipeline), the weights are random
(seeded), and the folder is written in diffusers format (``save_pretrained``), so the stage
adapters load it exactly like a real checkpoint. The DiT and the VAE are full size; the text
encoders have the real output width (what the DiT consumes) but only ``--text-layers``
layers and a narrow feed-forward (they are not what is measured here, and their real weights
would be 11-16 GB). ``--layers`` shrinks the DiT's depth for quick checks on a CPU.

Used by ``scripts/bench/bench_serving.py --arch``, ``scripts/bench/bench_gpu.py`` and
``scripts/bench/gpu_smoke.py --real``. The tokenizers and schedulers are the tiny models'
(:mod:`modelkit.tokenizers`, :mod:`modelkit.components`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from modelkit.components import (
    patch_model_index,
    qwen_scheduler,
    qwen_vl_config,
    qwen_vl_image_processor_real,
    round_up,
    save_edit_processor,
    umt5_config,
    wan_scheduler,
)
from modelkit.tokenizers import build_qwen_tokenizer, build_t5_tokenizer

ARCHS = ("wan-1.3b", "wan-14b", "qwen-image", "qwen-image-edit-2511")
PIPELINE = {"wan-1.3b": "wan_t2v", "wan-14b": "wan_t2v", "qwen-image": "qwen_t2i",
            "qwen-image-edit-2511": "qwen_i2i_plus"}
MARKER = "diffring_real.json"

# transformer/config.json of the published checkpoints (the keys diffusers reads).
WAN_DIT = {
    "wan-1.3b": {"num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30},
    "wan-14b": {"num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40},
}
QWEN_DIT = {
    "patch_size": 2,
    "in_channels": 64,
    "out_channels": 16,
    "num_layers": 60,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 3584,
    "guidance_embeds": False,
    "axes_dims_rope": (16, 56, 56),
}


def wan_dit(arch: str, layers: int | None = None) -> Any:
    """A Wan2.1 DiT of ``arch`` (``wan-1.3b`` / ``wan-14b``) as published, ``layers`` deep if
    given; random weights in the current default dtype and device."""
    from diffusers import WanTransformer3DModel

    cfg = dict(WAN_DIT[arch])
    if layers is not None:
        cfg["num_layers"] = layers
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        attention_head_dim=128,
        in_channels=16,
        out_channels=16,
        text_dim=4096,
        freq_dim=256,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        image_dim=None,
        added_kv_proj_dim=None,
        rope_max_seq_len=1024,
        **cfg,
    )


def qwen_dit(layers: int | None = None, zero_cond_t: bool = False) -> Any:
    """The Qwen-Image DiT (20.4B) as published, ``layers`` deep if given; random weights in
    the current default dtype and device. ``zero_cond_t``: Qwen-Image-Edit-2511's (the same
    weights' shapes: the flag changes how the condition images' tokens are modulated)."""
    from diffusers import QwenImageTransformer2DModel

    cfg: dict[str, Any] = dict(QWEN_DIT, zero_cond_t=zero_cond_t)
    if layers is not None:
        cfg["num_layers"] = layers
    return QwenImageTransformer2DModel(**cfg)


def _umt5(tokenizer: Any, layers: int) -> Any:
    from transformers import UMT5EncoderModel

    return UMT5EncoderModel(umt5_config(
        round_up(len(tokenizer), 64),
        d_model=4096,  # UMT5-XXL width: the DiT's text_dim
        d_kv=64,
        d_ff=2048,  # real: 10240
        num_layers=layers,  # real: 24
        num_heads=16,  # real: 64
    ))


def _qwen_text_encoder(tokenizer: Any, layers: int, edit: bool = False) -> Any:
    from transformers import Qwen2_5_VLForConditionalGeneration

    config = qwen_vl_config(
        tokenizer,
        text={
            "hidden_size": 3584,  # Qwen2.5-VL-7B: the DiT's joint_attention_dim
            "intermediate_size": 4864,  # real: 18944
            "num_hidden_layers": layers,  # real: 28
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1_000_000.0,
                "mrope_section": [16, 24, 24],
            },
        },
        # Text-to-image does not use it: small. The edits' condition pictures go through it:
        # the published width, two blocks (real: 32).
        vision={
            "depth": 2 if edit else 1,
            "hidden_size": 1280 if edit else 64,
            "intermediate_size": 3420 if edit else 128,
            "num_heads": 16 if edit else 2,
            "patch_size": 14,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [1] if edit else [0],
            "out_hidden_size": 3584,
        },
    )
    return Qwen2_5_VLForConditionalGeneration(config)


def build(
    arch: str,
    dest: Path,
    device: str = "cuda:0",
    dtype: str = "bfloat16",
    layers: int | None = None,
    text_layers: int = 2,
    seed: int = 0,
) -> dict[str, Any]:
    """Write the model folder ``dest`` (skipped when a folder of the same recipe is there);
    returns what was built (parameter counts, seconds)."""
    import diffusers
    import torch

    if arch not in ARCHS:
        raise SystemExit(f"unknown --arch {arch!r}; choose one of {', '.join(ARCHS)}")
    recipe = {"arch": arch, "dtype": dtype, "layers": layers, "text_layers": text_layers,
              "seed": seed, "diffusers": diffusers.__version__}
    marker = dest / MARKER
    if marker.is_file() and json.loads(marker.read_text()).get("recipe") == recipe:
        return dict(json.loads(marker.read_text()), reused=True)
    tdtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    pipe: Any
    dit: Any
    # Built directly in the target dtype on the target device: a 20B DiT in float32 would
    # need 80 GB before the cast.
    torch.set_default_dtype(tdtype)
    try:
        with torch.no_grad(), torch.device(device):
            if arch.startswith("wan"):
                from diffusers import AutoencoderKLWan, WanPipeline

                tokenizer = build_t5_tokenizer()
                text_encoder = _umt5(tokenizer, text_layers)
                dit = wan_dit(arch, layers)
                torch.set_default_dtype(torch.float32)  # the published VAE is float32
                vae: Any = AutoencoderKLWan()  # diffusers' defaults are Wan2.1's VAE config
                pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder.eval(),
                                   vae=vae.eval(), scheduler=wan_scheduler(),
                                   transformer=dit.eval())
            else:
                import diffusers

                edit = arch == "qwen-image-edit-2511"
                tokenizer = build_qwen_tokenizer()
                text_encoder = _qwen_text_encoder(tokenizer, text_layers, edit)
                dit = qwen_dit(layers, zero_cond_t=edit)
                torch.set_default_dtype(torch.float32)
                vae = diffusers.AutoencoderKLQwenImage()  # defaults: Qwen-Image's VAE config
                # EditPlus takes the same components as Qwen-Image (its processor is saved
                # below, as its parts); the class is what its model index names.
                pipe = diffusers.QwenImagePipeline(
                    scheduler=qwen_scheduler(), vae=vae.eval(),
                    text_encoder=text_encoder.eval(), tokenizer=tokenizer,
                    transformer=dit.eval())
    finally:
        torch.set_default_dtype(previous)
    build_s = time.perf_counter() - t0
    tmp = dest.with_name(dest.name + ".tmp")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    pipe.save_pretrained(tmp, safe_serialization=True)
    if arch == "qwen-image-edit-2511":
        save_edit_processor(tmp, qwen_vl_image_processor_real(), tokenizer)
        patch_model_index(tmp, _class_name="QwenImageEditPlusPipeline")
    info = {
        "recipe": recipe,
        "pipeline": PIPELINE[arch],
        "dit_params": sum(p.numel() for p in pipe.transformer.parameters()),
        "text_encoder_params": sum(p.numel() for p in pipe.text_encoder.parameters()),
        "vae_params": sum(p.numel() for p in pipe.vae.parameters()),
        "build_s": round(build_s, 2),
        "save_s": round(time.perf_counter() - t0 - build_s, 2),
    }
    (tmp / MARKER).write_text(json.dumps(info))
    if dest.exists():
        import shutil

        shutil.rmtree(dest)
    tmp.rename(dest)
    del pipe
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--arch", choices=ARCHS, required=True)
    ap.add_argument("--out", type=Path, required=True, help="model folder to write")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--layers", type=int, help="DiT depth (default: the published one)")
    ap.add_argument("--text-layers", type=int, default=2)
    args = ap.parse_args(argv)
    info = build(args.arch, args.out, args.device, args.dtype, args.layers, args.text_layers)
    print(json.dumps(info), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
