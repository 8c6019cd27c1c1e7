"""A request's input images as the one buffer that travels from the front door to the
encoder.

Input images travel the way one image always has: staged in the controller's pool through
the tensor plane, one descriptor in the request slot, the bytes kept by the controller (and
its task store) for a retry or a restart. One image travels as its own file bytes,
unchanged; several (``qwen_i2i_plus``) as one *pack*: :data:`PACK_MAGIC`, then a msgpack
list of the files' bytes in the request's order ("Picture 1", "Picture 2", ...). One buffer
keeps staging all-or-nothing (one allocation, one release) and leaves the retry, restart and
baseline paths exactly as they were for one image. No accepted image format (PNG, JPEG,
WebP, BMP, GIF, TIFF) starts with the magic, so a pack is never taken for an image.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgpack

from contracts.errors import StageInputError

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "BMP", "GIF", "TIFF")
"""The picture formats an input image may have (Pillow's names): the front door refuses any
other and the encoder stage reads exactly these. Pillow opens many more; some of them run
external programs (EPS runs Ghostscript) or are rarely fuzzed, so these only."""

PACK_MAGIC = b"diffring-images\x00"
"""First bytes of a pack (version 1 of the layout: a msgpack array of ``bin`` after it)."""


def pack_images(images: Sequence[bytes]) -> bytes:
    """The buffer for ``images``: the file itself for one, a pack for several."""
    if not images:
        raise ValueError("pack_images needs at least one image")
    if len(images) == 1:
        return bytes(images[0])
    return PACK_MAGIC + msgpack.packb([bytes(i) for i in images], use_bin_type=True)


def is_pack(data: bytes | bytearray | memoryview) -> bool:
    return bytes(data[: len(PACK_MAGIC)]) == PACK_MAGIC


def unpack_images(data: bytes | bytearray | memoryview, task: str) -> list[bytes]:
    """The images of a buffer :func:`pack_images` made (one file: a list of one); a damaged
    pack is a :class:`StageInputError` naming ``task``."""
    raw = bytes(data)
    if not is_pack(raw):
        return [raw]
    try:
        images = msgpack.unpackb(raw[len(PACK_MAGIC):], raw=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise StageInputError(f"{task}: the packed input images do not unpack: {exc}") from None
    if (not isinstance(images, list) or len(images) < 2
            or not all(isinstance(i, bytes) for i in images)):
        raise StageInputError(f"{task}: the packed input images are not a list of two or more "
                              "image files")
    return images

