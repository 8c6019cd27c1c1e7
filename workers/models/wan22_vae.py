"""The Wan2.2 VAE's original file (``Wan2.2_VAE.pth``, TI2V-5B's 48-channel VAE) read into
diffusers' ``AutoencoderKLWan`` (``is_residual``): its published config and its key names.

Why hand-written: diffusers' single-file loader has no converter for this file (its
``convert_wan_vae_to_diffusers`` knows the Wan2.1 VAE only; the Wan2.2 mapping lives in a
conversion script of diffusers' repository, not in the library). The names below are read
from the two module trees (Wan2.2's ``wan/modules/vae2_2.py``, diffusers'
``autoencoder_kl_wan.py``):

* the original ``Encoder3d.downsamples.{i}`` is a ``Down_ResidualBlock`` whose own
  ``downsamples`` sequence holds the residual blocks, then (except in the last level) a
  ``Resample``; diffusers splits that sequence into ``down_blocks.{i}.resnets.{j}`` and
  ``down_blocks.{i}.downsampler``. The decoder likewise (``upsamples.{i}.upsamples.{j}`` into
  ``up_blocks.{i}.resnets.{j}`` and ``up_blocks.{i}.upsampler``). The average shortcuts
  (``AvgDown3D``, ``DupUp3D``) have no parameters in either;
* a residual block's ``residual`` sequence (norm, SiLU, conv, norm, SiLU, dropout, conv) and
  ``shortcut``, the middle blocks, the heads and the two 1x1 convolutions around the latent
  are named as in the Wan2.1 VAE.

A sub-module is told apart by what it holds (a residual block has ``residual`` or
``shortcut``, a resampler ``resample`` or ``time_conv``), so any number of residual blocks
per level is read. Every key of the file must be one of these: another is an error naming it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from contracts.errors import ModelLoadError

# Published per-channel latent statistics of the Wan2.2 VAE (Wan2.2's wan/modules/vae2_2.py,
# ``Wan2_2_VAE``; diffusers' Wan2.2-TI2V-5B folder carries the same in vae/config.json).
WAN22_LATENTS_MEAN = [
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542,
    0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109,
    0.2665, -0.2108, -0.2158, 0.2502, -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899,
    -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
    0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
]
WAN22_LATENTS_STD = [
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894,
    1.0901, 0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146,
    0.8986, 0.5659, 0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709,
    0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537,
    0.5444, 0.4089, 0.7468, 0.7744,
]
assert len(WAN22_LATENTS_MEAN) == len(WAN22_LATENTS_STD) == 48

# The published architecture (Wan2.2's ``Wan2_2_VAE``: dim_mult, temporal downsampling, 2x2
# pixel patches into 12 channels, 16x spatial and 4x temporal compression); base_dim,
# decoder_base_dim, z_dim and num_res_blocks are read from the weights.
_WAN22_VAE: dict[str, Any] = {
    "_class_name": "AutoencoderKLWan", "dim_mult": [1, 2, 4, 4], "attn_scales": [],
    "temperal_downsample": [False, True, True], "dropout": 0.0, "is_residual": True,
    "in_channels": 12, "out_channels": 12, "patch_size": 2, "scale_factor_spatial": 16,
    "scale_factor_temporal": 4, "latents_mean": WAN22_LATENTS_MEAN,
    "latents_std": WAN22_LATENTS_STD,
}

# A residual block's layers: the original ``residual`` sequence index -> diffusers' name.
RESIDUAL = {"residual.0.": "norm1.", "residual.2.": "conv1.", "residual.3.": "norm2.",
            "residual.6.": "conv2.", "shortcut.": "conv_shortcut."}
TOP = {"conv1.": "quant_conv.", "conv2.": "post_quant_conv."}
"""The 1x1 convolutions before and after the latent."""
SIDE = {"conv1.": "conv_in.", "head.0.": "norm_out.", "head.2.": "conv_out.",
        "middle.0.": "mid_block.resnets.0.", "middle.1.": "mid_block.attentions.0.",
        "middle.2.": "mid_block.resnets.1."}
"""Within ``encoder.`` / ``decoder.``: the input convolution, the head, the middle blocks."""
LEVEL = {"encoder": ("downsamples", "down_blocks", "downsampler"),
         "decoder": ("upsamples", "up_blocks", "upsampler")}
"""Per side: (original name of a level and of its inner sequence, diffusers' level, its
resampler)."""
_LEVEL_KEY = re.compile(r"^(encoder|decoder)\.(?:downsamples|upsamples)\.(\d+)\."
                        r"(?:downsamples|upsamples)\.(\d+)\.(.+)$")


def _residual(rest: str, key: str) -> str:
    for old, new in RESIDUAL.items():
        if rest.startswith(old):
            return new + rest[len(old):]
    raise ModelLoadError(f"unexpected tensor {key!r} in the Wan2.2 VAE checkpoint")


def wan22_vae_to_diffusers(state: Mapping[str, Any]) -> dict[str, Any]:
    """The original Wan2.2 VAE's state dict in diffusers' ``AutoencoderKLWan`` names."""
    return {_name(key): value for key, value in state.items()}


def _name(key: str) -> str:
    m = _LEVEL_KEY.match(key)
    if m:
        side, level, index, rest = m[1], m[2], m[3], m[4]
        _, blocks, sampler = LEVEL[side]
        if rest.startswith(("resample.", "time_conv.")):
            return f"{side}.{blocks}.{level}.{sampler}.{rest}"
        return f"{side}.{blocks}.{level}.resnets.{index}.{_residual(rest, key)}"
    for old, new in TOP.items():
        if key.startswith(old):
            return new + key[len(old):]
    side, _, rest = key.partition(".")
    if side in LEVEL:
        for old, new in SIDE.items():
            if rest.startswith(old):
                rest = new + rest[len(old):]
                if new.startswith("mid_block.resnets."):
                    head, _, tail = rest.partition("resnets.")
                    number, _, layer = tail.partition(".")
                    rest = f"{head}resnets.{number}.{_residual(layer, key)}"
                return f"{side}.{rest}"
    raise ModelLoadError(f"unexpected tensor {key!r} in the Wan2.2 VAE checkpoint")


def wan22_vae_config(shapes: Mapping[str, tuple[int, ...]], file: Path) -> dict[str, Any]:
    """diffusers' config of an original Wan2.2 VAE file: the published architecture, sized
    from the weights' shapes (the original decoder starts at ``decoder_base_dim`` times the
    last ``dim_mult``, 4)."""
    def need(name: str) -> tuple[int, ...]:
        if name not in shapes:
            raise ModelLoadError(f"{file} has no tensor {name!r}: not a Wan2.2 VAE file")
        return shapes[name]

    blocks = {k.split(".")[4] for k in shapes
              if k.startswith("encoder.downsamples.0.downsamples.") and ".residual." in k}
    return {**_WAN22_VAE, "base_dim": need("encoder.conv1.weight")[0],
            "decoder_base_dim": need("decoder.conv1.weight")[0] // _WAN22_VAE["dim_mult"][-1],
            "z_dim": need("conv2.weight")[0], "num_res_blocks": len(blocks)}
