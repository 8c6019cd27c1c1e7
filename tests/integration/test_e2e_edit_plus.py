"""End to end, Qwen-Image-Edit-2511 (QwenImageEditPlusPipeline) with one and two input
images: a group and the one-process baseline give diffusers' pixels; the images a task
carries survive a retry."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from launcher import submit, wait_task
from tests.support.groups import local_group
from tests.support.http import pixels, result

pytestmark = pytest.mark.integration  # starts processes or servers

PLUS = "qwen_i2i_plus"
PLUS_BODY: dict[str, Any] = {"prompt": "a tiny test of qwen_i2i_plus", "negative_prompt": "blur",
                             "seed": 7, "height": 32, "width": 32, "infer_steps": 2}
_PLUS_REFERENCE: dict[int, np.ndarray] = {}


def plus_reference(tiny_models: Path, images: list[bytes]) -> np.ndarray:
    """diffusers' QwenImageEditPlusPipeline on the tiny Edit-2511 folder, uint8 pixels."""
    from contracts.request import GenerationRequest
    from tests.support.models import diffusers_reference
    from workers.models.media import to_uint8

    if len(images) not in _PLUS_REFERENCE:
        req = GenerationRequest(task=PLUS, **PLUS_BODY)
        _PLUS_REFERENCE[len(images)] = to_uint8(
            diffusers_reference(tiny_models, req, images, "float32"))
    return _PLUS_REFERENCE[len(images)]


def b64_images(images: list[bytes]) -> str | list[str]:
    """One image as the string it has always been, several as the list form."""
    encoded = [base64.b64encode(i).decode() for i in images]
    return encoded[0] if len(encoded) == 1 else encoded


@pytest.mark.parametrize("service", ["disaggregated", "baseline"])
def test_edit_plus_equals_diffusers_with_one_and_two_images(
        service: str, tiny_models: Path, input_png: bytes, input_png_2: bytes,
        tmp_path: Path) -> None:
    """The Edit-2511 folder served by a 1/1/1 group (loopback) and by ``--service all``
    gives QwenImageEditPlusPipeline's pixels with one and with two pictures."""
    cases = {1: [input_png], 2: [input_png, input_png_2]}
    got = {}
    with local_group(PLUS, tiny_models, tmp_path) as group:
        if service == "baseline":
            group.start("all")
            group.wait_http(timeout=180)
        else:
            group.start_all()
        for n, images in cases.items():
            st = submit(group.url, "image", {**PLUS_BODY, "image_path": b64_images(images)},
                        timeout=600)
            assert st["status"] == "completed", st
            got[n] = pixels(result(group.url, st["task_id"]), "png")
    for n, images in cases.items():
        want = plus_reference(tiny_models, images)
        assert np.array_equal(got[n], want), f"{n} image(s): max abs diff " \
            f"{np.abs(got[n].astype(int) - want).max()}"
    assert not np.array_equal(got[1], got[2])  # the second picture counts


def test_edit_plus_images_are_kept_for_a_retry(tiny_models: Path, input_png: bytes,
                                               input_png_2: bytes, tmp_path: Path) -> None:
    """The encoder dies right after it pulled a two-picture task's images (SIGKILL at the
    stage): the controller stages the pack it kept again for attempt 2, on another encoder,
    and the result is still diffusers' (nothing of the pack was lost or reordered)."""
    images = [input_png, input_png_2]
    with local_group(PLUS, tiny_models, tmp_path) as group:
        group.start("controller")
        group.wait_http()
        doomed = group.start("encoder", {"faults": "worker.stage:exit"})
        group.start("transformer")
        group.start("decoder")
        group.wait_workers({"encoder": 1, "transformer": 1, "decoder": 1})
        r = httpx.post(f"{group.url}/v1/tasks/image/", timeout=30,
                       json={**PLUS_BODY, "image_path": b64_images(images), "task_id": "kept"})
        assert r.status_code == 200, r.text
        assert doomed.proc.wait(300) != 0  # killed at its fault point
        group.start("encoder")
        st = wait_task(group.url, "kept", timeout=600)
        assert st["status"] == "completed" and st["attempt"] == 2, st
        got = pixels(result(group.url, "kept"), "png")
    assert np.array_equal(got, plus_reference(tiny_models, images))
