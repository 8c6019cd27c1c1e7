"""LoRA adapters and step caches through a real 1/1/1 Qwen T2I group on loopback (processes
started and stopped here, by pid): requests carry adapters and a cache end to end and give
diffusers' pixels; the listing and the front door's refusals. The request fields' own
checks: tests/unit/test_dit_request.py.
"""

from __future__ import annotations

import base64
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from contracts.request import GenerationRequest
from launcher import LocalGroup, wait_task
from tests.support.groups import start_group
from tests.support.http import pixels, post_ok, result

warnings.filterwarnings("ignore", category=DeprecationWarning, module="openai")
pytestmark = pytest.mark.integration  # a live group, the tiny models

# -- a live group -------------------------------------------------------------------------------
SMALL = {"height": 32, "width": 48, "infer_steps": 3, "seed": 7}
PROMPT = "a red fox in the snow"
CACHE = {"kind": "first_block_cache", "threshold": 0.6}


@pytest.fixture(scope="module")
def group(tiny_models: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[LocalGroup, Path]]:
    from diffusers import QwenImageTransformer2DModel

    from scripts.bench.lora_kit import make_adapter

    wd = tmp_path_factory.mktemp("lora-group")
    folder = wd / "loras"
    dit = QwenImageTransformer2DModel.from_pretrained(tiny_models / "qwen_t2i" / "transformer")
    make_adapter(dit, folder / "style.safetensors", rank=4, alpha=8, seed=1)
    make_adapter(dit, folder / "detail.safetensors", rank=2, seed=2, scale=0.3)
    (folder / "broken.safetensors").write_bytes(b"not a safetensors file at all")
    with start_group("qwen_t2i", tiny_models, wd, transformer={"lora_dir": str(folder)}) as g:
        yield g, folder


def _reference(tiny_models: Path, folder: Path, loras: list[tuple[str, float]],
               cache: dict[str, Any] | None = None) -> np.ndarray:
    from tests.support.models import diffusers_reference, reference_cache, with_adapters
    from workers.models.media import to_uint8

    req = GenerationRequest(task="qwen_t2i", prompt=PROMPT, **SMALL)

    def setup(pipe: Any) -> None:
        if loras:
            with_adapters(folder, loras)(pipe)
        if cache:
            reference_cache(cache, req.infer_steps or 0)(pipe)

    return to_uint8(diffusers_reference(tiny_models, req, None, "float32", setup=setup))


def _run(g: LocalGroup, body: dict[str, Any]) -> dict[str, Any]:
    task_id = post_ok(g.url, "image", {"prompt": PROMPT, **SMALL, **body})
    return wait_task(g.url, task_id, timeout=300)


def _result(g: LocalGroup, st: dict[str, Any]) -> np.ndarray:
    assert st["status"] == "completed", st
    return pixels(result(g.url, st["task_id"]), "png")


def test_listing_and_refusals(group: tuple[LocalGroup, Path]) -> None:
    g, _ = group
    listing = httpx.get(f"{g.url}/v1/loras").json()
    assert [x["name"] for x in listing["loras"]] == ["broken", "detail", "style"]
    assert listing["caches"] == ["first_block_cache", "mag_cache", "taylorseer_cache"]
    status = httpx.get(f"{g.url}/v1/service/status").json()
    assert [x["name"] for x in status["loras"]] == ["broken", "detail", "style"]
    assert status["workers"]["transformer"][0]["loras"] == ["broken", "detail", "style"]
    for body, code, message in [
        ({"lora_name": "nope"}, 422, "unknown LoRA adapter(s) nope; the transformer workers "
                                     "serve broken, detail, style"),
        ({"loras": [{"name": "style", "strength": 9}]}, 422, "between -4 and 4"),
        ({"lora_strength": 0.5}, 422, "lora_strength needs lora_name"),
        ({"lora_name": "style", "loras": [{"name": "detail"}]}, 422, "not both"),
        ({"cache": {"kind": "pyramid_attention_broadcast"}}, 422,
         "cache kind 'pyramid_attention_broadcast' is not run by the transformer workers"),
    ]:
        r = httpx.post(f"{g.url}/v1/tasks/image/", json={"prompt": "x", **body}, timeout=30)
        assert r.status_code == code, r.text
        assert message in r.json()["detail"], r.text
    oc = openai.OpenAI(api_key="unused", base_url=f"{g.url}/v1", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as info:
        oc.images.generate(prompt="x", extra_body={"loras": [{"name": "nope"}]})
    assert info.value.body["param"] == "loras"  # type: ignore[index]
    assert "unknown LoRA adapter(s) nope" in info.value.body["message"]  # type: ignore[index]


def test_requests_carry_adapters_and_caches_end_to_end(
    tiny_models: Path, group: tuple[LocalGroup, Path]
) -> None:
    """Through the front door, the rings and the three stage processes: a request with an
    adapter (LightX2V's lora_name), with two (loras), a cached one through the openai
    client, and plain ones between them, each with diffusers' pixels; a corrupt adapter
    file fails its request, naming the file, and the worker serves the next."""
    g, folder = group
    plain = _reference(tiny_models, folder, [])
    assert np.array_equal(_result(g, _run(g, {})), plain)
    one = _result(g, _run(g, {"lora_name": "style", "lora_strength": 0.7}))
    assert np.array_equal(one, _reference(tiny_models, folder, [("style", 0.7)]))
    assert not np.array_equal(one, plain)
    two = _result(g, _run(g, {"loras": [{"name": "style", "strength": 0.7},
                                        {"name": "detail", "strength": 1.3}]}))
    assert np.array_equal(two, _reference(tiny_models, folder, [("style", 0.7),
                                                                ("detail", 1.3)]))
    assert np.array_equal(_result(g, _run(g, {})), plain)

    failed = _run(g, {"lora_name": "broken"})
    assert failed["status"] == "failed", failed
    assert "broken.safetensors" in failed["error"] and "cannot be read" in failed["error"]
    assert np.array_equal(_result(g, _run(g, {})), plain)

    oc = openai.OpenAI(api_key="unused", base_url=f"{g.url}/v1", max_retries=0, timeout=300)
    out = oc.images.generate(prompt=PROMPT, size="48x32", extra_body={
        "seed": SMALL["seed"], "infer_steps": SMALL["infer_steps"],
        "loras": [{"name": "detail", "strength": 0.5}], "cache": CACHE})
    assert out.data is not None and out.data[0].b64_json is not None
    cached = pixels(base64.b64decode(out.data[0].b64_json), "png")
    assert np.array_equal(cached, _reference(tiny_models, folder, [("detail", 0.5)], CACHE))
    assert np.array_equal(_result(g, _run(g, {})), plain)
