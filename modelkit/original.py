"""Tiny checkpoints in the layouts users have, written from tiny diffusers-layout folders
through the published key mappings (nothing downloaded), for the tests that check a folder in
another layout gives the pixels of the same weights in diffusers' layout.

* :func:`build_wan_pair`: a tiny Wan2.1 folder in diffusers' layout whose VAE and CLIP keep the
  published structure the original files imply (two residual blocks per VAE level; 80-wide
  CLIP heads), and the same weights in the original Wan2.1 layout: ``config.json`` (a
  ``WanModel``), the DiT in two safetensors shards with their index,
  ``models_t5_umt5-xxl-enc-bf16.pth``, ``Wan2.1_VAE.pth``, ``google/umt5-xxl/``, and for I2V
  ``models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth`` (with a text tower and head the
  loader drops).
* :func:`build_wan22_pair`: a tiny Wan2.2 folder in diffusers' layout whose VAE keeps the
  published structure, and the same weights in the original layout: for A14B (T2V or I2V)
  ``high_noise_model/`` and ``low_noise_model/`` (each a ``config.json`` and the DiT in two
  shards with their index), ``models_t5_umt5-xxl-enc-bf16.pth``, ``Wan2.1_VAE.pth``,
  ``google/umt5-xxl/``; for TI2V-5B the Wan2.1 layout with ``Wan2.2_VAE.pth`` (in the
  inverse of diffring's Wan2.2 VAE key map, ``workers/models/wan22_vae.py``: diffusers'
  library has none; checked by the round trip and by the pixels) and no CLIP.
* :func:`write_single_file_dit`: a folder's DiT as one file, in diffusers' key names or
  ComfyUI's (``model.diffusion_model.`` before each), or for Wan in the original names.
* :func:`write_single_file_vae`: a folder's VAE (Wan2.1's or Qwen-Image's, whose parameters
  have the same names) as one file, in the original Wan VAE names (``.pth`` as
  ``Wan2.1_VAE.pth``, ``.safetensors`` as ComfyUI's VAE files) or in diffusers' names.
* :func:`build_qwen_published_vae`: a tiny Qwen-Image folder whose VAE keeps the published
  structure (two residual blocks per level, as the Wan VAE converter's mapping assumes).

The DiT and VAE names are the inverse of diffusers' converters
(``convert_wan_transformer_to_diffusers``, ``convert_wan_vae_to_diffusers``), and each file
written is checked against them: converting it back must give the diffusers state dict key
for key, tensor for tensor. The T5 and CLIP names are the inverse of diffring's tables
(``workers/models/convert.py``), which are checked by the pixels.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

COMFY_PREFIX = "model.diffusion_model."
CLIP_HIDDEN, CLIP_HEADS = 160, 2  # 80-wide heads, as open-clip's ViT-H/14


def _load_dir(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


# -- the Wan DiT: inverse of diffusers' convert_wan_transformer_to_diffusers ----------------
# diffusers' renames, applied in reverse order (the forward replaces substrings in order).
_DIT_BACK = [
    ("condition_embedder.image_embedder.norm2", "img_emb.proj.4"),
    ("condition_embedder.image_embedder.ff.net.2", "img_emb.proj.3"),
    ("condition_embedder.image_embedder.ff.net.0.proj", "img_emb.proj.1"),
    ("condition_embedder.image_embedder.norm1", "img_emb.proj.0"),
    ("norm2", "norm__swap"), ("norm3", "norm2"), ("norm__swap", "norm3"),
    ("ffn.net.2", "ffn.2"), ("ffn.net.0.proj", "ffn.0"),
    ("proj_out", "head.head"),
    (".norm_added_k.", ".norm_k_img."), (".add_v_proj.", ".v_img."), (".add_k_proj.", ".k_img."),
    (".to_v.", ".v."), (".to_k.", ".k."), (".to_q.", ".q."), (".to_out.0.", ".o."),
    ("attn1", "self_attn"), ("attn2", "cross_attn"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
]


def dit_to_original(state: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in state.items():
        if key == "scale_shift_table":
            name = "head.modulation"
        else:
            name = key.replace("scale_shift_table", "modulation")
            for new, old in _DIT_BACK:
                name = name.replace(new, old)
        out[name] = value
    return out


# -- the Wan VAE: inverse of diffusers' convert_wan_vae_to_diffusers ------------------------
_RES = {"norm1.gamma": "residual.0.gamma", "conv1": "residual.2", "norm2.gamma":
        "residual.3.gamma", "conv2": "residual.6", "conv_shortcut": "shortcut"}


def _res(rest: str) -> str:
    for new, old in _RES.items():
        if rest.startswith(new):
            return old + rest[len(new):]
    return rest


def vae_to_original(state: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in state.items():
        name = key
        for side in ("encoder", "decoder"):
            name = name.replace(f"{side}.conv_in.", f"{side}.conv1.")
            name = name.replace(f"{side}.norm_out.gamma", f"{side}.head.0.gamma")
            name = name.replace(f"{side}.conv_out.", f"{side}.head.2.")
            name = name.replace(f"{side}.mid_block.attentions.0.", f"{side}.middle.1.")
            m = re.match(rf"^{side}\.mid_block\.resnets\.(\d)\.(.+)$", name)
            if m:
                name = f"{side}.middle.{2 * int(m[1])}.{_res(m[2])}"
        name = {"quant_conv.weight": "conv1.weight", "quant_conv.bias": "conv1.bias",
                "post_quant_conv.weight": "conv2.weight",
                "post_quant_conv.bias": "conv2.bias"}.get(name, name)
        m = re.match(r"^encoder\.down_blocks\.(\d+)\.(.+)$", name)
        if m:
            name = f"encoder.downsamples.{m[1]}.{_res(m[2])}"
        m = re.match(r"^decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)$", name)
        if m:
            name = f"decoder.upsamples.{4 * int(m[1]) + int(m[2])}.{_res(m[3])}"
        m = re.match(r"^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.+)$", name)
        if m:
            name = f"decoder.upsamples.{4 * int(m[1]) + 3}.{m[2]}"
        out[name] = value
    return out


# -- the Wan2.2 VAE: inverse of diffring's map (workers/models/wan22_vae.py) --------------
def vae22_to_original(state: dict[str, Any]) -> dict[str, Any]:
    from workers.models.wan22_vae import LEVEL, RESIDUAL, SIDE, TOP

    residual = {v: k for k, v in RESIDUAL.items()}
    side_back = {v: k for k, v in SIDE.items() if "resnets" not in v}
    top_back = {v: k for k, v in TOP.items()}
    resnets: dict[str, set[str]] = {}  # "encoder.down_blocks.0" -> its resnet indices
    for key in state:
        m = re.match(r"^(.+\.(?:down|up)_blocks\.\d+)\.resnets\.(\d+)\.", key)
        if m:
            resnets.setdefault(m[1], set()).add(m[2])

    def layer(rest: str) -> str:
        return next(old + rest[len(new):] for new, old in residual.items()
                    if rest.startswith(new))

    out = {}
    for key, value in state.items():
        side, _, rest = key.partition(".")
        m = re.match(r"^(?:down|up)_blocks\.(\d+)\.(?:resnets\.(\d+)\.|(?:down|up)sampler\.)"
                     r"(.+)$", rest)
        if m and side in LEVEL:
            seq = LEVEL[side][0]
            index = m[2] if m[2] is not None else str(len(resnets[f"{side}.{rest.split('.')[0]}"
                                                                  f".{m[1]}"]))
            tail = layer(m[3]) if m[2] is not None else m[3]
            name = f"{side}.{seq}.{m[1]}.{seq}.{index}.{tail}"
        elif rest.startswith("mid_block.resnets."):
            number, _, tail = rest.removeprefix("mid_block.resnets.").partition(".")
            name = f"{side}.middle.{2 * int(number)}.{layer(tail)}"
        elif side in LEVEL:
            name = next(f"{side}.{old}{rest[len(new):]}" for new, old in side_back.items()
                        if rest.startswith(new))
        else:
            name = next(old + key[len(new):] for new, old in top_back.items()
                        if key.startswith(new))
        out[name] = value
    return out


def _check_inverse(kind: str, original: dict[str, Any], diffusers_state: dict[str, Any]) -> None:
    """Converting ``original`` back with diffusers' own converter must give the diffusers
    state dict exactly: the inverse written here is then the published mapping's."""
    import torch
    from diffusers.loaders.single_file_utils import (
        convert_wan_transformer_to_diffusers,
        convert_wan_vae_to_diffusers,
    )

    from workers.models.wan22_vae import wan22_vae_to_diffusers

    fn: Any = {"dit": convert_wan_transformer_to_diffusers, "vae": convert_wan_vae_to_diffusers,
          "vae22": wan22_vae_to_diffusers}[kind]
    back = fn(dict(original))
    if set(back) != set(diffusers_state):
        raise AssertionError(f"{kind}: keys differ after the round trip: "
                             f"{sorted(set(back) ^ set(diffusers_state))[:6]}")
    for key, value in back.items():
        if not torch.equal(value, diffusers_state[key]):
            raise AssertionError(f"{kind}: {key} differs after the round trip")


# -- T5 and CLIP: inverse of diffring's tables ------------------------------------------------
def t5_to_original(state: dict[str, Any]) -> dict[str, Any]:
    from workers.models.convert import _T5_BLOCK, _T5_TOP

    block = {v: k for k, v in _T5_BLOCK.items()}
    top = {v: k for k, v in _T5_TOP.items()}
    out = {}
    for key, value in state.items():
        m = re.match(r"^encoder\.block\.(\d+)\.(.+)$", key)
        if m:
            out[f"blocks.{m[1]}.{block[m[2]]}"] = value
        elif key in top:
            out[top[key]] = value
        # encoder.embed_tokens.weight: the same tensor as shared.weight (tied)
    return out


def clip_to_original(state: dict[str, Any]) -> dict[str, Any]:
    import torch

    from workers.models.convert import _CLIP_LAYER, _CLIP_TOP

    top = {v.removeprefix("vision_model."): k for k, v in _CLIP_TOP.items()}
    layer = {v: k for k, v in _CLIP_LAYER.items()}
    out: dict[str, Any] = {}
    qkv: dict[tuple[str, str], dict[str, Any]] = {}
    for key, value in state.items():
        key = key.removeprefix("vision_model.")
        if key == "embeddings.class_embedding":
            out["visual.cls_embedding"] = value.reshape(1, 1, -1)
        elif key == "embeddings.position_embedding.weight":
            out["visual.pos_embedding"] = value[None]
        elif key in top:
            out[top[key]] = value
        else:
            m = re.match(r"^encoder\.layers\.(\d+)\.(.+)\.(weight|bias)$", key)
            assert m, key
            if m[2] in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                qkv.setdefault((m[1], m[3]), {})[m[2][-6]] = value
            else:
                out[f"visual.transformer.{m[1]}.{layer[m[2]]}.{m[3]}"] = value
    for (index, kind), parts in qkv.items():
        out[f"visual.transformer.{index}.attn.to_qkv.{kind}"] = torch.cat(
            [parts["q"], parts["k"], parts["v"]])
    hidden = out["visual.patch_embedding.weight"].shape[0]
    # What the loader drops: the projection head, the text tower, the logit scale.
    out["visual.head"] = torch.zeros(hidden, 8)
    out["textual.token_embedding.weight"] = torch.zeros(4, 8)
    out["log_scale"] = torch.zeros(())
    return out


# -- folders ------------------------------------------------------------------------------------
def _write_original_dit(component: Path, dst: Path, model_type: str) -> None:
    """The DiT of diffusers component folder ``component`` as an original Wan DiT folder's
    files in ``dst``: ``config.json`` (a ``WanModel``), two shards and their index."""
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((component / "config.json").read_text())
    dim = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    (dst / "config.json").write_text(json.dumps({
        "_class_name": "WanModel", "_diffusers_version": "0.30.0", "dim": dim,
        "eps": cfg["eps"], "ffn_dim": cfg["ffn_dim"], "freq_dim": cfg["freq_dim"],
        "in_dim": cfg["in_channels"], "model_type": model_type,
        "num_heads": cfg["num_attention_heads"], "num_layers": cfg["num_layers"],
        "out_dim": cfg["out_channels"], "text_len": 512}, indent=2))
    dit = _load_dir(component)
    original = dit_to_original(dit)
    _check_inverse("dit", original, dit)
    names = sorted(original)
    half = len(names) // 2
    shards = {"diffusion_pytorch_model-00001-of-00002.safetensors": names[:half],
              "diffusion_pytorch_model-00002-of-00002.safetensors": names[half:]}
    for shard, keys in shards.items():
        save_file({k: original[k].contiguous() for k in keys}, str(dst / shard))
    (dst / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: s for s, ks in shards.items() for k in ks}}))


def _write_original_shared(src: Path, dst: Path) -> None:
    """``Wan2.1_VAE.pth``, the T5 ``.pth`` and the tokenizer of Wan folder ``src``."""
    import torch

    vae = _load_dir(src / "vae")
    vae_original = vae_to_original(vae)
    _check_inverse("vae", vae_original, vae)
    torch.save(vae_original, dst / "Wan2.1_VAE.pth")
    _write_original_text(src, dst)


def _write_original_text(src: Path, dst: Path) -> None:
    """The T5 ``.pth`` and the tokenizer of Wan folder ``src``."""
    import torch

    torch.save(t5_to_original(_load_dir(src / "text_encoder")),
               dst / "models_t5_umt5-xxl-enc-bf16.pth")
    shutil.copytree(src / "tokenizer", dst / "google" / "umt5-xxl")


def write_wan_original(src: Path, dst: Path) -> Path:
    """The weights of diffusers-layout Wan folder ``src`` in the original layout at ``dst``."""
    import torch

    dst.mkdir(parents=True)
    cfg = json.loads((src / "transformer" / "config.json").read_text())
    i2v = cfg.get("image_dim") is not None
    _write_original_dit(src / "transformer", dst, "i2v" if i2v else "t2v")
    _write_original_shared(src, dst)
    if i2v:
        torch.save(clip_to_original(_load_dir(src / "image_encoder")),
                   dst / "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth")
    return dst


def write_wan22_original(src: Path, dst: Path) -> Path:
    """The weights of diffusers-layout Wan2.2 folder ``src`` in the original layout at
    ``dst``. A14B: ``transformer`` (high-noise) in ``high_noise_model/``, ``transformer_2``
    in ``low_noise_model/``; no boundary (the original code holds it). TI2V-5B: the DiT at
    the top, ``Wan2.2_VAE.pth``."""
    import torch

    dst.mkdir(parents=True)
    cfg = json.loads((src / "transformer" / "config.json").read_text())
    if not (src / "transformer_2" / "config.json").is_file():  # TI2V-5B
        _write_original_dit(src / "transformer", dst, "ti2v")
        vae = _load_dir(src / "vae")
        original = vae22_to_original(vae)
        _check_inverse("vae22", original, vae)
        torch.save(original, dst / "Wan2.2_VAE.pth")
        _write_original_text(src, dst)
        return dst
    kind = "i2v" if cfg["in_channels"] != cfg["out_channels"] else "t2v"
    _write_original_dit(src / "transformer", dst / "high_noise_model", kind)
    _write_original_dit(src / "transformer_2", dst / "low_noise_model", kind)
    _write_original_shared(src, dst)
    return dst


def write_single_file_dit(src: Path, dst: Path, names: str = "comfyui") -> Path:
    """The DiT of diffusers-layout folder ``src`` as the single file ``dst``, with keys in
    diffusers' names, ComfyUI's (``comfyui``: diffusers' or, for Wan, the original names
    after ``model.diffusion_model.``) or the ``original`` ones (Wan)."""
    from safetensors.torch import save_file

    state = _load_dir(src / "transformer")
    wan = json.loads((src / "transformer" / "config.json").read_text())["_class_name"] \
        == "WanTransformer3DModel"
    if wan and names != "diffusers":
        state = dit_to_original(state)
    if names == "comfyui":
        state = {COMFY_PREFIX + k: v for k, v in state.items()}
    save_file({k: v.contiguous() for k, v in state.items()}, str(dst))
    return dst


def write_single_file_vae(src: Path, dst: Path, names: str = "original") -> Path:
    """The VAE of diffusers-layout folder ``src`` as the single file ``dst`` (``.pth`` or
    ``.safetensors``), in the ``original`` Wan VAE names (checked against diffusers' own
    converter) or in ``diffusers``' names."""
    import torch
    from safetensors.torch import save_file

    state = _load_dir(src / "vae")
    if names == "original":
        original = vae_to_original(state)
        _check_inverse("vae", original, state)
        state = original
    if dst.suffix == ".safetensors":
        save_file({k: v.contiguous() for k, v in state.items()}, str(dst))
    else:
        torch.save(state, dst)
    return dst


def build_qwen_published_vae(src: Path, dest: Path, seed: int = 0) -> Path:
    """Tiny Qwen-Image folder ``src`` (diffusers' layout) with its VAE replaced by one of
    the published structure (:func:`modelkit.components.qwen_vae` ``published``), built
    once at ``dest`` (every other component linked)."""
    from modelkit import components as c
    from modelkit.tiny import _in_place

    done = lambda: (dest / "vae" / "config.json").is_file()  # noqa: E731
    if not done():
        with _in_place(dest, dest.name, keep=done) as tmp:
            for entry in src.iterdir():
                if entry.name != "vae":
                    (tmp / entry.name).symlink_to(entry.resolve())
            c.qwen_vae(seed, published=True).save_pretrained(tmp / "vae",
                                                             safe_serialization=True)
    return dest


def build_wan22_pair(out: Path, task: str, seed: int = 0) -> tuple[Path, Path]:
    """(diffusers folder, original folder) of the same tiny Wan2.2 ``task`` weights
    (``wan22_a14b_t2v``, ``wan22_a14b_i2v`` or ``wan22_5b``), built once under ``out``."""
    from modelkit.tiny import build_published_wan22

    diffusers_dir, original_dir = out / f"{task}-diffusers", out / f"{task}-original"
    if not (diffusers_dir / "model_index.json").is_file():
        build_published_wan22(diffusers_dir, seed, task)
    _write_once(original_dir, original_dir / "models_t5_umt5-xxl-enc-bf16.pth",
                lambda tmp: write_wan22_original(diffusers_dir, tmp))
    return diffusers_dir, original_dir


def build_wan_pair(out: Path, task: str, seed: int = 0) -> tuple[Path, Path]:
    """(diffusers folder, original folder) of the same tiny Wan2.1 ``task`` weights, built
    once under ``out``."""
    from modelkit.tiny import build_published_wan

    diffusers_dir, original_dir = out / f"{task}-diffusers", out / f"{task}-original"
    if not (diffusers_dir / "model_index.json").is_file():
        build_published_wan(diffusers_dir, seed, i2v=task == "wan_i2v")
    _write_once(original_dir, original_dir / "config.json",
                lambda tmp: write_wan_original(diffusers_dir, tmp))
    return diffusers_dir, original_dir


def _write_once(folder: Path, marker: Path, write: Callable[[Path], object]) -> None:
    """``write(tmp)`` a whole folder into place at ``folder`` unless ``marker`` is there
    (one builder at a time: :func:`modelkit.tiny._in_place`)."""
    from modelkit.tiny import _in_place

    if not marker.is_file():
        with _in_place(folder, folder.name, keep=marker.is_file) as tmp:
            tmp.rmdir()  # written whole by write()
            write(tmp)
