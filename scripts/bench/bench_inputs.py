"""Input images for the benchmarks of image-conditioned pipelines: smooth, deterministic
pictures (PNG, base64) of a given size, each different, as the request's ``image_path``."""

from __future__ import annotations

import base64
import io


def input_images(count: int, height: int, width: int) -> str | list[str]:
    """``count`` PNG pictures of ``height`` x ``width`` as ``image_path`` takes them (one: a
    string; several: a list, "Picture 1", "Picture 2", ...)."""
    import numpy as np
    from PIL import Image

    out = []
    y, x = np.mgrid[0:height, 0:width]
    for k in range(count):
        rgb = np.stack([(x * (3 + k)) % 256, (y * (5 + k)) % 256, ((x + y) * (k + 1)) % 256],
                       axis=-1).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(rgb).save(buf, format="PNG")
        out.append(base64.b64encode(buf.getvalue()).decode())
    return out[0] if count == 1 else out
