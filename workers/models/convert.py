"""Loading a component whose weights are in another layout's files (a view's
``diffring_source.json``, :mod:`workers.models.layouts`), converted at load.

The DiTs and the Wan VAE go through the key converters of diffusers' own single-file
loader (the mapping ``from_single_file`` uses for the class, from
``diffusers.loaders.single_file_utils``: ``convert_wan_transformer_to_diffusers``,
``convert_wan_vae_to_diffusers``), which read the original and ComfyUI key names (and pass
diffusers' names through); the config is the view's, and the load is strict. diffusers
registers no single-file mapping for ``AutoencoderKLQwenImage``, whose parameters have the
Wan VAE's names key for key (a test checks it): a Qwen-Image VAE file goes through the Wan
VAE's converter. What diffusers and transformers lack is written here, each mapping a table
of names (the Wan2.2 VAE's original file, which diffusers' library does not convert either,
in :mod:`workers.models.wan22_vae`):

* Wan's UMT5 text encoder (``models_t5_umt5-xxl-enc-bf16.pth``, Wan's own T5 module) into
  transformers' ``UMT5EncoderModel``: neither library converts that file;
* Wan's CLIP (``models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth``, an open-clip
  XLM-RoBERTa + ViT-H/14 pair) into transformers' ``CLIPVisionModel``: only its vision tower
  is used (diffusers' Wan I2V reads the penultimate hidden states), and neither library
  converts the open-clip file;
* ComfyUI's ``model.diffusion_model.`` prefix on a Qwen-Image DiT: diffusers' single-file
  mapping of ``QwenImageTransformer2DModel`` is the identity and keeps it.

Every converted model is loaded strictly: a key missing or left over is an error that names
it, never a randomly initialised layer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from contracts.errors import ModelLoadError

from .layouts import COMFY_PREFIX


def read_state_dict(files: list[Path]) -> dict[str, torch.Tensor]:
    """Every tensor of ``files`` (safetensors or ``.pth``, memory-mapped) in one dict."""
    out: dict[str, torch.Tensor] = {}
    for file in files:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            out.update(load_file(str(file)))
        else:
            state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
            out.update({str(k): v for k, v in state.items() if isinstance(v, torch.Tensor)})
    return out


def load_converted(cls: Any, folder: Path, source: Mapping[str, Any], dtype: torch.dtype
                   ) -> Any:
    """``cls`` (a diffusers or transformers model class) with the weights of ``source``'s
    files, converted; its config is the view's ``folder``."""
    kind = source["convert"]
    files = [Path(f) for f in source["files"]]
    try:
        state = read_state_dict(files)
        if kind in ("wan_transformer", "wan_vae", "qwen_transformer"):
            if kind == "qwen_transformer":
                state = {k.removeprefix(COMFY_PREFIX): v for k, v in state.items()}
            return _diffusers(cls, state, folder, dtype)
        if kind == "wan22_vae":  # no converter in diffusers: diffring's (wan22_vae.py)
            from .wan22_vae import wan22_vae_to_diffusers

            return _diffusers(cls, wan22_vae_to_diffusers(state), folder, dtype, mapped=True)
        convert = {"wan_t5": wan_t5_to_transformers, "wan_clip": wan_clip_to_transformers}[kind]
        return _transformers(cls, convert(state), folder, dtype)
    except ModelLoadError:
        raise
    except Exception as exc:  # a foreign or broken file: say which
        raise ModelLoadError(f"could not convert {', '.join(map(str, files))} into "
                             f"{cls.__name__} ({kind}): {type(exc).__name__}: {exc}") from exc


_MAPPING_OF = {"AutoencoderKLQwenImage": "AutoencoderKLWan"}
"""Classes read through another class's single-file mapping (the same parameter names)."""


def _diffusers(cls: Any, state: dict[str, torch.Tensor], folder: Path,
               dtype: torch.dtype, mapped: bool = False) -> Any:
    """diffusers' own key converter of ``cls`` (the mapping its ``from_single_file`` uses;
    ``mapped``: ``state`` is in diffusers' names already), then a strict load into the model
    built from the view's config: a key missing or left over is an error here, where
    ``from_single_file`` would only warn."""
    from accelerate import init_empty_weights
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    converted = dict(state)
    if not mapped:
        entry: Any = SINGLE_FILE_LOADABLE_CLASSES[_MAPPING_OF.get(cls.__name__, cls.__name__)]
        converted = entry["checkpoint_mapping_fn"](checkpoint=converted)
    # The dtypes diffusers' from_pretrained gives: modules the class keeps in float32 (Wan's
    # time embedder, norms, modulation) stay float32, every other float tensor takes
    # ``dtype``; buffers the model makes itself (RoPE tables) are not cast.
    keep = cls._keep_in_fp32_modules or []
    converted = {k: v.to(torch.float32 if any(m in k.split(".") for m in keep) else dtype)
                 if v.is_floating_point() else v for k, v in converted.items()}
    with init_empty_weights():
        model = cls.from_config(cls.load_config(str(folder)))
    result = model.load_state_dict(converted, strict=False, assign=True)
    if result.missing_keys or result.unexpected_keys:
        raise ModelLoadError(
            f"converted weights do not fit {cls.__name__}: missing {result.missing_keys[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}")
    return model.eval()


def _transformers(cls: Any, state: dict[str, torch.Tensor], folder: Path,
                  dtype: torch.dtype) -> Any:
    config = cls.config_class.from_pretrained(str(folder))
    model, info = cls.from_pretrained(None, config=config, state_dict=state, dtype=dtype,
                                      output_loading_info=True)
    problems = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys",
                                                         "mismatched_keys") and v}
    if problems:
        raise ModelLoadError(f"converted weights do not fit {cls.__name__}: {problems}")
    return model


# -- Wan's T5 encoder -> transformers' UMT5EncoderModel -------------------------------------
# Wan's T5 block: norm1, attn (q, k, v, o), its own relative position bias (UMT5: one per
# layer), norm2, a gated-GELU feed-forward (gate = GELU branch, fc1 = linear branch, fc2 = out).
_T5_BLOCK = {
    "norm1.weight": "layer.0.layer_norm.weight",
    "attn.q.weight": "layer.0.SelfAttention.q.weight",
    "attn.k.weight": "layer.0.SelfAttention.k.weight",
    "attn.v.weight": "layer.0.SelfAttention.v.weight",
    "attn.o.weight": "layer.0.SelfAttention.o.weight",
    "pos_embedding.embedding.weight": "layer.0.SelfAttention.relative_attention_bias.weight",
    "norm2.weight": "layer.1.layer_norm.weight",
    "ffn.gate.0.weight": "layer.1.DenseReluDense.wi_0.weight",
    "ffn.fc1.weight": "layer.1.DenseReluDense.wi_1.weight",
    "ffn.fc2.weight": "layer.1.DenseReluDense.wo.weight",
}
_T5_TOP = {"token_embedding.weight": "shared.weight",
           "norm.weight": "encoder.final_layer_norm.weight"}
_BLOCK_KEY = re.compile(r"^blocks\.(\d+)\.(.+)$")


def wan_t5_to_transformers(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        m = _BLOCK_KEY.match(key)
        if m and m.group(2) in _T5_BLOCK:
            out[f"encoder.block.{m.group(1)}.{_T5_BLOCK[m.group(2)]}"] = value
        elif key in _T5_TOP:
            out[_T5_TOP[key]] = value
        else:
            raise ModelLoadError(f"unexpected tensor {key!r} in Wan's T5 encoder checkpoint")
    return out


# -- Wan's CLIP (open-clip XLM-RoBERTa ViT-H/14) -> transformers' CLIPVisionModel ----------
_CLIP_LAYER = {
    "norm1": "layer_norm1", "norm2": "layer_norm2", "attn.proj": "self_attn.out_proj",
    "mlp.0": "mlp.fc1", "mlp.2": "mlp.fc2",
}
_CLIP_TOP = {
    "visual.patch_embedding.weight": "vision_model.embeddings.patch_embedding.weight",
    "visual.pre_norm.weight": "vision_model.pre_layrnorm.weight",
    "visual.pre_norm.bias": "vision_model.pre_layrnorm.bias",
    "visual.post_norm.weight": "vision_model.post_layernorm.weight",
    "visual.post_norm.bias": "vision_model.post_layernorm.bias",
}
_CLIP_KEY = re.compile(r"^visual\.transformer\.(\d+)\.(.+)\.(weight|bias)$")


def wan_clip_to_transformers(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if not key.startswith("visual.") or key == "visual.head":
            continue  # the text tower, the projection head and the logit scale: unused
        m = _CLIP_KEY.match(key)
        if key == "visual.cls_embedding":  # (1, 1, D) -> (D,)
            out["vision_model.embeddings.class_embedding"] = value.reshape(-1)
        elif key == "visual.pos_embedding":  # (1, N, D) -> (N, D)
            out["vision_model.embeddings.position_embedding.weight"] = value[0]
        elif key in _CLIP_TOP:
            out[_CLIP_TOP[key]] = value
        elif m and m.group(2) == "attn.to_qkv":  # one (3D, D) projection -> q, k, v
            layer = f"vision_model.encoder.layers.{m.group(1)}.self_attn"
            for name, part in zip(("q_proj", "k_proj", "v_proj"), value.chunk(3, dim=0),
                                  strict=True):
                out[f"{layer}.{name}.{m.group(3)}"] = part
        elif m and m.group(2) in _CLIP_LAYER:
            out[f"vision_model.encoder.layers.{m.group(1)}.{_CLIP_LAYER[m.group(2)]}."
                f"{m.group(3)}"] = value
        else:
            raise ModelLoadError(f"unexpected tensor {key!r} in Wan's CLIP checkpoint")
    return out
