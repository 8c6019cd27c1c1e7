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

from fastapi import HTTPException
from pydantic import BaseModel, ConfigDict, Field

TASK_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
MAX_IMAGE_BYTES = 32 << 20


class TaskRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task_id: str | None = Field(None, description="client-chosen id; a duplicate gets 409")
    prompt: str = Field(..., min_length=1, max_length=100_000)
    negative_prompt: str | None = None
    image_path: str | None = Field(
        None, description="input image for i2v / i2i: base64 or a data: URL"
    )
    last_frame_path: str | None = Field(None, description="not supported by diffring")
    save_result_path: str | None = Field(
        None, description="result file name, relative to the controller's output folder"
    )
    infer_steps: int | None = Field(None, ge=1, le=1000)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    target_shape: list[int] | None = Field(None, description="[height, width]")
    height: int | None = None
    width: int | None = None
    guidance_scale: float | None = Field(None, ge=0)
    true_cfg_scale: float | None = Field(None, ge=0)
    lora_name: str | None = Field(None, description="not supported by diffring")
    lora_strength: float | None = None


class VideoTaskRequest(TaskRequest):
    target_video_length: int | None = Field(None, ge=1, le=1025)
    target_fps: int | None = Field(None, ge=1, le=240)
    resize_mode: str | None = Field(None, description="not supported by diffring")


class ImageTaskRequest(TaskRequest):
    aspect_ratio: str | None = Field(None, description='e.g. "16:9"')
    i2i_denoise_strength: float | None = Field(None, description="not supported by diffring")


class SyncImageTaskRequest(ImageTaskRequest):
    timeout_seconds: float = Field(600.0, gt=0, le=86400)
    poll_interval_seconds: float = Field(0.5, gt=0, le=60)


class TaskCreated(BaseModel):
    task_id: str
    task_status: str
    save_result_path: str


def http_error(status: int, message: str, headers: dict[str, str] | None = None) -> HTTPException:
    return HTTPException(status_code=status, detail=message, headers=headers)


def safe_relative_path(path: str) -> str:
    """``save_result_path`` must stay inside the output folder: relative, no ``..``."""
    p = PurePosixPath(path.replace("\\", "/"))
    if not path or p.is_absolute() or ".." in p.parts or any(part == "" for part in p.parts):
        raise http_error(
            400,
            f"save_result_path {path!r} would escape the output folder; give a "
            "relative file name such as 'cat.png'",
        )
    if re.match(r"^[A-Za-z]:", path):
        raise http_error(400, f"save_result_path {path!r} must be relative")
    return str(p)


def decode_image(value: str) -> bytes:
    """Input image from base64 or a data: URL; other schemes are refused (422)."""
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
            f"image_path scheme {scheme!r} is not allowed; send the image as base64 or a data: URL",
        )
    elif value.startswith("/") or value.startswith("."):
        raise http_error(
            422,
            "image_path looks like a file path; the controller does not read local "
            "files — send the image as base64 or a data: URL",
        )
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise http_error(422, "image_path is not valid base64") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise http_error(413, f"input image of {len(data)} bytes exceeds {MAX_IMAGE_BYTES} bytes")
    try:
        from PIL import Image

        with Image.open(io.BytesIO(data)) as im:
            im.verify()
    except Exception as exc:  # PIL raises many types for undecodable data
        raise http_error(422, f"image_path does not decode as an image: {exc}") from None
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
