"""The front door's request and response bodies (pydantic, at the HTTP edge only) and the
helpers that turn their fields into task inputs, each refusing bad input with the status
code and a message that says what to do."""

from __future__ import annotations

import base64
import binascii
import io
import math
import re
from pathlib import PurePosixPath
from typing import Any

from fastapi import HTTPException
from pydantic import BaseModel, ConfigDict, Field, field_validator

from contracts.input_images import IMAGE_FORMATS

TASK_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
MAX_IMAGE_BYTES = 32 << 20
MAX_IMAGE_PIXELS = 40_000_000
_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f-\x9f]")
MAX_PATH_BYTES = 1024
MAX_NAME_BYTES = 255  # one path component, as most file systems allow
# What a value that is not base64 must look like for the refusal to call it a file path.
_PATH_LIKE = re.compile(r"^(/|\./|\.\./|~)|\.(png|jpe?g|webp|bmp|gif|tiff?)$", re.IGNORECASE)


class TaskRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task_id: str | None = Field(None, description="client-chosen id; a duplicate gets 409")
    prompt: str = Field(..., min_length=1, max_length=100_000)
    negative_prompt: str | None = Field(None, max_length=100_000)
    image_path: str | list[str] | None = Field(
        None, description="input image for i2v / i2i (and qwen_t2i's image-to-image, with "
        "i2i_denoise_strength): base64 or a data: URL (or an http(s) "
        "URL of an allowed host, a file under the input folder, where configured); qwen_i2i_plus "
        "takes a list of them (Picture 1, Picture 2, ..., at most server.max_input_images)"
    )
    last_frame_path: str | None = Field(None, description="not supported by diffring "
                                        "(no first-last-frame DiT is served)")
    save_result_path: str | None = Field(
        None, description="result file name, relative to the controller's output folder"
    )
    infer_steps: int | None = Field(None, ge=1, le=1000)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    target_shape: list[int] | None = Field(None, description="[height, width]")
    size: str | list[int] | None = Field(
        None, description="output size as LightX2V's OpenAI route reads it, 'WxH', or "
        "[height, width] (as target_shape)")
    height: int | None = None
    width: int | None = None
    guidance_scale: float | None = Field(None, ge=0)
    true_cfg_scale: float | None = Field(None, ge=0)
    guidance_scale_2: float | None = Field(
        None, ge=0, description="Wan2.2-A14B: the low-noise expert's guidance scale")
    lora_name: str | None = Field(
        None, description="one LoRA adapter (a file stem in the DiT workers' lora_dir)")
    lora_strength: float | None = Field(None, description="its strength (default 1.0)")
    loras: list[dict[str, Any]] | None = Field(
        None, description='LoRA adapters: [{"name": ..., "strength": 1.0}, ...]')
    cache: dict[str, Any] | None = Field(
        None, description='step cache: {"kind": "first_block_cache", "threshold": 0.05} '
        '(diffusers\' names); {"kind": "none"} turns the workers\' default off')
    priority: str | None = Field(
        None, description="low, normal (default) or high: the order queued work is released "
        "in; a high task waiting too long preempts a lower one at a step boundary")

    @field_validator("*", mode="after")
    @classmethod
    def _encodable(cls, value: object) -> object:
        # JSON may carry lone surrogates ("\ud800"): a valid Python str, but one that
        # msgpack and the file system fail on much later. Pydantic catches them in some
        # fields only.
        for text in value if isinstance(value, list) else [value]:
            if isinstance(text, str) and not text.isascii():  # isascii: cheap on a 1 MB image
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:
                    raise ValueError("must be valid unicode text (no lone surrogates)") from None
        return value

    def image_values(self) -> list[str]:
        """The input images as sent: none, one, or several: a JSON list, or LightX2V's
        comma-separated ``image_path`` ("a.png,b.png" on its command line; here base64 or
        data: URLs, whose own comma is kept with its URL)."""
        if self.image_path is None or self.image_path == "":
            return []
        if isinstance(self.image_path, list):
            return list(self.image_path)
        return split_images(self.image_path)


class VideoTaskRequest(TaskRequest):
    target_video_length: int | None = Field(None, ge=1, le=1025)
    target_fps: int | None = Field(None, ge=1, le=240)
    resize_mode: str | None = Field(
        None, description="wan i2v: the output size from the input image, LightX2V's modes "
        "(adaptive, keep_ratio_fixed_area, fixed_min_area, fixed_max_area, fixed_min_side, "
        "fixed_shape); the image is cropped to its aspect ratio")


class ImageTaskRequest(TaskRequest):
    aspect_ratio: str | None = Field(None, description='e.g. "16:9"')
    i2i_denoise_strength: float | None = Field(
        None, description="Qwen-Image, 0 < strength <= 1: how much of the one input image is "
        "redrawn (qwen_t2i: image-to-image, with image_path; the edits: the input image is "
        "also the start); unset: text-to-image, or the whole edit from noise")


class SyncImageTaskRequest(ImageTaskRequest):
    timeout_seconds: float = Field(600.0, gt=0, le=86400)
    poll_interval_seconds: float = Field(0.5, gt=0, le=60)


class TaskCreated(BaseModel):
    task_id: str
    task_status: str
    save_result_path: str


def split_images(value: str) -> list[str]:
    """``value`` cut at its commas, except the one inside each ``data:`` URL (after its
    ``;base64`` header). Base64 itself has no comma, so one image stays one."""
    out: list[str] = []
    header: str | None = None
    for piece in value.split(","):
        if header is not None:
            out.append(f"{header},{piece}")
            header = None
        elif piece.lstrip().startswith("data:"):
            header = piece
        else:
            out.append(piece)
    if header is not None:  # a data: URL without a payload: decoding refuses it
        out.append(header)
    return out


def http_error(status: int, message: str, headers: dict[str, str] | None = None) -> HTTPException:
    return HTTPException(status_code=status, detail=message, headers=headers)


def safe_relative_path(path: str) -> str:
    """``save_result_path`` must name a file inside the output folder: relative, no ``..``,
    no control characters, not a folder, of a length file systems take."""
    hint = "give a relative file name such as 'cat.png' or 'cats/cat.png'"
    bad = _CONTROL_CHARS.search(path)
    if bad:
        raise http_error(
            400,
            f"save_result_path contains the control character U+{ord(bad.group()):04X}; {hint}",
        )
    if path.endswith(("/", "\\")):
        raise http_error(400, f"save_result_path {path!r} names a folder, not a file; {hint}")
    p = PurePosixPath(path.replace("\\", "/"))
    if not path or p.is_absolute() or ".." in p.parts or any(part == "" for part in p.parts):
        raise http_error(
            400,
            f"save_result_path {path!r} would escape the output folder; {hint}",
        )
    if re.match(r"^[A-Za-z]:", path):
        raise http_error(400, f"save_result_path {path!r} must be relative")
    if p.name in ("", "."):
        raise http_error(400, f"save_result_path {path!r} names no file; {hint}")
    if len(path.encode()) > MAX_PATH_BYTES or any(
        len(part.encode()) > MAX_NAME_BYTES for part in p.parts
    ):
        raise http_error(
            400,
            f"save_result_path is too long (at most {MAX_PATH_BYTES} bytes, "
            f"{MAX_NAME_BYTES} per folder or file name)",
        )
    return str(p)


def decode_image(
    value: str, max_bytes: int = MAX_IMAGE_BYTES, max_pixels: int = MAX_IMAGE_PIXELS
) -> bytes:
    """Input image from base64 or a data: URL; other schemes are refused (422). The file
    must be at most ``max_bytes`` and ``max_pixels`` (413: the size is read from the header,
    before anything is decoded), and must decode completely (422).

    Blocking (base64 and image decoding): the front door runs it on a worker thread.
    """
    value = value.strip()
    if value.startswith("data:"):
        head, _, payload = value.partition(",")
        if ";base64" not in head:
            raise http_error(422, "image_path data: URL must be base64-encoded")
        value = payload
    elif re.match(r"^[a-zA-Z][a-zA-Z0-9+.\-]*://", value):
        scheme = value.split("://", 1)[0]
        raise http_error(
            422,
            f"image_path scheme {scheme!r} is not allowed; send the image as base64 or a data: "
            "URL (http(s) URLs of the hosts in server.image_url_hosts are fetched)",
        )
    # Base64 first, whatever the value starts with: the base64 of every JPEG starts with
    # "/9j/", so a leading "/" says nothing. Line breaks (base64 -w 76) are dropped.
    compact = "".join(value.split())
    if len(compact) > (max_bytes + 2) // 3 * 4 + 4:  # refuse before decoding, too
        raise http_error(413, f"input image exceeds {max_bytes} bytes")
    try:
        data = base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError):
        if _PATH_LIKE.search(value):
            raise http_error(
                422,
                "image_path is not base64 and looks like a file path; the controller reads "
                "files only under server.input_dir, which is not set: send the image as "
                "base64 or a data: URL",
            ) from None
        raise http_error(422, "image_path is not valid base64") from None
    if len(data) > max_bytes:
        raise http_error(413, f"input image of {len(data)} bytes exceeds {max_bytes} bytes")
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as im:
            width, height = im.size
            if width * height > max_pixels:
                raise http_error(
                    413,
                    f"input image of {width}x{height} = {width * height} pixels exceeds "
                    f"{max_pixels} pixels; scale it down",
                )
            im.verify()
        # verify() leaves the image unusable; decoding it in full catches truncated or
        # corrupt pixel data here rather than in an encoder worker.
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as im:
            im.load()
    except HTTPException:
        raise
    except Image.DecompressionBombError as exc:
        raise http_error(413, f"input image refused as a decompression bomb: {exc}") from None
    except MemoryError:
        raise http_error(413, "input image too large to decode; scale it down") from None
    except Exception as exc:  # PIL raises many types for undecodable data
        raise http_error(
            422,
            f"image_path does not decode as an image ({', '.join(IMAGE_FORMATS)}): {exc}",
        ) from None
    return data


def size_for_aspect(ratio: str, area: int, multiple: int) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", ratio)
    if not m or int(m[1]) == 0 or int(m[2]) == 0:
        raise http_error(
            422, f"aspect_ratio {ratio!r} is not of the form 'W:H' with positive integers"
        )
    w_r, h_r = int(m[1]), int(m[2])
    if max(w_r / h_r, h_r / w_r) > 8:
        raise http_error(422, f"aspect_ratio {ratio!r} is more extreme than 8:1")
    width = math.sqrt(area * w_r / h_r)
    height = area / width
    snap = lambda v: max(multiple, round(v / multiple) * multiple)  # noqa: E731
    return snap(height), snap(width)
