"""The Wan VAE's decode, one latent frame at a time (the streamed decode of
:meth:`~workers.models.base.DecoderAdapter.decode_media`).

Why this is not a call of ``vae.decode``: diffusers' ``AutoencoderKLWan._decode`` (0.42) is
already causal -- after ``post_quant_conv`` over the whole latent it runs the decoder once
per latent frame (the first gives one video frame, each further one four), carrying a
feature cache from one frame to the next -- but it concatenates the frames and hands them
back only at the end, and offers no per-frame callback. :func:`decode_by_latent_frame` is
that loop with the callback: the same modules called with the same arguments in the same
order (cache cleared before and after, ``first_chunk`` on the first frame), then what
``_decode`` does after the loop -- ``unpatchify`` (Wan2.2's 48-channel VAE) and the clamp --
applied to each frame's output. Both only move or clamp values one by one, so the frames are
bit for bit those of ``vae.decode``. Tiled decodes are not streamed (their tiles blend
across the whole video); :func:`streams` says which VAEs take this path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..diffusers_glue import latent_stats


def streams(vae: Any, latents: torch.Tensor) -> bool:
    """Whether ``vae.decode(latents)`` runs the loop :func:`decode_by_latent_frame` mirrors:
    one sample (no slicing), no tiling, and the private state that loop uses present (a
    diffusers whose ``_decode`` is built otherwise then keeps the one-piece decode)."""
    return (
        latents.shape[0] == 1
        and not getattr(vae, "use_tiling", True)
        and all(hasattr(vae, name) for name in ("clear_cache", "_cached_conv_counts",
                                                "post_quant_conv", "decoder"))
    )


def decode_by_latent_frame(vae: Any, latents: torch.Tensor, device: torch.device,
                           each: Callable[[torch.Tensor], None]) -> None:
    """``decode_latents(vae, latents, device)`` (normalised latents in), handing each latent
    frame's part of the output to ``each`` as soon as it is computed: (1, C, f, H, W)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

    with torch.no_grad():
        latents = latents.to(device=device, dtype=vae.dtype)
        mean, std = latent_stats(vae.config, latents)
        z = latents / (1.0 / std) + mean
        # What diffusers' apply_forward_hook does around vae.decode (an accelerate offload
        # hook moves the VAE to its device first).
        hook = getattr(vae, "_hf_hook", None)
        if hook is not None and hasattr(hook, "pre_forward"):
            hook.pre_forward(vae)
        vae.clear_cache()
        try:
            x = vae.post_quant_conv(z)
            for i in range(x.shape[2]):
                vae._conv_idx = [0]
                out = vae.decoder(x[:, :, i:i + 1, :, :], feat_cache=vae._feat_map,
                                  feat_idx=vae._conv_idx, first_chunk=i == 0)
                if vae.config.patch_size is not None:
                    out = unpatchify(out, patch_size=vae.config.patch_size)
                each(torch.clamp(out, min=-1.0, max=1.0))
        finally:
            vae.clear_cache()  # the cache holds activations of this video: free them
