"""What a request gets for the fields it leaves unset (a service's ``request_defaults``,
where LightX2V's model knobs land) and its size as LightX2V reads it: an explicit size wins
over an aspect ratio sent beside it, LightX2V's aspect-ratio table for Qwen-Image, ``size``
as 'WxH' or [height, width]. In-process: the front door's request building only."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import HTTPException

from controller.app import LocalQueue
from controller.http.frontdoor import FrontDoor
from controller.http.schemas import ImageTaskRequest, VideoTaskRequest
from tests.support.coordinators import make_coordinator


@pytest.fixture
def front(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[FrontDoor]:
    pipeline, defaults = request.param
    co = make_coordinator(None, LocalQueue(8, 4096), pipeline=pipeline)
    door = FrontDoor(co, status_extra=dict, service="controller", defaults=defaults)
    yield door
    door.close()


def built(front: FrontDoor, **body: Any) -> dict[str, Any]:
    cls = VideoTaskRequest if front.pipeline.startswith("wan") else ImageTaskRequest
    return front._generation_request(cls(prompt="a cat", **body))


WAN_DEFAULTS = {"infer_steps": 40, "num_frames": 33, "height": 240, "width": 416,
                "guidance_scale": 5, "fps": 8, "max_sequence_length": 512}


@pytest.mark.parametrize("front", [("wan_i2v", WAN_DEFAULTS)], indirect=True)
def test_request_defaults_fill_what_a_request_leaves_unset(front: FrontDoor) -> None:
    req = built(front)
    assert (req["infer_steps"], req["num_frames"], req["height"], req["width"], req["fps"],
            req["guidance_scale"]) == (40, 33, 240, 416, 8, 5.0)
    req = built(front, infer_steps=4, target_video_length=5, target_shape=[32, 48],
                target_fps=16)
    assert (req["infer_steps"], req["num_frames"], req["height"], req["width"],
            req["fps"]) == (4, 5, 32, 48, 16)


@pytest.mark.parametrize("front", [("wan_t2v", {})], indirect=True)
def test_without_defaults_a_request_is_what_it_was(front: FrontDoor) -> None:
    req = built(front)
    assert (req["infer_steps"], req["height"], req["width"], req["num_frames"]) == (
        50, 480, 832, 81)


@pytest.mark.parametrize("front", [("qwen_t2i", {"aspect_ratio": "16:9"})], indirect=True)
def test_sizes_as_lightx2v_reads_them(front: FrontDoor) -> None:
    assert (built(front)["height"], built(front)["width"]) == (928, 1664)  # the default ratio
    req = built(front, aspect_ratio="3:4")  # LightX2V's table: 1104x1472 (w x h)
    assert (req["height"], req["width"]) == (1472, 1104)
    # LightX2V's T2I request script sends aspect_ratio and target_shape: the shape wins.
    req = built(front, aspect_ratio="16:9", target_shape=[64, 96])
    assert (req["height"], req["width"]) == (64, 96)
    req = built(front, size="96x64")  # OpenAI's and LightX2V's 'WxH'
    assert (req["height"], req["width"]) == (64, 96)
    req = built(front, size=[64, 96])
    assert (req["height"], req["width"]) == (64, 96)
    req = built(front, aspect_ratio="2:1")  # not in the table: the default area at 2:1
    assert req["width"] == 2 * req["height"] or abs(req["width"] - 2 * req["height"]) <= 16
    for bad, message in (({"size": "big"}, "'WxH'"),
                         ({"size": "96x64", "target_shape": [64, 96]}, "not both"),
                         ({"target_shape": [64]}, "[height, width]")):
        with pytest.raises(HTTPException, match=message):
            built(front, **bad)
