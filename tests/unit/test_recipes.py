"""Distilled pipelines' recipes and fused adapters at the front door (in-process).

A service's ``recipe`` (contracts/recipes.py) fills what a request leaves unset below the
service's own ``request_defaults``, and a CFG-distilled recipe refuses a request asking for
guidance, saying why. Without a recipe of its own the front door takes the one its
transformer workers report when they register (a model folder's ``diffring_recipe.json``).
A request naming an adapter the workers run fused is told so (422), and ``GET /v1/loras``
lists what is fused, with the strength.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import HTTPException

from contracts.config import ServiceConfig
from contracts.errors import ConfigError, InvalidRequestError
from contracts.recipes import RECIPE_FILE, RECIPES, check_guidance, folder_recipe, recipe
from controller.app import LocalQueue
from controller.http import dit_offers
from controller.http.frontdoor import FrontDoor
from controller.http.schemas import ImageTaskRequest, VideoTaskRequest
from tests.support.coordinators import make_coordinator


def door(pipeline: str, cfg: dict[str, Any] | None = None) -> FrontDoor:
    """A front door as the controller builds it from a service file."""
    model_cls, task = ("wan2.1", pipeline[4:]) if pipeline.startswith("wan") else (
        "qwen_image", pipeline[5:])
    service = ServiceConfig.from_dict({"model_cls": model_cls, "task": task, **(cfg or {})})
    co = make_coordinator(None, LocalQueue(8, 4096), pipeline=pipeline)
    return FrontDoor(co, status_extra=dict, service="controller",
                     defaults=service.request_defaults, recipe=service.recipe)


@pytest.fixture
def doors() -> Iterator[list[FrontDoor]]:
    made: list[FrontDoor] = []
    yield made
    for d in made:
        d.close()


def built(front: FrontDoor, **body: Any) -> dict[str, Any]:
    cls = VideoTaskRequest if front.pipeline.startswith("wan") else ImageTaskRequest
    return front._generation_request(cls(prompt="a cat", **body))


def test_a_plain_request_gets_the_recipe(doors: list[FrontDoor]) -> None:
    wan = door("wan_t2v", {"recipe": "wan2.1-distill-4step"})
    qwen = door("qwen_t2i", {"recipe": "qwen-image-lightning-8step",
                             "request_defaults": {"infer_steps": 6}})
    doors += [wan, qwen]
    req = built(wan)
    assert (req["infer_steps"], req["guidance_scale"]) == (4, 1.0)
    assert built(wan, infer_steps=8)["infer_steps"] == 8  # the request's own value wins
    req = built(qwen)  # the service's request_defaults win over the recipe's
    assert (req["infer_steps"], req["true_cfg_scale"]) == (6, 1.0)


def test_guidance_on_a_cfg_distilled_recipe_is_refused_with_the_reason(
        doors: list[FrontDoor]) -> None:
    wan = door("wan_i2v", {"recipe": "wan2.1-distill-4step"})
    qwen = door("qwen_i2i", {"recipe": "qwen-image-lightning-4step"})
    doors += [wan, qwen]
    with pytest.raises(HTTPException) as info:
        built(wan, guidance_scale=5.0)
    assert info.value.status_code == 422
    assert "CFG-distilled" in info.value.detail and "guidance_scale 1.0" in info.value.detail
    with pytest.raises(HTTPException, match="true_cfg_scale 4 asks for classifier-free"):
        built(qwen, true_cfg_scale=4.0)
    assert built(wan, guidance_scale=1.0)["guidance_scale"] == 1.0
    # Qwen's other guidance knob is not CFG (guidance-distilled models): left as it is.
    check_guidance(RECIPES["qwen-image-lightning-4step"], 5.0, 1.0)
    with pytest.raises(InvalidRequestError):
        check_guidance(RECIPES["wan2.1-distill-4step"], 3.0, None)


def test_without_a_recipe_the_workers_declared_one_applies(doors: list[FrontDoor]) -> None:
    front = door("wan_t2v")
    doors.append(front)
    assert built(front)["infer_steps"] == 50  # nothing registered: the pipeline's defaults
    front.co.on_register("transformer", "dit-a", 1, "wan_t2v", "s",
                         recipe="wan2.1-distill-4step")
    req = built(front)
    assert (req["infer_steps"], req["guidance_scale"]) == (4, 1.0)
    with pytest.raises(HTTPException, match="CFG-distilled"):
        built(front, guidance_scale=6.0)
    # Workers that disagree: no recipe is assumed (each worker still refuses for itself).
    front.co.on_register("transformer", "dit-b", 2, "wan_t2v", "s")
    assert built(front)["infer_steps"] == 50


def test_fused_adapters_are_reported_and_a_request_naming_one_is_told(
        doors: list[FrontDoor]) -> None:
    front = door("qwen_t2i")
    doors.append(front)
    front.co.on_register("transformer", "dit-a", 1, "qwen_t2i", "s", loras=("style",),
                         fused=(("lightning", 1.0),))
    listed = dit_offers.listing(front.co.registry)
    assert listed["loras"] == [{"name": "style", "workers": ["dit-a"]}]
    assert listed["fused"] == [{"name": "lightning",
                                "workers": [{"worker": "dit-a", "strength": 1.0}]}]
    (worker,) = front.co.registry.by_role()["transformer"]
    assert worker["fused"] == [{"name": "lightning", "strength": 1.0}]
    with pytest.raises(HTTPException) as info:
        built(front, loras=[{"name": "lightning"}])
    assert info.value.status_code == 422
    assert "fused into the transformer workers' weights (dit-a: strength 1)" in \
        info.value.detail
    assert built(front, loras=[{"name": "style", "strength": 0.5}])["loras"]
    with pytest.raises(HTTPException, match="unknown LoRA adapter"):
        built(front, loras=[{"name": "other"}])


def test_recipes_and_fuse_in_the_service_file(tmp_path: Path) -> None:
    cfg = ServiceConfig.from_dict({
        "model_cls": "wan2.1", "task": "t2v", "dtype": "bfloat16",
        "recipe": "wan2.1-distill-4step",
        "transformer": {"lora_dir": str(tmp_path), "linear": "fp8", "weight_storage": "dtype",
                        "lora_fuse": [{"name": "lightx2v_4step", "strength": 1.0}]}})
    assert cfg.transformer.recipe == "wan2.1-distill-4step"
    assert [r.name for r in cfg.transformer.fused] == ["lightx2v_4step"]
    # Written back (a transformer group's ranks read it so) and read again: the same.
    again = ServiceConfig.from_dict(json.loads(json.dumps(dataclasses.asdict(cfg))))
    assert again == cfg
    for data, message in [
        ({"model_cls": "qwen_image", "task": "t2i", "recipe": "wan2.1-distill-4step"},
         "is for the wan pipelines"),
        ({"recipe": "turbo"}, "recipe must be one of"),
        ({"transformer": {"lora_fuse": [{"name": "a"}]}}, "lora_fuse names adapters of"),
        ({"transformer": {"recipe": "wan2.1-distill-4step"}},
         "unknown config key transformer.recipe"),
    ]:
        with pytest.raises(ConfigError, match=message):
            ServiceConfig.from_dict(data)


def test_a_model_folder_declares_its_recipe(tmp_path: Path) -> None:
    assert folder_recipe(tmp_path) is None
    (tmp_path / RECIPE_FILE).write_text('{"recipe": "qwen-image-lightning-8step"}')
    assert folder_recipe(tmp_path) == "qwen-image-lightning-8step"
    found = recipe(folder_recipe(tmp_path), "qwen")
    assert found is not None and found.scheduler["use_dynamic_shifting"] is True
    (tmp_path / RECIPE_FILE).write_text('{"recipe": "nope"}')
    with pytest.raises(ConfigError, match="must hold"):
        folder_recipe(tmp_path)
