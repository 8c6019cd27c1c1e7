"""Input pictures in every format the front door accepts, through both APIs, as real clients
send them (plain base64 as LightX2V's I2V script sends a ``.jpg``, data: URLs, the ``openai``
package's uploads), and what the front door keeps for a task is what the encoder stage
reads: the same list of formats on both sides (``contracts.input_images.IMAGE_FORMATS``).

The front door runs in-process (no workers); its decoding processes make this an
integration module."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient

from contracts.config import ServerConfig
from contracts.input_images import IMAGE_FORMATS
from controller.app import LocalQueue
from controller.http.frontdoor import FrontDoor
from controller.http.webapp import build_app
from tests.support.coordinators import make_coordinator
from workers.models.media import decode_image

pytestmark = [pytest.mark.integration,  # the front door's decoding processes
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

EXTENSION = {"PNG": "png", "JPEG": "jpg", "WEBP": "webp", "BMP": "bmp", "GIF": "gif",
             "TIFF": "tiff"}


def picture(fmt: str, seed: int = 0) -> bytes:
    """A 24x16 picture of random pixels in ``fmt`` (GIF: a palette picture, as GIFs are)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (16, 24, 3), dtype=np.uint8))
    if fmt == "GIF":
        img = img.quantize(64)
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def rgb(data: bytes) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return np.asarray(img.convert("RGB"))


@pytest.fixture(params=["qwen_i2i", "wan_i2v"])
def door(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[TestClient, str]]:
    pipeline = request.param
    co = make_coordinator(tmp_path, LocalQueue(64, 4096), pipeline=pipeline, max_pending=64)
    front = FrontDoor(co, status_extra=lambda: {}, service="controller", server=ServerConfig())
    app = build_app(front)

    async def no_wait(tasks: Any) -> None:  # no workers: the images never come
        return None

    async def no_images(tasks: Any, response_format: Any, base: str) -> dict[str, Any]:
        return {"created": 0, "data": []}

    app.state.openai.wait = no_wait
    app.state.openai.images_response = no_images
    with TestClient(app) as c:
        c.front = front  # type: ignore[attr-defined]
        yield c, pipeline
    front.close()
    co.close()


def _kept(c: TestClient, task_id: str) -> bytes:
    task = c.front.co.table.get(task_id)  # type: ignore[attr-defined]
    data: bytes = task.image_bytes
    return data


def _newest(c: TestClient) -> bytes:
    tasks = list(c.front.co.table)  # type: ignore[attr-defined]
    data: bytes = tasks[-1].image_bytes
    return data


@pytest.mark.parametrize("fmt", IMAGE_FORMATS)
def test_every_accepted_format_reaches_the_stage_through_both_apis(
        door: tuple[TestClient, str], fmt: str) -> None:
    c, pipeline = door
    data = picture(fmt)
    want = rgb(data)
    route = "/v1/tasks/video/" if pipeline == "wan_i2v" else "/v1/tasks/image/"
    kept: list[bytes] = []
    # LightX2V's task API: plain base64 (its I2V script's shape; a JPEG's starts with
    # "/9j/"), base64 with line breaks (base64 -w 76), and a data: URL.
    b64 = base64.b64encode(data).decode()
    wrapped = "\n".join(b64[i:i + 76] for i in range(0, len(b64), 76))
    mime = f"image/{EXTENSION[fmt].replace('jpg', 'jpeg')}"
    for i, value in enumerate([b64, wrapped, f"data:{mime};base64,{b64}"]):
        r = c.post(route, json={"prompt": "p", "image_path": value, "task_id": f"{fmt}-{i}"})
        assert r.status_code == 200, (fmt, i, r.text)
        kept.append(_kept(c, f"{fmt}-{i}"))
    # OpenAI's routes, with the openai package's own multipart serialiser.
    oc = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=c,
                       max_retries=0)
    upload = (f"in.{EXTENSION[fmt]}", data, mime)
    if pipeline == "wan_i2v":
        oc.videos.create(prompt="p", input_reference=upload, size="32x32")  # type: ignore[arg-type]
    else:
        oc.images.edit(image=upload, prompt="p", size="32x32")  # type: ignore[arg-type]
    kept.append(_newest(c))
    for got in kept:
        assert got == data  # the file itself travels, unchanged
        image = decode_image(got, pipeline)  # what the encoder stage does with it
        assert np.array_equal(np.asarray(image), want)


def test_a_format_the_stage_cannot_read_is_refused_at_the_door(
        door: tuple[TestClient, str]) -> None:
    """PPM and ICO open in Pillow but are not accepted: 422 at the task API and OpenAI's
    400 at its routes, naming the formats that are; no task is made."""
    c, pipeline = door
    route = "/v1/tasks/video/" if pipeline == "wan_i2v" else "/v1/tasks/image/"
    oc = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=c,
                       max_retries=0)
    for fmt in ("PPM", "ICO"):
        data = picture(fmt)
        with pytest.raises(Exception, match="cannot identify"):
            decode_image(data, pipeline)  # the stage would fail the task
        r = c.post(route, json={"prompt": "p", "image_path": base64.b64encode(data).decode()})
        assert r.status_code == 422 and "PNG, JPEG, WEBP, BMP, GIF, TIFF" in r.text, r.text
        with pytest.raises(openai.BadRequestError, match="does not decode as an image"):
            upload = ("in.img", data, "application/octet-stream")
            if pipeline == "wan_i2v":
                oc.videos.create(prompt="p", input_reference=upload)  # type: ignore[arg-type]
            else:
                oc.images.edit(image=upload, prompt="p")
    assert list(c.front.co.table) == []  # type: ignore[attr-defined]


def test_paths_and_urls_are_named_not_guessed(door: tuple[TestClient, str]) -> None:
    """A value that is not base64 and looks like a path, or a URL, is refused with what to
    send instead; a value that is base64 is read as base64 whatever it starts with."""
    c, pipeline = door
    route = "/v1/tasks/video/" if pipeline == "wan_i2v" else "/v1/tasks/image/"
    for value, says in [("/data/cat.png", "looks like a file path"),
                        ("./cat.jpg", "looks like a file path"),
                        ("cat.jpeg", "looks like a file path"),
                        ("https://example.com/cat.png", "scheme 'https' is not allowed"),
                        ("!!notbase64!!", "not valid base64")]:
        r = c.post(route, json={"prompt": "p", "image_path": value})
        assert r.status_code == 422 and says in r.text, (value, r.text)
    jpeg = base64.b64encode(picture("JPEG")).decode()
    assert jpeg.startswith("/9j/")
    assert c.post(route, json={"prompt": "p", "image_path": jpeg}).status_code == 200
