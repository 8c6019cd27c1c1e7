"""The components of the tiny models: seeded random-weight modules of the real diffusers and
transformers classes, at sizes that run a whole request in about a second on one CPU core,
and the published schedulers of each family (which :mod:`modelkit.real` shares)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from modelkit.tokenizers import QWEN_SPECIAL_TOKENS

# ---------------------------------------------------------------------------------------------
# Model sizes. Real checkpoints are noted next to each value that differs structurally.
# ---------------------------------------------------------------------------------------------
WAN_TEXT_DIM = 32  # UMT5-XXL: 4096
WAN_CLIP_DIM = 32  # CLIP ViT-H/14: 1280
WAN_HEADS, WAN_HEAD_DIM = 2, 12  # Wan2.1-1.3B: 12 x 128; 14B: 40 x 128
QWEN_TEXT_DIM = 32  # Qwen2.5-VL-7B: 3584
QWEN_HEADS, QWEN_HEAD_DIM = 2, 16  # Qwen-Image: 24 x 128
# The condition image of Qwen-Image-Edit is resized to ~1 megapixel before the vision-language
# model sees it; the processor then rescales it to between min and max pixels (real: 3136 and
# 12845056). A small max keeps the tiny encoder fast: 56x56 pixels -> 4 image tokens.
QWEN_VL_MAX_PIXELS = 56 * 56
QWEN_VL_MIN_PIXELS = 28 * 28


# ---------------------------------------------------------------------------------------------
# Components
# ---------------------------------------------------------------------------------------------
def seeded(seed: int, salt: str) -> None:
    """Seed torch per component, so a component's weights do not depend on build order."""
    import zlib

    import torch

    torch.manual_seed((seed * 1_000_003 + zlib.crc32(salt.encode())) % (2**63))


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def wan_scheduler(flow_shift: float = 3.0) -> Any:
    from diffusers import UniPCMultistepScheduler

    # Wan2.1's published scheduler: UniPC in flow-matching mode; flow_shift 3.0 is the 480p
    # setting (5.0 for 720p). Wan2.2's sample shifts: T2V-A14B 12.0, I2V-A14B and TI2V-5B 5.0.
    return UniPCMultistepScheduler(
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=flow_shift,
        num_train_timesteps=1000,
        solver_order=2,
        solver_type="bh2",
        predict_x0=True,
        lower_order_final=True,
        final_sigmas_type="zero",
        timestep_spacing="linspace",
    )


def qwen_scheduler() -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler

    # Qwen-Image's published scheduler: resolution-dependent shift (mu from the image sequence
    # length) with a terminal shift.
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )


def wan_vae(seed: int, num_res_blocks: int = 1) -> Any:
    from diffusers import AutoencoderKLWan

    seeded(seed, "wan.vae")
    # Real: base_dim 96, num_res_blocks 2 (the original-layout test folders take the real
    # block count: diffusers' converter of the original file follows it). Same depth,
    # strides, temporal causality and latent channels.
    model: Any = AutoencoderKLWan(
        base_dim=4,
        z_dim=16,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=num_res_blocks,
        attn_scales=[],
        temperal_downsample=[False, True, True],
    )
    return model.eval()


def umt5_config(vocab_size: int, **sizes: Any) -> Any:
    """A UMT5 encoder config of the given sizes (``d_model``, ``d_kv``, ``d_ff``,
    ``num_layers``, ``num_heads``) with what every Wan text encoder shares: T5 relative
    attention buckets, gated GELU, no dropout, the T5 tokenizer's pad and eos ids."""
    from transformers import UMT5Config

    return UMT5Config(
        vocab_size=vocab_size,
        **sizes,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu",
        dropout_rate=0.0,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )


def qwen_vl_config(tokenizer: Any, text: dict[str, Any], vision: dict[str, Any]) -> Any:
    """A Qwen2.5-VL config of the given text and vision sizes whose special token ids are
    ``tokenizer``'s (so prompts, image pads and vision markers line up with it)."""
    from transformers import Qwen2_5_VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    return Qwen2_5_VLConfig(
        text_config={
            "vocab_size": round_up(len(tokenizer), 64),
            **text,
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )


def wan_text_encoder(seed: int, vocab_size: int) -> Any:
    from transformers import UMT5EncoderModel

    seeded(seed, "wan.text_encoder")
    config = umt5_config(vocab_size, d_model=WAN_TEXT_DIM, d_kv=8, d_ff=64, num_layers=2,
                         num_heads=4)
    return UMT5EncoderModel(config).eval()


def wan_transformer(seed: int, i2v: bool, image_dim: int = WAN_CLIP_DIM) -> Any:
    seeded(seed, "wan.transformer.i2v" if i2v else "wan.transformer.t2v")
    inner = WAN_HEADS * WAN_HEAD_DIM
    # I2V input: 16 noise channels + 4 first-frame mask channels + 16 condition channels.
    # Real Wan2.1 I2V checkpoints set added_kv_proj_dim to the model width (5120 for 14B).
    return wan_dit_model(WAN_HEADS, WAN_HEAD_DIM, WAN_TEXT_DIM, ffn_dim=32, num_layers=2,
                         in_channels=36 if i2v else 16, image_dim=image_dim if i2v else None,
                         added_kv_proj_dim=inner if i2v else None).eval()


def wan_dit_model(heads: int, head_dim: int, text_dim: int, **sizes: Any) -> Any:
    """A WanTransformer3DModel with what every Wan DiT shares (2x2 patches, RMS norm across
    heads, cross-attention norm, the frequency width and RoPE table) and ``sizes`` (depth,
    widths, channels, the I2V image context): the tiny models' and :mod:`modelkit.real`'s."""
    from diffusers import WanTransformer3DModel

    config: dict[str, Any] = {"in_channels": 16, "out_channels": 16, "image_dim": None,
                              "added_kv_proj_dim": None, **sizes}
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim,
        text_dim=text_dim, freq_dim=256, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024, **config)


def wan22_transformer(seed: int, salt: str, in_channels: int, out_channels: int) -> Any:
    """A tiny Wan2.2 DiT: an expert of A14B (``salt`` ``high`` / ``low``: two experts of one
    shape, other weights; I2V takes 16 noise + 4 mask + 16 condition channels, and no CLIP
    context) or TI2V-5B's (48 latent channels in and out)."""
    seeded(seed, f"wan22.transformer.{salt}")
    return wan_dit_model(WAN_HEADS, WAN_HEAD_DIM, WAN_TEXT_DIM, ffn_dim=32, num_layers=2,
                         in_channels=in_channels, out_channels=out_channels).eval()


def wan22_vae(seed: int, published: bool = False) -> Any:
    """A tiny Wan2.2 VAE (TI2V-5B's): residual, 2x2 pixel patches in front (12 channels),
    48 latent channels, 16x spatial compression. Real: base_dim 160, decoder_base_dim 256,
    num_res_blocks 2; the same structure and strides. ``published``: the real block count
    and the published latent statistics, as an original ``Wan2.2_VAE.pth`` implies (the
    original-layout test folders, modelkit/original.py)."""
    from diffusers import AutoencoderKLWan

    from workers.models.wan22_vae import WAN22_LATENTS_MEAN, WAN22_LATENTS_STD

    seeded(seed, "wan22.vae")
    model: Any = AutoencoderKLWan(
        base_dim=4,
        decoder_base_dim=8,
        z_dim=48,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=2 if published else 1,
        attn_scales=[],
        temperal_downsample=[False, True, True],
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
        scale_factor_temporal=4,
        # Statistics of the right length (the real ones are the encoder's, per channel).
        latents_mean=WAN22_LATENTS_MEAN if published else
        [round(-0.5 + i / 48, 4) for i in range(48)],
        latents_std=WAN22_LATENTS_STD if published else
        [round(0.8 + i / 96, 4) for i in range(48)],
    )
    return model.eval()


def clip_vision(seed: int, hidden: int = WAN_CLIP_DIM, heads: int = 4) -> tuple[Any, Any]:
    """Real: ViT-H/14, 1280 wide in 16 heads of 80 (the original-layout test folders keep
    that head width: Wan's CLIP file does not say its head count)."""
    from transformers import CLIPImageProcessorPil, CLIPVisionConfig, CLIPVisionModel

    seeded(seed, "wan.image_encoder")
    config = CLIPVisionConfig(
        hidden_size=hidden,
        intermediate_size=37,
        num_hidden_layers=3,  # the pipeline reads the penultimate layer
        num_attention_heads=heads,
        image_size=32,
        patch_size=8,
        hidden_act="gelu",
        projection_dim=32,
    )
    model = CLIPVisionModel(config).eval()
    # Real: 224x224 crops. The PIL backend saves the same config as the torchvision one
    # ("CLIPImageProcessor") and needs no torchvision here.
    processor = CLIPImageProcessorPil(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    )
    return model, processor


def qwen_vae(seed: int, published: bool = False) -> Any:
    from diffusers import AutoencoderKLQwenImage

    seeded(seed, "qwen.vae")
    # Real: base_dim 96, dim_mult [1, 2, 4, 4], num_res_blocks 2. Qwen-Image-Edit VAE-encodes
    # its condition image at ~1 megapixel, so this VAE is the slowest part of the tiny models
    # on CPU: a flat width of 8 channels measured fastest (narrower convolutions fall off
    # PyTorch's oneDNN path). ``published``: the real structure at a tiny width, for the
    # single-file VAE tests (diffusers' Wan VAE converter follows the real block count).
    model: Any = AutoencoderKLQwenImage(
        base_dim=4 if published else 8,
        z_dim=16,
        dim_mult=[1, 2, 4, 4] if published else [1, 1, 1, 1],
        num_res_blocks=2 if published else 1,
        attn_scales=[],
        temperal_downsample=[False, True, True],
    )
    return model.eval()


def qwen_text_encoder(seed: int, tokenizer: Any) -> Any:
    from transformers import Qwen2_5_VLForConditionalGeneration

    seeded(seed, "qwen.text_encoder")
    head_dim = QWEN_TEXT_DIM // 2
    config = qwen_vl_config(
        tokenizer,
        text={
            "hidden_size": QWEN_TEXT_DIM,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            # Multimodal RoPE: temporal/height/width sections of head_dim / 2 (real: 16/24/24).
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1_000_000.0,
                "mrope_section": [2, 3, 3],
            },
        },
        vision={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 14,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [1],
            "out_hidden_size": QWEN_TEXT_DIM,
        },
    )
    text_config: Any = config.text_config
    assert head_dim // 2 == sum(text_config.rope_parameters["mrope_section"])
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def qwen_transformer(seed: int, zero_cond_t: bool = False) -> Any:
    """The tiny Qwen-Image DiT; ``zero_cond_t`` as Qwen-Image-Edit-2511's (no weights of its
    own: the same seed gives the same weights either way)."""
    from diffusers import QwenImageTransformer2DModel

    seeded(seed, "qwen.transformer")
    model: Any = QwenImageTransformer2DModel(
        zero_cond_t=zero_cond_t,
        patch_size=2,
        in_channels=64,  # 16 latent channels x 2x2 packing
        out_channels=16,
        num_layers=2,
        attention_head_dim=QWEN_HEAD_DIM,
        num_attention_heads=QWEN_HEADS,
        joint_attention_dim=QWEN_TEXT_DIM,
        guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),  # frame/height/width split of head_dim (real: 16/56/56)
    )
    return model.eval()


def qwen_vl_image_processor() -> Any:
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        min_pixels=QWEN_VL_MIN_PIXELS,
        max_pixels=QWEN_VL_MAX_PIXELS,
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
    )




def qwen_vl_image_processor_real() -> Any:
    """Qwen2.5-VL's published image processor settings (its ``min_pixels`` / ``max_pixels``
    decide how many image tokens a condition picture gives the text encoder)."""
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056, patch_size=14,
                                    temporal_patch_size=2, merge_size=2)


def save_edit_processor(dest: Path, image_processor: Any, tokenizer: Any) -> None:
    """The ``processor`` folder of a Qwen-Image-Edit checkpoint, saved as its parts (image
    processor + tokenizer) in the published layout: transformers 5's Qwen2VLProcessor also
    wants a video processor, which needs torchvision, so loaders build it from these two."""
    image_processor.save_pretrained(dest / "processor")
    tokenizer.save_pretrained(dest / "processor")
    patch_model_index(dest, processor=["transformers", "Qwen2VLProcessor"])


def patch_model_index(dest: Path, **entries: Any) -> None:
    """Set ``entries`` in the folder's ``model_index.json`` (keys sorted, as diffusers writes)."""
    index_path = dest / "model_index.json"
    index = json.loads(index_path.read_text())
    index.update(entries)
    index_path.write_text(json.dumps(dict(sorted(index.items())), indent=2) + "\n")
