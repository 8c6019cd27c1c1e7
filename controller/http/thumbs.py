"""Thumbnails of results: a small PNG of an image result, the first frame (poster) of an MP4.

Made on first request and kept in ``<output_dir>/.thumbs/``; the MP4's first frame is read
with PyAV (``av``, FFmpeg in the wheel; the decoder writes MP4s with it too), so the
controller needs no torch and no video library of its own.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

MAX_SIDE = 256
"""Longest side of a thumbnail in pixels (smaller results are kept at their size)."""


def thumbnail_file(output_dir: Path, task_id: str) -> Path:
    return output_dir / ".thumbs" / f"{task_id}.png"


def remove_thumbnail(output_dir: Path, task_id: str) -> None:
    thumbnail_file(output_dir, task_id).unlink(missing_ok=True)


def first_frame(path: Path) -> np.ndarray:
    """The first frame of a video file as (H, W, 3) uint8."""
    import av

    try:
        with av.open(str(path), mode="r") as container:
            for frame in container.decode(video=0):
                rgb: np.ndarray = frame.to_ndarray(format="rgb24")
                return rgb
    except (av.error.FFmpegError, IndexError) as exc:  # not a video, or no video stream
        raise ValueError(f"{path} holds no readable video frame: {exc}") from exc
    raise ValueError(f"{path} holds no video frame")


def make_thumbnail(result: Path, media_type: str | None, out: Path) -> Path:
    """Write the thumbnail of ``result`` to ``out`` (atomically) unless it is there already."""
    from PIL import Image

    if out.exists() and out.stat().st_mtime >= result.stat().st_mtime:
        return out
    if media_type and media_type.startswith("video/"):
        img = Image.fromarray(first_frame(result))
    else:
        with Image.open(result) as src:
            img = src.convert("RGB")
    img.thumbnail((MAX_SIDE, MAX_SIDE))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    img.save(tmp, format="PNG")
    tmp.replace(out)
    return out
