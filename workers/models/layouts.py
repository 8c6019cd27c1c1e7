"""Model folders in the layouts users have them, detected from their contents.

Served layouts:

* ``diffusers``: ``model_index.json`` and a folder per component (or a stage's own copy of its
  component folders), read as it is.
* ``wan_original``: the original Wan2.1 checkpoint folder (``Wan2.1-T2V-14B``,
  ``Wan2.1-I2V-14B-480P`` and the step-distilled checkpoints that share its layout): a
  ``config.json`` naming ``WanModel``, the DiT as ``diffusion_pytorch_model*.safetensors``
  (sharded with an index, or one file), ``models_t5_umt5-xxl-enc-bf16.pth``,
  ``Wan2.1_VAE.pth``, the tokenizer in ``google/umt5-xxl/``; for I2V also
  ``models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth``.
* ``wan22_original``: the original Wan2.2-A14B checkpoint folder (``Wan2.2-T2V-A14B``,
  ``Wan2.2-I2V-A14B``): the two experts in ``high_noise_model/`` and ``low_noise_model/``,
  each a DiT as above (``config.json`` naming ``WanModel``, its safetensors shards), and at the
  top ``models_t5_umt5-xxl-enc-bf16.pth``, ``Wan2.1_VAE.pth`` and ``google/umt5-xxl/``; no
  CLIP (Wan2.2's I2V DiT has no image context). The boundary between the experts and the
  sample shift are not in the folder but in Wan2.2's code (``wan/configs/wan_*_A14B.py``):
  the view takes the published values (:data:`WAN22_A14B_SAMPLE`).
* ``wan22_original`` also names the original Wan2.2-TI2V-5B folder: the Wan2.1 layout (a
  ``WanModel`` config of ``model_type`` ``ti2v``) with ``Wan2.2_VAE.pth`` (the 48-channel
  VAE) instead of ``Wan2.1_VAE.pth`` and no CLIP; one folder serves both of its tasks (the
  view names ``expand_timesteps``, as diffusers' does; the sample shift is the published 5.0).
  Its VAE file is converted by diffring's own key map (:mod:`workers.models.wan22_vae`:
  diffusers' library has no converter for it).
* either of them with a single-file DiT (``dit_original_ckpt``, LightX2V's key): original,
  ComfyUI (``model.diffusion_model.`` prefix) or diffusers key names.
* either of them with another VAE (``vae_path``, LightX2V's key): a single file in the
  original Wan VAE names (``Wan2.1_VAE.pth``, ComfyUI's VAE files) or diffusers' names, for
  Wan2.1 and for Qwen-Image (whose VAE has the Wan VAE's module names), or a diffusers VAE
  folder (LightX2V's Qwen-Image meaning of the key).

A folder in another layout is served through a *view*: a small folder in diffusers' layout
(:func:`view_of`) holding every component's config, links to the files that need no
conversion (tokenizers), and for each converted component a ``diffring_source.json`` naming
the files its weights come from and the converter; the stage adapters read the view as they
read any diffusers folder, and their weight loaders convert at load
(:mod:`workers.models.convert`, through diffusers' own single-file loaders and key
converters). So every layout runs the same adapters, and gives the same pixels as the
diffusers layout of the same weights.

The view's configs are the published ones (the checkpoint's own ``config.json`` for the DiT;
Wan2.1's VAE, UMT5-XXL and open-clip ViT-H/14 for the rest), with the sizes read from the
weights' shapes (headers only: no weight is read), so that a checkpoint of other sizes of the
same architecture (the tests' tiny ones) is read right too.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from contracts.errors import ModelLoadError

SOURCE_FILE = "diffring_source.json"
"""In a view's component folder: where the weights come from, and the converter."""

WAN_T5 = "models_t5_umt5-xxl-enc-bf16.pth"
WAN_VAE = "Wan2.1_VAE.pth"
WAN_CLIP = "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"
WAN_TOKENIZER = "google/umt5-xxl"
WAN_DIT = "diffusion_pytorch_model"
WAN22_HIGH, WAN22_LOW = "high_noise_model", "low_noise_model"
WAN22_VAE = "Wan2.2_VAE.pth"
COMFY_PREFIX = "model.diffusion_model."

# Components a diffusers folder may have (a stage's copy of its own has no model index).
_DIFFUSERS_COMPONENTS = ("transformer", "vae", "text_encoder", "scheduler", "tokenizer",
                         "image_encoder", "image_processor", "processor")

LAYOUTS_SERVED = (
    "diffusers (model_index.json and a folder per component)",
    f"the original Wan2.1 layout (config.json of a WanModel, {WAN_DIT}*.safetensors, {WAN_T5},"
    f" {WAN_VAE}, {WAN_TOKENIZER}/; for I2V also {WAN_CLIP})",
    f"the original Wan2.2-A14B layout ({WAN22_HIGH}/ and {WAN22_LOW}/, each a WanModel"
    f" config.json with its {WAN_DIT}*.safetensors; {WAN_T5}, {WAN_VAE}, {WAN_TOKENIZER}/)",
    f"the original Wan2.2-TI2V-5B layout (the Wan2.1 layout with {WAN22_VAE}, no CLIP)",
    "either with a single-file DiT (dit_original_ckpt: original, ComfyUI or diffusers keys)",
    "either with another VAE (vae_path: a single file in the original Wan VAE or diffusers "
    "names, or a diffusers VAE folder)",
)

# Wan2.1's published scheduler (diffusers' Wan2.1 folders): UniPC in flow-matching mode,
# flow_shift 3.0 (480p; LightX2V's sample_shift maps to transformer.flow_shift).
WAN_SCHEDULER: dict[str, Any] = {
    "_class_name": "UniPCMultistepScheduler", "prediction_type": "flow_prediction",
    "use_flow_sigmas": True, "flow_shift": 3.0, "num_train_timesteps": 1000,
    "solver_order": 2, "solver_type": "bh2", "predict_x0": True, "lower_order_final": True,
    "final_sigmas_type": "zero", "timestep_spacing": "linspace",
}
# Wan2.2-A14B's published sample settings by the DiT's model_type (Wan2.2's
# wan/configs/wan_t2v_A14B.py and wan_i2v_A14B.py: ``boundary``, ``sample_shift``; diffusers'
# converted folders carry the same boundary_ratio): the original folder has neither.
WAN22_A14B_SAMPLE: dict[str, tuple[float, float]] = {"t2v": (0.875, 12.0), "i2v": (0.9, 5.0)}
"""model_type -> (boundary_ratio, flow_shift)."""
WAN22_5B_SHIFT = 5.0
"""TI2V-5B's published sample shift (wan/configs/wan_ti2v_5B.py)."""
# The Wan2.1 VAE's published architecture (every Wan2.1 checkpoint ships the same VAE);
# base_dim and z_dim are read from the weights.
_WAN_VAE: dict[str, Any] = {
    "_class_name": "AutoencoderKLWan", "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
    "attn_scales": [], "temperal_downsample": [False, True, True], "dropout": 0.0,
}
# open-clip's ViT-H/14 (Wan's image encoder) has 80-wide attention heads; the rest of its
# sizes are read from the weights.
CLIP_HEAD_WIDTH = 80
_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def describe_found(model_dir: Path) -> str:
    """The folder's top-level entries, for an error message (folders with a slash)."""
    try:
        entries = sorted(model_dir.iterdir())
    except OSError as exc:
        return f"(unreadable: {exc})"
    names = [e.name + ("/" if e.is_dir() else "") for e in entries if not e.name.startswith(".")]
    if not names:
        return "nothing (an empty folder)"
    more = f", ... ({len(names)} entries)" if len(names) > 12 else ""
    return ", ".join(names[:12]) + more


def detect_layout(model_dir: Path) -> str:
    """``diffusers``, ``wan_original`` or ``wan22_original``; a :class:`ModelLoadError` that
    names what was found and the layouts served, for any other folder."""
    if (model_dir / "model_index.json").is_file():
        return "diffusers"
    if (model_dir / WAN22_HIGH).is_dir() or (model_dir / WAN22_LOW).is_dir():
        return "wan22_original"  # a half one is refused naming the missing expert
    config = model_dir / "config.json"
    if config.is_file():
        try:
            data = json.loads(config.read_text())
        except (OSError, ValueError):
            data = None
        if isinstance(data, dict) and data.get("_class_name") == "WanModel":
            ti2v = data.get("model_type") == "ti2v" or (model_dir / WAN22_VAE).exists()
            return "wan22_original" if ti2v else "wan_original"
    if any((model_dir / c).is_dir() for c in _DIFFUSERS_COMPONENTS):
        return "diffusers"  # a stage's own copy of its component folders
    if not any(model_dir.iterdir()):
        return "diffusers"  # empty: the stage's check names the first component it lacks
    raise ModelLoadError(
        f"model folder {model_dir} is in no layout diffring serves: found "
        f"{describe_found(model_dir)}. Served: " + "; ".join(LAYOUTS_SERVED))


# -- reading shapes without reading weights ------------------------------------------------
def safetensors_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from safetensors headers (JSON; no torch, no weights)."""
    out: dict[str, tuple[int, ...]] = {}
    for file in files:
        try:
            with file.open("rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"unreadable safetensors file {file}: {exc}") from exc
        for name, info in header.items():
            if name != "__metadata__":
                out[name] = tuple(int(d) for d in info["shape"])
    return out


def checkpoint_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a ``.pth`` (memory-mapped: only the index is read) or
    ``.safetensors`` file."""
    if file.suffix == ".safetensors":
        return safetensors_shapes([file])
    import torch

    try:
        state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:  # torch raises many types for a foreign or broken file
        raise ModelLoadError(f"cannot read checkpoint {file}: {type(exc).__name__}: {exc}"
                             ) from exc
    if not isinstance(state, dict):
        raise ModelLoadError(f"checkpoint {file} holds no state dict")
    return {str(k): tuple(v.shape) for k, v in state.items() if hasattr(v, "shape")}


def _need(shapes: dict[str, tuple[int, ...]], name: str, file: Path) -> tuple[int, ...]:
    if name not in shapes:
        raise ModelLoadError(f"{file} has no tensor {name!r}: not the checkpoint its name "
                             "says")
    return shapes[name]


# -- the original Wan layout -----------------------------------------------------------------
def wan_dit_files(model_dir: Path) -> list[Path]:
    """The DiT's safetensors files of an original Wan folder (its index's shards, or the one
    file); a :class:`ModelLoadError` naming what is missing."""
    index = model_dir / f"{WAN_DIT}.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            raise ModelLoadError(f"unreadable {index}: {exc}") from exc
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise ModelLoadError(f"model folder {model_dir}: {len(missing)} DiT shard(s) listed "
                                 f"in {index.name} missing ({missing[0]}, ...)")
        return [model_dir / s for s in shards]
    single = model_dir / f"{WAN_DIT}.safetensors"
    if single.is_file():
        return [single]
    raise ModelLoadError(f"model folder {model_dir} is an original Wan layout but has no "
                         f"DiT ({WAN_DIT}.safetensors, or its shards with "
                         f"{WAN_DIT}.safetensors.index.json)")


def wan_dit_config(original: dict[str, Any], shapes: dict[str, tuple[int, ...]],
                   where: Path) -> dict[str, Any]:
    """diffusers' WanTransformer3DModel config of an original DiT: its ``config.json``
    (dim, num_heads, ...) and, for what that file leaves out, the weights' shapes."""
    shapes = {k.removeprefix(COMFY_PREFIX): v for k, v in shapes.items()}
    try:
        dim, heads = int(original["dim"]), int(original["num_heads"])
        cfg: dict[str, Any] = {
            "_class_name": "WanTransformer3DModel",
            "num_attention_heads": heads, "attention_head_dim": dim // heads,
            "in_channels": int(original["in_dim"]), "out_channels": int(original["out_dim"]),
            "ffn_dim": int(original["ffn_dim"]), "freq_dim": int(original["freq_dim"]),
            "num_layers": int(original["num_layers"]), "eps": float(original["eps"]),
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{where}/config.json is not a WanModel config: {exc}") from None
    cfg["patch_size"] = list(_need(shapes, "patch_embedding.weight", where)[2:])
    cfg["text_dim"] = _need(shapes, "text_embedding.0.weight", where)[1]
    cfg["cross_attn_norm"] = "blocks.0.norm3.weight" in shapes
    cfg["qk_norm"] = ("rms_norm_across_heads" if "blocks.0.self_attn.norm_q.weight" in shapes
                      else None)
    cfg["image_dim"] = shapes["img_emb.proj.0.weight"][0] if "img_emb.proj.0.weight" in shapes \
        else None
    cfg["added_kv_proj_dim"] = dim if "blocks.0.cross_attn.k_img.weight" in shapes else None
    cfg["rope_max_seq_len"] = 1024
    if "img_emb.emb_pos" in shapes:  # first-last-frame DiTs: refused by the folder check
        cfg["pos_embed_seq_len"] = shapes["img_emb.emb_pos"][1]
    return cfg


def _wan_vae_config(shapes: dict[str, tuple[int, ...]], file: Path) -> dict[str, Any]:
    # The original names, else diffusers' (a single file may carry either).
    first, post = (("encoder.conv1.weight", "conv2.weight") if "conv2.weight" in shapes
                   else ("encoder.conv_in.weight", "post_quant_conv.weight"))
    return {**_WAN_VAE, "base_dim": _need(shapes, first, file)[0],
            "z_dim": _need(shapes, post, file)[0]}


def _umt5_config(shapes: dict[str, tuple[int, ...]], file: Path) -> dict[str, Any]:
    """UMT5-XXL's encoder config (transformers), sizes from Wan's T5 weights."""
    vocab, d_model = _need(shapes, "token_embedding.weight", file)
    buckets, heads = _need(shapes, "blocks.0.pos_embedding.embedding.weight", file)
    layers = len({k.split(".")[1] for k in shapes if k.startswith("blocks.")})
    return {
        "architectures": ["UMT5EncoderModel"], "model_type": "umt5", "vocab_size": vocab,
        "d_model": d_model, "d_kv": _need(shapes, "blocks.0.attn.q.weight", file)[0] // heads,
        "d_ff": _need(shapes, "blocks.0.ffn.fc1.weight", file)[0], "num_layers": layers,
        "num_heads": heads, "relative_attention_num_buckets": buckets,
        "relative_attention_max_distance": 128, "feed_forward_proj": "gated-gelu",
        "layer_norm_epsilon": 1e-6, "dropout_rate": 0.0, "pad_token_id": 0,
        "eos_token_id": 1, "decoder_start_token_id": 0, "is_encoder_decoder": True,
    }


def _clip_configs(shapes: dict[str, tuple[int, ...]], file: Path
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(CLIPVisionModel config, CLIPImageProcessor config) of Wan's CLIP, sizes from its
    weights (the visual tower; the text tower is not used)."""
    hidden, _, patch, _ = _need(shapes, "visual.patch_embedding.weight", file)
    positions = _need(shapes, "visual.pos_embedding", file)[1]
    grid = round((positions - 1) ** 0.5)
    if grid * grid != positions - 1 or hidden % CLIP_HEAD_WIDTH:
        raise ModelLoadError(f"{file}: a vision tower of width {hidden} and {positions} "
                             "positions is not an open-clip ViT-H/14 layout")
    layers = len({k.split(".")[2] for k in shapes if k.startswith("visual.transformer.")})
    model = {
        "architectures": ["CLIPVisionModel"], "model_type": "clip_vision_model",
        "hidden_size": hidden, "num_attention_heads": hidden // CLIP_HEAD_WIDTH,
        "intermediate_size": _need(shapes, "visual.transformer.0.mlp.0.weight", file)[0],
        "num_hidden_layers": layers, "image_size": grid * patch, "patch_size": patch,
        "hidden_act": "gelu", "layer_norm_eps": 1e-5,
        "projection_dim": shapes.get("visual.head", (hidden, hidden))[1],
    }
    side = grid * patch
    processor = {
        "image_processor_type": "CLIPImageProcessor", "crop_size": {"height": side,
                                                                    "width": side},
        "size": {"shortest_edge": side}, "do_center_crop": True, "do_convert_rgb": True,
        "do_normalize": True, "do_rescale": True, "do_resize": True, "resample": 3,
        "rescale_factor": 1 / 255, "image_mean": _CLIP_MEAN, "image_std": _CLIP_STD,
    }
    return model, processor


def _write(folder: Path, name: str, data: dict[str, Any]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(data, indent=2) + "\n")


def _source(folder: Path, convert: str, files: list[Path]) -> None:
    _write(folder, SOURCE_FILE, {"convert": convert, "files": [str(f.resolve()) for f in files]})


def _vae_component(view: Path, vae: Path, own_config: Path | None, wan: bool) -> None:
    """The view's VAE from ``vae_path``: a diffusers VAE folder as it is, or a single file
    converted at load (``wan_vae``: diffusers' Wan VAE converter; Qwen-Image's VAE has the
    same module names). A file's config is the folder's own VAE config where it has one
    (its latent statistics, its class), else for Wan the published one sized from the
    file's shapes; a Qwen-Image file needs the folder's."""
    if vae.is_dir():
        if not (vae / "config.json").is_file():
            raise ModelLoadError(f"vae_path {vae} is a folder without config.json: give a "
                                 "diffusers VAE folder or a single VAE file")
        view.symlink_to(vae.resolve())
        return
    if own_config is not None and own_config.is_file():
        config = json.loads(own_config.read_text())
    elif wan:
        config = _wan_vae_config(checkpoint_shapes(vae), vae)
    else:
        raise ModelLoadError(f"vae_path {vae} needs the VAE's config: {own_config} is "
                             "missing (the file holds the weights only)")
    _write(view, "config.json", config)
    _source(view, "wan_vae", [vae])


def _require(model_dir: Path, need: list[str], layout: str) -> None:
    """Refuse a folder of ``layout`` lacking any of ``need`` (a trailing '/': a folder),
    naming each missing one."""
    missing = [n for n in need if not (model_dir / n.rstrip("/")).exists()]
    if missing:
        raise ModelLoadError(f"model folder {model_dir} is {layout} but lacks "
                             f"{', '.join(missing)}")


def _original_dit(model_dir: Path, view: Path, original: dict[str, Any],
                  dit_file: Path | None, name: str = "transformer") -> None:
    """The view's DiT component ``name``: the folder's DiT files (or ``dit_file``),
    converted at load by diffusers' Wan converter, with the config sized from their shapes."""
    dit_files = [dit_file] if dit_file is not None else wan_dit_files(model_dir)
    shapes = (checkpoint_shapes(dit_file) if dit_file is not None
              else safetensors_shapes(dit_files))
    _write(view / name, "config.json", wan_dit_config(original, shapes, model_dir))
    _source(view / name, "wan_transformer", dit_files)


def _build_wan_original(model_dir: Path, view: Path, dit_file: Path | None,
                        vae_file: Path | None = None) -> None:
    original = json.loads((model_dir / "config.json").read_text())
    need = [WAN_T5, f"{WAN_TOKENIZER}/"] + ([] if vae_file is not None else [WAN_VAE])
    i2v = original.get("model_type") == "i2v" or int(original.get("in_dim", 16)) != 16
    if i2v:
        need.append(WAN_CLIP)
    _require(model_dir, need, f"the original Wan2.1 layout ({'I2V' if i2v else 'T2V'})")
    _original_dit(model_dir, view, original, dit_file)
    _wan_shared(model_dir, view, vae_file, WAN_SCHEDULER)
    index: dict[str, Any] = {
        "_class_name": "WanImageToVideoPipeline" if i2v else "WanPipeline",
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5Tokenizer"],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLWan"],
    }
    if i2v:
        clip = model_dir / WAN_CLIP
        model, processor = _clip_configs(checkpoint_shapes(clip), clip)
        _write(view / "image_encoder", "config.json", model)
        _source(view / "image_encoder", "wan_clip", [clip])
        _write(view / "image_processor", "preprocessor_config.json", processor)
        index.update(image_encoder=["transformers", "CLIPVisionModel"],
                     image_processor=["transformers", "CLIPImageProcessor"])
    _write(view, "model_index.json", index)


def _build_wan22_5b(model_dir: Path, view: Path, dit_file: Path | None,
                    vae_file: Path | None) -> None:
    """The view of an original Wan2.2-TI2V-5B folder: its one DiT, the Wan2.2 VAE converted
    by diffring's key map, ``expand_timesteps`` and the published sample shift."""
    from .wan22_vae import wan22_vae_config

    if vae_file is not None:
        raise ModelLoadError(f"vae_path {vae_file}: model folder {model_dir} is the original "
                             f"Wan2.2-TI2V-5B layout, whose {WAN22_VAE} is read as it is; "
                             "vae_path replaces Wan2.1 and Qwen-Image VAEs only")
    original = json.loads((model_dir / "config.json").read_text())
    _require(model_dir, [WAN22_VAE, WAN_T5, f"{WAN_TOKENIZER}/"],
             "the original Wan2.2-TI2V-5B layout")
    _original_dit(model_dir, view, original, dit_file)
    vae = model_dir / WAN22_VAE
    _write(view / "vae", "config.json", wan22_vae_config(checkpoint_shapes(vae), vae))
    _source(view / "vae", "wan22_vae", [vae])
    _wan_shared(model_dir, view, None, {**WAN_SCHEDULER, "flow_shift": WAN22_5B_SHIFT},
                vae=False)
    _write(view, "model_index.json", {
        "_class_name": "WanPipeline", "boundary_ratio": None, "expand_timesteps": True,
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5Tokenizer"],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "transformer_2": [None, None], "vae": ["diffusers", "AutoencoderKLWan"]})


def _wan_shared(model_dir: Path, view: Path, vae_file: Path | None,
                scheduler: dict[str, Any], vae: bool = True) -> None:
    """What the original Wan folders share: the Wan2.1 VAE (or ``vae_file``; ``vae``
    False: the caller's), the T5 encoder, the tokenizer, the scheduler."""
    if vae:
        _vae_component(view / "vae", vae_file or model_dir / WAN_VAE, None, wan=True)
    t5 = model_dir / WAN_T5
    _write(view / "text_encoder", "config.json", _umt5_config(checkpoint_shapes(t5), t5))
    _source(view / "text_encoder", "wan_t5", [t5])
    (view / "tokenizer").symlink_to((model_dir / WAN_TOKENIZER).resolve())
    _write(view / "scheduler", "scheduler_config.json", scheduler)


def _expert_config(expert: Path) -> dict[str, Any]:
    try:
        data = json.loads((expert / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"unreadable {expert}/config.json: {exc}") from exc
    if not isinstance(data, dict) or data.get("_class_name") != "WanModel":
        raise ModelLoadError(f"{expert}/config.json does not name WanModel: not a Wan2.2 "
                             "expert of the original layout")
    return data


def _build_wan22_a14b(model_dir: Path, view: Path, dit_file: Path | None,
                      vae_file: Path | None) -> None:
    """The view of an original Wan2.2-A14B folder: ``transformer`` the high-noise expert,
    ``transformer_2`` the low-noise one, as diffusers' Wan2.2 folders name them."""
    if dit_file is not None:
        raise ModelLoadError(
            f"dit_original_ckpt {dit_file}: model folder {model_dir} is the original "
            f"Wan2.2-A14B layout, whose two experts ({WAN22_HIGH}/, {WAN22_LOW}/) one file "
            "cannot replace; give the experts in the folder")
    need = [f"{WAN22_HIGH}/config.json", f"{WAN22_LOW}/config.json", WAN_T5,
            f"{WAN_TOKENIZER}/"] + ([] if vae_file is not None else [WAN_VAE])
    _require(model_dir, need, "the original Wan2.2-A14B layout")
    configs = [_expert_config(model_dir / e) for e in (WAN22_HIGH, WAN22_LOW)]
    # As for Wan2.1: the model_type, else the input channels (36: I2V's mask and condition).
    kinds = ["i2v" if c.get("model_type") == "i2v" or int(c.get("in_dim", 16)) != 16
             else "t2v" for c in configs]
    if kinds[0] != kinds[1]:
        raise ModelLoadError(f"model folder {model_dir}: {WAN22_HIGH} is a {kinds[0]} DiT but "
                             f"{WAN22_LOW} a {kinds[1]} one")
    boundary, shift = WAN22_A14B_SAMPLE[kinds[0]]
    for name, original in zip(("transformer", "transformer_2"), configs, strict=True):
        expert = model_dir / (WAN22_HIGH if name == "transformer" else WAN22_LOW)
        _original_dit(expert, view, original, None, name)
    _wan_shared(model_dir, view, vae_file, {**WAN_SCHEDULER, "flow_shift": shift})
    i2v = kinds[0] == "i2v"
    index: dict[str, Any] = {
        "_class_name": "WanImageToVideoPipeline" if i2v else "WanPipeline",
        "boundary_ratio": boundary, "expand_timesteps": False,
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5Tokenizer"],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "transformer_2": ["diffusers", "WanTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLWan"],
    }
    if i2v:  # diffusers' Wan2.2 I2V folders name the CLIP they lack
        index.update(image_encoder=[None, None], image_processor=[None, None])
    _write(view, "model_index.json", index)


def _build_overrides(model_dir: Path, view: Path, dit_file: Path | None,
                     vae_file: Path | None) -> None:
    """A diffusers folder whose DiT comes from ``dit_file`` and / or whose VAE from
    ``vae_file``: every other entry linked."""
    replaced = {name for name, file in (("transformer", dit_file), ("vae", vae_file))
                if file is not None}
    config = model_dir / "transformer" / "config.json"
    if dit_file is not None and not config.is_file():
        raise ModelLoadError(f"dit_original_ckpt {dit_file} needs the DiT's config: "
                             f"{config} is missing")
    for entry in model_dir.iterdir():
        if entry.name not in replaced and not entry.name.startswith("."):
            (view / entry.name).symlink_to(entry.resolve())
    names = [json.loads(f.read_text()).get("_class_name", "") for f in
             (config, model_dir / "model_index.json") if f.is_file()]
    family = "wan" if any(str(n).startswith("Wan") for n in names) else "qwen"
    if dit_file is not None:
        (view / "transformer").mkdir()
        (view / "transformer" / "config.json").write_text(config.read_text())
        _source(view / "transformer", f"{family}_transformer", [dit_file])
    if vae_file is not None:
        _vae_component(view / "vae", vae_file, model_dir / "vae" / "config.json",
                       wan=family == "wan")


def view_of(model_dir: Path, layout: str, dit_file: Path | None = None,
            vae_file: Path | None = None) -> Path:
    """The diffusers-layout view of ``model_dir`` (see the module's docstring), built now
    under the temporary folder (one per folder, DiT and VAE file and process; a dead
    process's views are removed by the next build). Reads JSON and tensor headers only."""
    if dit_file is not None and not dit_file.is_file():
        raise ModelLoadError(f"dit_original_ckpt {dit_file} does not exist")
    if vae_file is not None and not vae_file.exists():
        raise ModelLoadError(f"vae_path {vae_file} does not exist")
    key = hashlib.sha1(f"{model_dir.resolve()}|{layout}|{dit_file}|{vae_file}".encode()
                       ).hexdigest()[:16]
    root = Path(tempfile.gettempdir()) / "diffring-views"
    root.mkdir(parents=True, exist_ok=True)
    for old in root.glob(f"{key}-*"):
        pid = old.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    view = root / f"{key}-{os.getpid()}"
    shutil.rmtree(view, ignore_errors=True)
    view.mkdir()
    try:
        if layout == "wan_original":
            _build_wan_original(model_dir, view, dit_file, vae_file)
        elif layout == "wan22_original" and any((model_dir / e).is_dir()
                                                for e in (WAN22_HIGH, WAN22_LOW)):
            _build_wan22_a14b(model_dir, view, dit_file, vae_file)
        elif layout == "wan22_original":  # the DiT at the top: TI2V-5B
            _build_wan22_5b(model_dir, view, dit_file, vae_file)
        else:
            _build_overrides(model_dir, view, dit_file, vae_file)
    except BaseException:
        shutil.rmtree(view, ignore_errors=True)
        raise
    return view


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def source_of(component_dir: Path) -> dict[str, Any] | None:
    """A view component's ``diffring_source.json`` (None: the folder holds its weights)."""
    file = component_dir / SOURCE_FILE
    if not file.is_file():
        return None
    data: dict[str, Any] = json.loads(file.read_text())
    return data
