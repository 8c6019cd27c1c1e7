"""``i2i_denoise_strength`` in the task schema and the pipeline table: which pipelines take
it, the range, and the wire form (a request without it travels as before)."""

from __future__ import annotations

from typing import Any

import pytest

from contracts.errors import InvalidRequestError
from contracts.pipelines import TASK_SPECS
from contracts.request import GenerationRequest
from workers.models.components import ON_DEMAND, STAGE_COMPONENTS


def req(task: str = "qwen_t2i", **fields: Any) -> GenerationRequest:
    return GenerationRequest(task=task, prompt="a fox", **fields)


@pytest.mark.parametrize("task", ["qwen_t2i", "qwen_i2i", "qwen_i2i_plus"])
@pytest.mark.parametrize("strength", [1e-6, 0.6, 1.0, 1])
def test_qwen_pipelines_take_a_strength(task: str, strength: float) -> None:
    r = req(task, i2i_denoise_strength=strength)
    assert r.i2i_denoise_strength == float(strength)
    assert isinstance(r.i2i_denoise_strength, float)  # 1 from JSON is 1.0
    assert GenerationRequest.from_dict(r.to_dict()) == r


@pytest.mark.parametrize("strength", [0, 0.0, -0.1, 1.01, 2, float("nan"), float("inf"),
                                      True, "0.5"])
def test_strength_out_of_range_is_refused(strength: Any) -> None:
    with pytest.raises(InvalidRequestError, match="i2i_denoise_strength"):
        req(i2i_denoise_strength=strength)


@pytest.mark.parametrize("task", ["wan_t2v", "wan_i2v", "synthetic"])
def test_other_pipelines_refuse_a_strength(task: str) -> None:
    with pytest.raises(InvalidRequestError, match="Qwen-Image pipelines only"):
        req(task, i2i_denoise_strength=0.5)


def test_a_request_without_a_strength_travels_as_before() -> None:
    plain = req().to_dict()
    assert "i2i_denoise_strength" not in plain
    assert req(i2i_denoise_strength=0.25).to_dict()["i2i_denoise_strength"] == 0.25


def test_which_pipelines_take_an_image() -> None:
    takes = {name for name, spec in TASK_SPECS.items() if spec.takes_image}
    assert takes == {"wan_i2v", "wan22_a14b_i2v", "wan22_5b_i2v", "qwen_t2i", "qwen_i2i",
                     "qwen_i2i_plus"}
    assert [n for n, s in TASK_SPECS.items() if s.image_to_image] == ["qwen_t2i"]
    # The T2I encoder reads its VAE only for image-to-image requests.
    assert STAGE_COMPONENTS["qwen_t2i"]["encoder"]["vae"] == ON_DEMAND
    assert all(kind != ON_DEMAND for task, roles in STAGE_COMPONENTS.items()
               for role, parts in roles.items() for kind in parts.values()
               if (task, role) != ("qwen_t2i", "encoder"))
