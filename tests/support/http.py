"""What a test sends a running group over HTTP and reads back: tasks through LightX2V's
routes (``/v1/tasks/<kind>/``), their status and result, the result's pixels, and OpenAI's
client on the group's ``/v1``. ``url`` is a group's front door (``LocalGroup.url``)."""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np

if TYPE_CHECKING:  # imported where used: most tests need neither
    import openai
    from PIL import Image

REQUESTS: dict[str, dict[str, Any]] = {
    "wan_t2v": {"height": 32, "width": 32, "target_video_length": 5, "infer_steps": 2,
                "target_fps": 8},
    "wan_i2v": {"height": 32, "width": 32, "target_video_length": 5, "infer_steps": 2,
                "target_fps": 8},
    "qwen_t2i": {"height": 32, "width": 48, "infer_steps": 2},
    "qwen_i2i": {"height": 32, "width": 32, "infer_steps": 2},
}
"""The sizes of a small request of each pipeline, as LightX2V's API names them."""
KIND = {"wan_t2v": "video", "wan_i2v": "video", "qwen_t2i": "image", "qwen_i2i": "image"}
"""The route (``/v1/tasks/<kind>/``) of each pipeline in :data:`REQUESTS`."""


def body(pipeline: str, image: bytes | None, seed: int = 7, **extra: Any) -> dict[str, Any]:
    """A small request of ``pipeline`` (:data:`REQUESTS`), with ``image`` as its input
    picture (base64) where the pipeline takes one."""
    out = {"prompt": f"a tiny test of {pipeline}", "seed": seed, **REQUESTS[pipeline], **extra}
    if pipeline in ("wan_i2v", "qwen_i2i"):
        assert image is not None
        out["image_path"] = base64.b64encode(image).decode()
    return out


def post(url: str, kind: str, request: dict[str, Any]) -> httpx.Response:
    """A task posted to ``/v1/tasks/<kind>/``: the answer as it came, unchecked."""
    return httpx.post(f"{url}/v1/tasks/{kind}/", json=request, timeout=30)


def post_ok(url: str, kind: str, request: dict[str, Any]) -> str:
    """A task posted to ``/v1/tasks/<kind>/``, which must be accepted (200): its id."""
    r = post(url, kind, request)
    assert r.status_code == 200, r.text
    task_id: str = r.json()["task_id"]
    return task_id


def status(url: str, task_id: str) -> dict[str, Any]:
    """The task's status (``/v1/tasks/<id>/status``)."""
    out: dict[str, Any] = httpx.get(f"{url}/v1/tasks/{task_id}/status", timeout=30).json()
    return out


def result(url: str, task_id: str) -> bytes:
    """The task's result file, which must be there (200)."""
    r = httpx.get(f"{url}/v1/tasks/{task_id}/result", timeout=30)
    assert r.status_code == 200, r.text
    return r.content


def pixels(data: bytes, extension: str) -> np.ndarray:
    """A result's pixels: a PNG's (RGB), or an MP4's frames."""
    if extension == "png":
        from PIL import Image

        return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    from workers.models.media import read_mp4

    return read_mp4(data)


def read_events(url: str, task_id: str, on_open: Callable[[], object] | None = None
                ) -> list[tuple[str, dict[str, Any]]]:
    """Every event of the task's stream; ``on_open`` runs once its first event arrived."""
    import json

    from httpx_sse import connect_sse

    out = []
    with httpx.Client(timeout=httpx.Timeout(30, read=120)) as c, \
            connect_sse(c, "GET", f"{url}/v1/tasks/{task_id}/events") as source:
        assert source.response.headers["content-type"].startswith("text/event-stream")
        for sse in source.iter_sse():
            out.append((sse.event, json.loads(sse.data)))
            if on_open is not None and len(out) == 1:
                on_open()
    return out  # the server ended the stream


def png(data: bytes) -> Image.Image:
    """``data`` opened as a picture, which must be a PNG."""
    from PIL import Image

    img = Image.open(io.BytesIO(data))
    assert img.format == "PNG"
    return img


def openai_client(url: str) -> openai.OpenAI:
    """The ``openai`` package's client on the group's ``/v1``."""
    import openai

    # No key is checked by the front door; the package insists on one.
    return openai.OpenAI(api_key="unused", base_url=f"{url}/v1", max_retries=0, timeout=300)
