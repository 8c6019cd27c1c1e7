"""LightX2V's ``resize_mode`` for Wan image-to-video: the output size follows the input
image, and the image is cropped to that size's aspect ratio, centred, before the encoder
resizes it (LightX2V's ``resize_image`` and ``isotropic_crop_resize``, read for their
meanings; its default resolution tier, 480p, and default area, 480x832):

* ``adaptive``, ``fixed_min_area``: the size of the 480p bucket nearest the image's aspect
  ratio (portrait 832x480, landscape 480x832, square 480x480, as height x width);
  ``fixed_max_area``: the 720p bucket (1280x720, 720x1280, 960x960);
* ``keep_ratio_fixed_area``: the image's aspect ratio at the area of 480x832;
* ``fixed_min_side``: the shorter side 480, the other at the image's aspect ratio;
* ``fixed_shape``: the request's own size (or the service's default size).

Each side is then floored to a multiple of 16 (the VAE's 8 times the DiT's patch of 2), as
LightX2V aligns its latents; of 32 for Wan2.2-TI2V-5B (its VAE compresses 16 times).
Without ``resize_mode`` a request keeps diffring's behaviour (its size, or the default;
diffusers' pipeline resizes the image to it).
"""

from __future__ import annotations

import io
import math

from contracts.request import RESIZE_MODES

# Aspect ratio (height / width) -> (height, width) at the 480p, 540p, 720p tiers.
_BUCKETS = {
    0.667: ((480, 832), (544, 960), (720, 1280)),
    1.5: ((832, 480), (960, 544), (1280, 720)),
    1.0: ((480, 480), (576, 576), (960, 960)),
}
_AREA = 480 * 832
_MIN_SIDE = 480
_MULTIPLE = 16
_SAME_RATIO = 0.01  # aspect ratios this close are not cropped (LightX2V's tolerance)


def target_size(mode: str, image_h: int, image_w: int, size: tuple[int, int] | None,
                multiple: int = _MULTIPLE) -> tuple[int, int]:
    """(height, width) of the output for ``mode`` and an input image of that size, each a
    multiple of ``multiple`` (the pipeline's ``size_multiple``)."""
    if mode not in RESIZE_MODES:
        raise ValueError(f"resize_mode must be one of {', '.join(RESIZE_MODES)}, got {mode!r}")
    ratio = image_h / image_w
    nearest = _BUCKETS[min(_BUCKETS, key=lambda r: abs(r - ratio))]
    if mode in ("adaptive", "fixed_min_area"):
        h, w = nearest[0]
    elif mode == "fixed_max_area":
        h, w = nearest[-1]
    elif mode == "keep_ratio_fixed_area":
        h, w = round(math.sqrt(_AREA * ratio)), round(math.sqrt(_AREA / ratio))
    elif mode == "fixed_min_side":
        h, w = (_MIN_SIDE, round(_MIN_SIDE / ratio)) if ratio < 1 else (
            round(_MIN_SIDE * ratio), _MIN_SIDE)
    else:  # fixed_shape
        if size is None:
            raise ValueError("resize_mode 'fixed_shape' needs a size (target_shape, or the "
                             "service's request_defaults)")
        h, w = size
    return max(multiple, h // multiple * multiple), max(multiple, w // multiple * multiple)


def crop_box(image_h: int, image_w: int, h: int, w: int) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of the centred crop of the image to ``h / w``."""
    want, have = h / w, image_h / image_w
    if abs(have - want) < _SAME_RATIO:
        return 0, 0, image_w, image_h
    if have > want:  # too tall: keep the width
        crop_h = int(want * image_w)
        top = (image_h - crop_h) // 2
        return 0, top, image_w, top + crop_h
    crop_w = int(image_h / want)
    left = (image_w - crop_w) // 2
    return left, 0, left + crop_w, image_h


def apply(mode: str, data: bytes, size: tuple[int, int] | None, multiple: int = _MULTIPLE
          ) -> tuple[bytes, int, int] | tuple[int, str]:
    """Runs in a decoding process: (the image cropped to the output's aspect ratio, as PNG,
    and the output's height and width), or (status, reason) to answer with."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            h, w = target_size(mode, im.height, im.width, size, multiple)
            box = crop_box(im.height, im.width, h, w)
            if box == (0, 0, im.width, im.height):
                return data, h, w
            out = io.BytesIO()
            im.crop(box).convert("RGB").save(out, format="PNG")  # as the encoder reads it
    except ValueError as exc:
        return 422, str(exc)
    return out.getvalue(), h, w
