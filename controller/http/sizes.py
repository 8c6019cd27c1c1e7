"""A request's output size and the service's request defaults, read as LightX2V reads them.

The size of a request comes from, first to last: its own explicit size (``target_shape``
``[height, width]``, ``size`` as ``"WxH"`` or ``[height, width]``, or ``height`` and
``width``), its ``aspect_ratio``, the service's ``request_defaults`` (a size, then an aspect
ratio), then the pipeline's own defaults. An explicit size wins over an aspect ratio sent
beside it (LightX2V's Qwen-Image request script sends both). For Qwen-Image an aspect ratio
LightX2V lists takes its size from LightX2V's table (16:9 is 1664x928); any other ``W:H``
keeps the pipeline's default area. Unlike LightX2V, a request's own aspect ratio wins over
the config's target size: a default is what a request that names nothing gets.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from contracts.lightx2v import QWEN_ASPECT_SIZES
from contracts.pipelines import TaskSpec
from controller.http.schemas import TaskRequest, http_error, size_for_aspect

# request_defaults keys that are GenerationRequest fields and not sizes.
_PLAIN_DEFAULTS = ("negative_prompt", "infer_steps", "guidance_scale", "true_cfg_scale",
                   "guidance_scale_2", "num_frames", "fps", "max_sequence_length")


def explicit_size(body: TaskRequest) -> tuple[int, int] | None:
    """(height, width) the request names itself, or None."""
    size = getattr(body, "size", None)
    shape = body.target_shape
    if shape is not None and len(shape) == 0:
        shape = None  # LightX2V's own default: "no shape"
    if shape is not None and size is not None:
        raise http_error(422, "give target_shape or size, not both")
    if size is not None:
        if isinstance(size, str):
            m = re.fullmatch(r"\s*(\d+)\s*[xX*]\s*(\d+)\s*", size)
            if not m:
                raise http_error(422, f"size {size!r} must be 'WxH' (e.g. '1024x768') or "
                                      "[height, width]")
            return int(m[2]), int(m[1])
        shape = size
    if shape is not None:
        if len(shape) != 2:
            raise http_error(422, "target_shape must be [height, width]")
        return int(shape[0]), int(shape[1])
    if body.height is not None or body.width is not None:
        if body.height is None or body.width is None:
            raise http_error(422, "give both height and width, or neither")
        return body.height, body.width
    return None


def aspect_size(ratio: str, spec: TaskSpec) -> tuple[int, int]:
    """(height, width) of an aspect ratio: LightX2V's table for Qwen-Image, else the
    pipeline's default area at that ratio."""
    if spec.family == "qwen" and ratio.strip() in QWEN_ASPECT_SIZES:
        width, height = QWEN_ASPECT_SIZES[ratio.strip()]
        return height, width
    h = spec.defaults.get("height") or 1328
    w = spec.defaults.get("width") or 1328
    return size_for_aspect(ratio, int(h) * int(w), spec.size_multiple)


def size_fields(body: TaskRequest, spec: TaskSpec,
                defaults: Mapping[str, Any]) -> dict[str, int]:
    """``height`` / ``width`` of the request (empty: the pipeline's defaults)."""
    size = explicit_size(body)
    ratio = getattr(body, "aspect_ratio", None)
    if size is None and ratio:
        size = aspect_size(ratio, spec)
    if size is None and ("height" in defaults or "width" in defaults):
        h = defaults.get("height", spec.defaults.get("height"))
        w = defaults.get("width", spec.defaults.get("width"))
        if h is not None and w is not None:
            size = int(h), int(w)
    if size is None and defaults.get("aspect_ratio"):
        size = aspect_size(defaults["aspect_ratio"], spec)
    return {} if size is None else {"height": size[0], "width": size[1]}


def plain_defaults(fields: dict[str, Any], defaults: Mapping[str, Any]) -> None:
    """Fill the fields a request left unset from the service's ``request_defaults``."""
    for name in _PLAIN_DEFAULTS:
        if name not in fields and name in defaults:
            fields[name] = defaults[name]
