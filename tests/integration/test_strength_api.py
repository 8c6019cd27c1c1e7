"""``i2i_denoise_strength`` at the front door and end to end: LightX2V's task API and the
``openai`` package's ``images.edit`` (with the field in ``extra_body``, as LightX2V's OpenAI
route reads it) on a qwen_t2i controller run image-to-image, a group and the one-process
baseline give diffusers' ``QwenImageImg2ImgPipeline`` pixels; what is refused, and why."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient

from contracts.config import ServerConfig
from controller.app import LocalQueue
from controller.http.frontdoor import FrontDoor
from controller.http.webapp import build_app
from launcher import LocalGroup, group_config, submit
from tests.support.coordinators import make_coordinator

pytestmark = pytest.mark.integration  # the front door's decoding processes; groups

BODY: dict[str, Any] = {"prompt": "a lighthouse at dusk", "negative_prompt": "blur", "seed": 7,
                        "height": 32, "width": 48, "infer_steps": 4}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(params=["qwen_t2i", "qwen_i2i_plus"])
def door(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[TestClient]:
    """A front door in this process (no workers: the OpenAI routes do not wait)."""
    co = make_coordinator(tmp_path, LocalQueue(64, 4096), pipeline=request.param,
                          max_pending=64)
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
        yield c
    front.close()
    co.close()


def newest(c: TestClient) -> Any:
    return list(c.front.co.table)[-1]  # type: ignore[attr-defined]


def test_the_task_api_takes_an_image_with_its_strength(door: TestClient,
                                                       input_png: bytes) -> None:
    r = door.post("/v1/tasks/image/", json={**BODY, "image_path": b64(input_png),
                                            "i2i_denoise_strength": 0.6, "task_id": "s1"})
    assert r.status_code == 200, r.text
    task = door.front.co.table.get("s1")  # type: ignore[attr-defined]
    assert task.request["i2i_denoise_strength"] == 0.6 and task.image_bytes == input_png


def test_openai_edits_carry_the_strength(door: TestClient, input_png: bytes) -> None:
    """LightX2V's OpenAI route takes the strength as a form field: the openai package sends
    ``extra_body`` so. On a qwen_t2i controller an edit is image-to-image."""
    oc = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=door,
                       max_retries=0)
    oc.images.edit(image=("in.png", input_png, "image/png"), prompt="p", size="48x32",
                   extra_body={"i2i_denoise_strength": 0.4, "seed": 3})
    task = newest(door)
    assert task.request["i2i_denoise_strength"] == 0.4 and task.request["seed"] == 3
    assert task.image_bytes == input_png


@pytest.mark.parametrize(("fields", "status", "needle"), [
    ({"image": True}, {"qwen_t2i": 422},
     "takes no input image without i2i_denoise_strength"),
    ({"i2i_denoise_strength": 0.5}, {"qwen_t2i": 422, "qwen_i2i_plus": 422},
     "needs an input image"),
    ({"image": True, "i2i_denoise_strength": 0}, {"qwen_t2i": 422, "qwen_i2i_plus": 422},
     "in (0, 1]"),
    ({"image": True, "i2i_denoise_strength": 1.5}, {"qwen_t2i": 422, "qwen_i2i_plus": 422},
     "in (0, 1]"),
    ({"image": 2, "i2i_denoise_strength": 0.5}, {"qwen_t2i": 422, "qwen_i2i_plus": 422},
     "one input image"),
])
def test_refusals(door: TestClient, input_png: bytes, input_png_2: bytes,
                  fields: dict[str, Any], status: dict[str, int], needle: str) -> None:
    pipeline = door.front.pipeline  # type: ignore[attr-defined]
    if pipeline not in status:
        pytest.skip(f"served by {pipeline}")
    body = {**BODY, **{k: v for k, v in fields.items() if k != "image"}}
    if fields.get("image") is True:
        body["image_path"] = b64(input_png)
    elif fields.get("image") == 2:
        body["image_path"] = [b64(input_png), b64(input_png_2)]
    r = door.post("/v1/tasks/image/", json=body)
    assert r.status_code == status[pipeline], r.text
    assert needle in r.json()["detail"]
    assert list(door.front.co.table) == []  # type: ignore[attr-defined]


def test_openai_edit_without_strength_on_t2i_is_refused(door: TestClient,
                                                        input_png: bytes) -> None:
    if door.front.pipeline != "qwen_t2i":  # type: ignore[attr-defined]
        pytest.skip("an edit controller edits without a strength")
    oc = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=door,
                       max_retries=0)
    with pytest.raises(openai.BadRequestError, match="i2i_denoise_strength"):
        oc.images.edit(image=("in.png", input_png, "image/png"), prompt="p")
    assert list(door.front.co.table) == []  # type: ignore[attr-defined]


def test_a_video_request_has_no_strength(tmp_path: Path) -> None:
    co = make_coordinator(tmp_path, LocalQueue(64, 4096), pipeline="wan_i2v", max_pending=64)
    front = FrontDoor(co, status_extra=lambda: {}, service="controller", server=ServerConfig())
    with TestClient(build_app(front)) as c:
        r = c.post("/v1/tasks/video/", json={"prompt": "p", "i2i_denoise_strength": 0.5})
        assert r.status_code == 422 and "i2i_denoise_strength" in r.text
    front.close()
    co.close()


# -- end to end ---------------------------------------------------------------------------------
def img2img_reference(tiny_models: Path, image: bytes, strength: float) -> np.ndarray:
    """diffusers' QwenImageImg2ImgPipeline on the tiny Qwen-Image folder, uint8 pixels."""
    import diffusers
    import torch
    from PIL import Image

    from workers.models.media import to_uint8

    pipe = diffusers.QwenImageImg2ImgPipeline.from_pretrained(tiny_models / "qwen_t2i",
                                                              dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(prompt=BODY["prompt"], negative_prompt=BODY["negative_prompt"],
               image=Image.open(io.BytesIO(image)).convert("RGB"), strength=strength,
               height=BODY["height"], width=BODY["width"],
               num_inference_steps=BODY["infer_steps"], true_cfg_scale=4.0, output_type="np",
               generator=torch.Generator("cpu").manual_seed(BODY["seed"])).images[0]
    return to_uint8(np.asarray(out))


def png_pixels(data: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


@pytest.mark.parametrize("service", ["disaggregated", "baseline"])
def test_t2i_group_serves_image_to_image(service: str, tiny_models: Path, input_png: bytes,
                                         tmp_path: Path) -> None:
    """A qwen_t2i group (controller staging the image, encoder loading its VAE for it) and
    the one-process baseline: LightX2V's payload and the openai package's edit both give
    diffusers' img2img pixels; a text-to-image request beside them is unchanged."""
    group = LocalGroup(group_config("qwen_t2i", str(tiny_models / "qwen_t2i"), tmp_path),
                       tmp_path)
    with group:
        if service == "baseline":
            group.start("all")
            group.wait_http(timeout=180)
        else:
            group.start_all()
        st = submit(group.url, "image", {**BODY, "image_path": b64(input_png),
                                         "i2i_denoise_strength": 0.6}, timeout=600)
        assert st["status"] == "completed", st
        lightx2v = httpx.get(f"{group.url}/v1/tasks/{st['task_id']}/result", timeout=30)
        oc = openai.OpenAI(base_url=f"{group.url}/v1", api_key="unused", max_retries=0,
                           timeout=600)
        edited = oc.images.edit(
            image=("in.png", input_png, "image/png"), prompt=BODY["prompt"], size="48x32",
            extra_body={"i2i_denoise_strength": 0.6, "seed": BODY["seed"],
                        "negative_prompt": BODY["negative_prompt"],
                        "infer_steps": BODY["infer_steps"]})
        text = submit(group.url, "image", BODY, timeout=600)
        assert text["status"] == "completed", text
    want = img2img_reference(tiny_models, input_png, 0.6)
    assert edited.data is not None and edited.data[0].b64_json is not None
    for got in (png_pixels(lightx2v.content),
                png_pixels(base64.b64decode(edited.data[0].b64_json))):
        assert np.array_equal(got, want), np.abs(got.astype(int) - want).max()
