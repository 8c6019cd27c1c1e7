"""The request-level DiT options at the edge, in-process: the ``loras`` / ``cache`` request
fields and their refusals, the transformer options that cannot combine, the cache
parameters against diffusers' config classes (the multipart form the ``openai`` package
sends for ``extra_body``: tests/unit/test_forms.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from contracts.dit_request import CACHE_KINDS
from contracts.errors import ConfigError, InvalidRequestError
from contracts.request import GenerationRequest
from contracts.stage_options import StageOptions

_WORKER_SIDE = {"current_timestep_callback", "attention_weight_callback",
                "low_frequency_weight_callback", "high_frequency_weight_callback",
                "_unconditional_conditional_input_kwargs_identifiers"}


def test_cache_parameters_are_diffusers_fields() -> None:
    """The request's cache parameters are the fields of diffusers' config classes (less
    the callbacks the worker provides), so a diffusers user's config reads the same."""
    import diffusers.hooks as hooks

    for kind, (cls_name, params) in CACHE_KINDS.items():
        fields = {f.name for f in dataclasses.fields(getattr(hooks, cls_name))}
        assert set(params) == fields - _WORKER_SIDE, kind


def test_request_fields_round_trip_and_refusals() -> None:
    import msgpack

    req = GenerationRequest(task="qwen_t2i", prompt="x",
                            loras=[{"name": "style", "strength": 0.5}, {"name": "b"}],
                            cache={"kind": "mag_cache", "mag_ratios": [1, 1.5]})
    wire = msgpack.unpackb(msgpack.packb(req.to_dict()))
    assert wire["loras"] == [{"name": "style", "strength": 0.5}, {"name": "b", "strength": 1.0}]
    assert wire["cache"] == {"kind": "mag_cache", "mag_ratios": [1.0, 1.5]}
    assert GenerationRequest.from_dict(wire) == req
    plain = GenerationRequest(task="qwen_t2i", prompt="x").to_dict()
    assert "loras" not in plain and "cache" not in plain  # travels as before
    off = GenerationRequest.from_dict({**plain, "cache": {"kind": "none"}})
    assert off.cache_off and GenerationRequest.from_dict(off.to_dict()).cache_off
    bad: list[tuple[dict[str, Any], str]] = [
        ({"loras": [{"name": "../x"}]}, "file name without '.safetensors'"),
        ({"loras": [{"name": "a", "strength": 4.5}]}, "between -4 and 4, got 4.5"),
        ({"loras": [{"name": "a", "strength": float("nan")}]}, "finite number"),
        ({"loras": [{"name": "a"}, {"name": "a"}]}, "twice"),
        ({"loras": [{"name": "a", "weight": 1}]}, "unknown field(s) weight"),
        ({"loras": [{"name": str(i)} for i in range(5)]}, "at most 4 adapters"),
        ({"loras": "style"}, "must be a list"),
        ({"cache": {"kind": "teacache"}}, "cache.kind must be one of first_block_cache"),
        ({"cache": {"kind": "first_block_cache", "thresh": 1}}, "it takes threshold"),
        ({"cache": {"kind": "first_block_cache", "threshold": -1}}, "must be >= 0"),
        ({"cache": {"kind": "mag_cache"}}, "needs mag_ratios"),
        ({"cache": {"kind": "pyramid_attention_broadcast",
                    "spatial_attention_timestep_skip_range": [800, 100]}}, "low <= high"),
    ]
    for change, message in bad:
        with pytest.raises(InvalidRequestError) as info:
            GenerationRequest.from_dict({**plain, **change})
        assert message in str(info.value), change


def test_stage_options_refuse_what_cannot_work() -> None:
    StageOptions(lora_dir="/x", cache={"kind": "first_block_cache"}).check_role("transformer")
    # Adapters work on every weight format (issue 33): these combine now.
    for kw in ({"offload": "block"}, {"weight_storage": "fp8"}, {"linear": "fp8"}):
        StageOptions(lora_dir="/x", **kw)
    for kw, message in [({"lora_fuse": ({"name": "a"},)}, "lora_fuse names adapters of lora_dir"),
                        ({"lora_dir": "/x", "lora_fuse": ({"name": "../a"},)}, "lora_fuse: "),
                        ({"lora_dir": "/x", "lora_fuse": ({"name": "a", "strength": 9},)},
                         "between -4 and 4"),
                        ({"cache": {"kind": "nope"}}, "cache.kind must be one of"),
                        ({"lora_max_loaded": 0}, "at least 1")]:
        with pytest.raises(ConfigError, match=message):
            StageOptions(**kw)
    with pytest.raises(ConfigError, match="apply to the transformer stage only"):
        StageOptions(lora_dir="/x").check_role("encoder")
    from contracts.config import ServiceConfig

    with pytest.raises(ConfigError, match="cannot be combined with compile"):
        ServiceConfig.from_dict({"compile": True, "warmup_shapes": ["32x32x5"],
                                 "transformer": {"cache": {"kind": "first_block_cache"}}})
