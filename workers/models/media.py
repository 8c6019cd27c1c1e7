"""Image input decoding and result encoding (PNG / MP4).

The input image of I2V / I2I requests arrives as the bytes of a PNG or JPEG file; results
leave as PNG (images) or H.264 MP4 (videos, written with the ffmpeg binary that
``imageio-ffmpeg`` ships). Pixels are converted to uint8 the way diffusers does for PIL
output (``round(x * 255)``), so our frames equal the pipelines' images exactly.
"""

from __future__ import annotations

import io
import os
import tempfile
from typing import TYPE_CHECKING

import numpy as np

from contracts.errors import StageInputError

if TYPE_CHECKING:
    from PIL import Image

# A decompression bomb must not take a worker down: far above any real input (~16k x 16k).
_MAX_INPUT_PIXELS = 256 * 1024 * 1024


def decode_image(data: bytes | bytearray | memoryview | None, task: str) -> Image.Image:
    """Decode the input image of an I2V / I2I request to an RGB PIL image."""
    from PIL import Image, UnidentifiedImageError

    if data is None or len(data) == 0:
        raise StageInputError(f"{task} needs an input image (PNG or JPEG bytes); none was given")
    try:
        with Image.open(io.BytesIO(bytes(data))) as img:
            if img.width * img.height > _MAX_INPUT_PIXELS:
                raise StageInputError(
                    f"{task} input image is {img.width}x{img.height}, larger than the "
                    f"{_MAX_INPUT_PIXELS} pixel limit"
                )
            if img.format not in ("PNG", "JPEG", "WEBP"):
                raise StageInputError(
                    f"{task} input image must be PNG, JPEG or WebP, got {img.format or 'unknown'}"
                )
            rgb = img.convert("RGB")
            rgb.load()
            return rgb
    except StageInputError:
        raise
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise StageInputError(f"{task} input image could not be decoded: {e}") from e


def to_uint8(pixels: np.ndarray) -> np.ndarray:
    """float [0, 1] -> uint8, rounding like diffusers' ``numpy_to_pil``."""
    if pixels.dtype == np.uint8:
        return pixels
    return np.ascontiguousarray((pixels * 255).round().astype(np.uint8))


def encode_png(pixels: np.ndarray) -> bytes:
    """PNG bytes of an (H, W, 3) uint8 image. No metadata is written, so the bytes depend on
    the pixels only."""
    from PIL import Image

    if pixels.ndim != 3 or pixels.shape[-1] != 3 or pixels.dtype != np.uint8:
        raise ValueError(f"expected an (H, W, 3) uint8 image, got {pixels.shape} {pixels.dtype}")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG", compress_level=6)
    return buf.getvalue()


def encode_mp4(frames: np.ndarray, fps: int, quality: float = 8.0) -> bytes:
    """H.264 MP4 bytes of (F, H, W, 3) uint8 frames (yuv420p, playable everywhere).

    ``quality`` is imageio-ffmpeg's 1..10 scale (8 -> x264 CRF 10). The muxer is asked for
    bit-exact output, so the same frames give the same bytes with the same ffmpeg.
    """
    import imageio_ffmpeg

    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"expected (F, H, W, 3) uint8 frames, got {frames.shape} {frames.dtype}")
    _, height, width, _ = frames.shape
    if height % 2 or width % 2:
        raise ValueError(f"H.264 yuv420p needs even sizes, got {width}x{height}")
    with tempfile.TemporaryDirectory(prefix="diffring-mp4-") as tmp:
        path = os.path.join(tmp, "out.mp4")
        writer = imageio_ffmpeg.write_frames(
            path,
            (width, height),
            fps=fps,
            codec="libx264",
            quality=quality,
            pix_fmt_out="yuv420p",
            # Sizes are multiples of 16 already (request validation); 1 avoids any rescale.
            macro_block_size=1,
            ffmpeg_log_level="error",
            output_params=["-fflags", "+bitexact", "-flags:v", "+bitexact", "-threads", "1"],
        )
        writer.send(None)  # start the generator (launches ffmpeg)
        for frame in frames:
            writer.send(np.ascontiguousarray(frame))
        writer.close()
        with open(path, "rb") as f:
            return f.read()
