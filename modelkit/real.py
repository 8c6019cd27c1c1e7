"""Real-size random-weight models of the published architectures, built locally.

    python -m modelkit.real --arch wan-1.3b|wan-14b|wan-14b-i2v|wan22-a14b|wan22-a14b-i2v|
                                   wan22-5b|wan22-5b-i2v|qwen-image|qwen-image-edit-2511
                            --out DIR [--device cuda:0] [--dtype bfloat16] [--layers N]
                            [--text-encoders stub|full] [--image-layers N]

Nothing is downloaded: the configs below are those of the published checkpoints'
``config.json`` files (Wan2.1-T2V-1.3B, Wan2.1-T2V-14B, Wan2.1-I2V-14B-480P; Wan2.2-T2V-A14B
and -I2V-A14B: two DiTs of the Wan2.1-14B shape, ``boundary_ratio`` 0.875 / 0.9, the I2V
without CLIP; Wan2.2-TI2V-5B: the 5B DiT over the Wan2.2 VAE, ``expand_timesteps``; Qwen-Image,
Qwen-Image-Edit-2511: the Qwen-Image DiT with ``zero_cond_t``, served by
QwenImageEditPlusPipeline), the weights are random (seeded), and the folder is written in
diffusers format (``save_pretrained``), so the stage adapters load it exactly like a real
checkpoint. The DiT, the VAE and Wan I2V's CLIP image encoder are full size. The text
encoders are ``--text-encoders``:

* ``stub`` (default): the real output width (what the DiT consumes) but only
  ``--text-layers`` layers and a narrow feed-forward; for runs that measure the DiT.
* ``full``: the published UMT5-XXL (5.7B) and Qwen2.5-VL-7B (8.3B, vision tower included),
  for runs that measure the encoder stage's memory and time (11 and 16 GB of weights).

``--layers`` shrinks the DiT's depth and ``--image-layers`` the CLIP encoder's, for quick
checks on a CPU. With the defaults a folder's recipe (and weights) is what it was before
these options existed.

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
    wan_dit_model,
    wan_scheduler,
)
from modelkit.tokenizers import build_qwen_tokenizer, build_t5_tokenizer

ARCHS = ("wan-1.3b", "wan-14b", "wan-14b-i2v", "wan22-a14b", "wan22-a14b-i2v", "wan22-5b",
         "wan22-5b-i2v", "qwen-image", "qwen-image-edit-2511")
PIPELINE = {"wan-1.3b": "wan_t2v", "wan-14b": "wan_t2v", "wan-14b-i2v": "wan_i2v",
            "wan22-a14b": "wan22_a14b_t2v", "wan22-a14b-i2v": "wan22_a14b_i2v",
            # TI2V-5B: one folder, served as either task.
            "wan22-5b": "wan22_5b_t2v", "wan22-5b-i2v": "wan22_5b_i2v",
            "qwen-image": "qwen_t2i", "qwen-image-edit-2511": "qwen_i2i_plus"}
# Wan2.2-A14B: boundary_ratio of the model index and the sample shift of Wan's configs.
WAN22_MOE = {"wan22-a14b": (0.875, 12.0), "wan22-a14b-i2v": (0.9, 5.0)}
# Wan2.2-TI2V-5B's VAE (vae/config.json): residual, 2x2 pixel patches, 48 latent channels.
WAN22_VAE: dict[str, Any] = {
    "base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2, "attn_scales": [], "temperal_downsample": [False, True, True],
    "is_residual": True, "in_channels": 12, "out_channels": 12, "patch_size": 2,
    "scale_factor_spatial": 16, "scale_factor_temporal": 4,
    # The published statistics are the encoder's per channel; random weights: neutral ones.
    "latents_mean": [0.0] * 48, "latents_std": [1.0] * 48,
}
TEXT_ENCODERS = ("stub", "full")
MARKER = "diffring_real.json"

# transformer/config.json of the published checkpoints (the keys diffusers reads).
WAN_DIT = {
    "wan-1.3b": {"num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30},
    "wan-14b": {"num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40},
    # Wan2.1-I2V-14B-480P: 16 noise + 4 first-frame mask + 16 condition latent channels in,
    # CLIP's 1280-wide image tokens through key/value projections of their own in every block.
    "wan-14b-i2v": {"num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40,
                    "in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 5120},
    # Wan2.2-A14B: each expert the Wan2.1-14B shape; the I2V takes the mask and condition
    # latents (36 channels) and no CLIP context.
    "wan22-a14b": {"num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40},
    "wan22-a14b-i2v": {"num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40,
                       "in_channels": 36},
    # Wan2.2-TI2V-5B: 3072 wide (24 heads of 128), 48 latent channels in and out.
    "wan22-5b": {"num_attention_heads": 24, "ffn_dim": 14336, "num_layers": 30,
                 "in_channels": 48, "out_channels": 48},
}
WAN_DIT["wan22-5b-i2v"] = WAN_DIT["wan22-5b"]
# text_encoder/config.json of the published checkpoints. Wan2.1: UMT5-XXL (google/umt5-xxl's
# encoder); its d_model is the DiT's text_dim.
UMT5_XXL = {"d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64}
UMT5_XXL_VOCAB = 256384
# Qwen-Image: Qwen2.5-VL-7B-Instruct, text model and vision tower; hidden_size is the DiT's
# joint_attention_dim.
QWEN25_VL_7B_TEXT = {
    "vocab_size": 152064,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "max_position_embeddings": 128000,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0,
                        "mrope_section": [16, 24, 24]},
}
QWEN25_VL_7B_VISION = {
    "depth": 32,
    "hidden_size": 1280,
    "intermediate_size": 3420,
    "num_heads": 16,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31],
    "out_hidden_size": 3584,
}
# Wan2.1-I2V's image_encoder/config.json: the vision tower of CLIP ViT-H/14 (LAION), whose
# penultimate hidden states (257 x 1280) are the DiT's image tokens.
CLIP_VIT_H14: dict[str, Any] = {
    "hidden_size": 1280,
    "intermediate_size": 5120,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "image_size": 224,
    "patch_size": 14,
    "projection_dim": 1024,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-5,
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
    cfg: dict[str, Any] = dict(WAN_DIT[arch])
    heads = cfg.pop("num_attention_heads")
    if layers is not None:
        cfg["num_layers"] = layers
    return wan_dit_model(heads, 128, 4096, **cfg)


def qwen_dit(layers: int | None = None, zero_cond_t: bool = False) -> Any:
    """The Qwen-Image DiT (20.4B) as published, ``layers`` deep if given; random weights in
    the current default dtype and device. ``zero_cond_t``: Qwen-Image-Edit-2511's (the same
    weights' shapes: the flag changes how the condition images' tokens are modulated)."""
    from diffusers import QwenImageTransformer2DModel

    cfg: dict[str, Any] = dict(QWEN_DIT, zero_cond_t=zero_cond_t)
    if layers is not None:
        cfg["num_layers"] = layers
    return QwenImageTransformer2DModel(**cfg)


def _umt5(tokenizer: Any, layers: int, full: bool = False) -> Any:
    from transformers import UMT5EncoderModel

    if full:  # the tiny tokenizer's ids all lie below the published vocabulary
        return UMT5EncoderModel(umt5_config(UMT5_XXL_VOCAB, **UMT5_XXL))
    return UMT5EncoderModel(umt5_config(
        round_up(len(tokenizer), 64),
        d_model=4096,  # UMT5-XXL width: the DiT's text_dim
        d_kv=64,
        d_ff=2048,  # real: 10240
        num_layers=layers,  # real: 24
        num_heads=16,  # real: 64
    ))


def _qwen_text_encoder(tokenizer: Any, layers: int, edit: bool = False,
                       full: bool = False) -> Any:
    from transformers import Qwen2_5_VLForConditionalGeneration

    if full:  # the special tokens keep the tiny tokenizer's ids (below the published vocab)
        return Qwen2_5_VLForConditionalGeneration(
            qwen_vl_config(tokenizer, text=QWEN25_VL_7B_TEXT, vision=QWEN25_VL_7B_VISION))
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


def clip_vit_h14(layers: int | None = None) -> tuple[Any, Any]:
    """Wan2.1-I2V's image encoder (CLIP ViT-H/14's vision tower, ``layers`` deep if given;
    random weights in the current default dtype and device) and its image processor, built
    here: the published settings are CLIPImageProcessor's defaults (224x224 centre crop of the
    bicubic-resized shortest edge, OpenAI CLIP mean and std). The PIL backend needs no
    torchvision and saves the same config."""
    from transformers import CLIPImageProcessorPil, CLIPVisionConfig, CLIPVisionModel

    cfg: dict[str, Any] = dict(CLIP_VIT_H14)
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    processor = CLIPImageProcessorPil(size={"shortest_edge": 224},
                                      crop_size={"height": 224, "width": 224})
    return CLIPVisionModel(CLIPVisionConfig(**cfg)), processor


def _recipe(arch: str, dtype: str, layers: int | None, text_layers: int, seed: int,
            text_encoders: str, image_layers: int | None) -> dict[str, Any]:
    """What a folder is built from (its marker): the defaults give the recipe folders had
    before ``text_encoders`` and ``image_layers`` existed, so those folders are reused."""
    import diffusers

    recipe: dict[str, Any] = {
        "arch": arch, "dtype": dtype, "layers": layers,
        "text_layers": text_layers if text_encoders == "stub" else None,
        "seed": seed, "diffusers": diffusers.__version__}
    if text_encoders != "stub":
        recipe["text_encoders"] = text_encoders
    if image_layers is not None:
        recipe["image_layers"] = image_layers
    return recipe


def build(
    arch: str,
    dest: Path,
    device: str = "cuda:0",
    dtype: str = "bfloat16",
    layers: int | None = None,
    text_layers: int = 2,
    seed: int = 0,
    text_encoders: str = "stub",
    image_layers: int | None = None,
) -> dict[str, Any]:
    """Write the model folder ``dest`` (skipped when a folder of the same recipe is there);
    returns what was built (parameter counts, seconds). ``text_encoders``: ``stub`` or
    ``full`` (the module's docstring); ``image_layers``: the CLIP encoder's depth (I2V)."""
    import torch

    if arch not in ARCHS:
        raise SystemExit(f"unknown --arch {arch!r}; choose one of {', '.join(ARCHS)}")
    if text_encoders not in TEXT_ENCODERS:
        raise SystemExit(f"unknown text encoders {text_encoders!r}; choose one of "
                         f"{', '.join(TEXT_ENCODERS)}")
    full = text_encoders == "full"
    recipe = _recipe(arch, dtype, layers, text_layers, seed, text_encoders, image_layers)
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
                from diffusers import AutoencoderKLWan, WanImageToVideoPipeline, WanPipeline

                tokenizer = build_t5_tokenizer()
                text_encoder = _umt5(tokenizer, text_layers, full)
                dit = wan_dit(arch, layers)
                extra: dict[str, Any] = {}
                if PIPELINE[arch] == "wan_i2v":
                    encoder, processor = clip_vit_h14(image_layers)
                    extra = {"image_encoder": encoder.eval(), "image_processor": processor}
                shift = 3.0
                if arch in WAN22_MOE:  # the low-noise expert: another DiT of the same shape
                    ratio, shift = WAN22_MOE[arch]
                    extra.update(transformer_2=wan_dit(arch, layers).eval(),
                                 boundary_ratio=ratio)
                elif arch.startswith("wan22-5b"):
                    shift = 5.0
                    extra["expand_timesteps"] = True
                torch.set_default_dtype(torch.float32)  # the published VAE is float32
                # diffusers' defaults are Wan2.1's VAE config (Wan2.2-A14B's too).
                vae: Any = AutoencoderKLWan(**WAN22_VAE) if arch.startswith("wan22-5b") \
                    else AutoencoderKLWan()
                i2v = PIPELINE[arch] in ("wan_i2v", "wan22_a14b_i2v")
                cls = WanImageToVideoPipeline if i2v else WanPipeline
                pipe = cls(tokenizer=tokenizer, text_encoder=text_encoder.eval(),
                           vae=vae.eval(), scheduler=wan_scheduler(shift),
                           transformer=dit.eval(), **extra)
            else:
                import diffusers

                edit = arch == "qwen-image-edit-2511"
                tokenizer = build_qwen_tokenizer()
                text_encoder = _qwen_text_encoder(tokenizer, text_layers, edit, full)
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
    if PIPELINE[arch] == "wan_i2v":
        # As the published folder names it (save_pretrained records the PIL class used here).
        patch_model_index(tmp, image_processor=["transformers", "CLIPImageProcessor"])
    info = {
        "recipe": recipe,
        "pipeline": PIPELINE[arch],
        "dit_params": sum(p.numel() for p in pipe.transformer.parameters()) + (
            sum(p.numel() for p in pipe.transformer_2.parameters())
            if getattr(pipe, "transformer_2", None) is not None else 0),
        "text_encoder_params": sum(p.numel() for p in pipe.text_encoder.parameters()),
        "vae_params": sum(p.numel() for p in pipe.vae.parameters()),
        "build_s": round(build_s, 2),
        "save_s": round(time.perf_counter() - t0 - build_s, 2),
    }
    if PIPELINE[arch] == "wan_i2v":
        info["image_encoder_params"] = sum(p.numel() for p in pipe.image_encoder.parameters())
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
    ap.add_argument("--text-encoders", choices=TEXT_ENCODERS, default="stub",
                    help="stub: real width, --text-layers deep (default); full: published")
    ap.add_argument("--text-layers", type=int, default=2, help="depth of stub text encoders")
    ap.add_argument("--image-layers", type=int,
                    help="CLIP image encoder depth, I2V (default: the published 32)")
    args = ap.parse_args(argv)
    info = build(args.arch, args.out, args.device, args.dtype, args.layers, args.text_layers,
                 text_encoders=args.text_encoders, image_layers=args.image_layers)
    print(json.dumps(info), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
