"""LightX2V's three-POST flow paired into one task (controller/http/lightx2v_flows.py), in
process, with a clock the test drives: pairing on what the POSTs share, interleaved clients,
POSTs that cannot be told apart refused (never crossed), the pairing window."""

from __future__ import annotations

from typing import Any

import pytest

from controller.http.lightx2v_flows import FlowTable, Refused

# LightX2V's Wan T2V request script sends this (less its long negative prompt) to all three.
WAN = {"prompt": "Two cats box on a stage.", "negative_prompt": "blurry", "seed": 42,
       "save_result_path": "save_results/wan_t2v_disagg.mp4"}


def payload(**changes: Any) -> dict[str, Any]:
    return {**WAN, **changes}


def test_the_scripts_flow_is_one_flow_with_the_decoders_task_id() -> None:
    t = FlowTable(60.0)
    flow = t.decoder_post("video", WAN, 0.0)
    assert t.status(flow.task_id, 0.1)["status"] == "pending"
    assert t.transformer_post("video", WAN, 0.2) is flow
    assert t.encoder_post("video", WAN, 0.3) is flow
    t.made(flow)
    assert t.status(flow.task_id, 0.4) is None  # the task answers from now on
    assert t.encoder_post("video", WAN, 0.5) is None  # no flow waits: a task of its own


def test_qwen_t2i_scripts_shapes_pair_on_save_result_path() -> None:
    """Its Qwen T2I script has sent the Decoder only save_result_path, the Transformer {}."""
    t = FlowTable(60.0)
    flow = t.decoder_post("image", {"save_result_path": "a.png"}, 0.0)
    assert t.transformer_post("image", {}, 0.1) is flow
    full = {"prompt": "a cute cat", "seed": 42, "save_result_path": "a.png",
            "aspect_ratio": "16:9", "target_shape": [1536, 2752]}
    assert t.encoder_post("image", full, 0.2) is flow


def test_interleaved_clients_each_get_their_own_flow() -> None:
    t = FlowTable(60.0)
    a, b = payload(seed=1, save_result_path="a.mp4"), payload(seed=2, save_result_path="b.mp4")
    flow_a = t.decoder_post("video", a, 0.0)
    flow_b = t.decoder_post("video", b, 0.1)
    assert t.transformer_post("video", b, 0.2) is flow_b
    assert t.transformer_post("video", a, 0.3) is flow_a
    assert t.encoder_post("video", b, 0.4) is flow_b  # B's Encoder POST first
    assert t.encoder_post("video", a, 0.5) is flow_a
    assert flow_a.task_id != flow_b.task_id
    # Without save_result_path the whole payload is the key: still each its own.
    c, d = {"prompt": "c", "seed": 3}, {"prompt": "d", "seed": 4}
    flow_c, flow_d = t.decoder_post("video", c, 1.0), t.decoder_post("video", d, 1.1)
    assert t.encoder_post("video", d, 1.2) is flow_d and t.encoder_post("video", c, 1.3) is flow_c


def test_posts_that_cannot_be_told_apart_are_refused_never_crossed() -> None:
    t = FlowTable(60.0)
    first = t.decoder_post("video", payload(prompt="mine"), 0.0)
    with pytest.raises(Refused) as err:
        t.decoder_post("video", payload(prompt="theirs"), 0.1)  # the same save_result_path
    assert err.value.status == 409 and "give each request its own save_result_path" in \
        err.value.detail
    status = t.status(first.task_id, 0.2)
    assert status["status"] == "failed" and "at once" in status["error"]
    for post in (t.transformer_post, t.encoder_post):  # both clients' later POSTs
        with pytest.raises(Refused, match="start again from the Decoder POST"):
            post("video", payload(prompt="theirs"), 0.3)
    # Past the window the path is free again.
    flow = t.decoder_post("video", payload(), 61.0)
    assert t.encoder_post("video", payload(), 61.1) is flow


def test_an_encoder_post_that_differs_from_its_decoder_post_is_refused() -> None:
    t = FlowTable(60.0)
    flow = t.decoder_post("video", payload(), 0.0)
    with pytest.raises(Refused, match=r"differs from the Decoder POST of task .* in prompt, seed"):
        t.encoder_post("video", payload(prompt="other", seed=7), 0.1)
    with pytest.raises(Refused, match="was for /v1/tasks/video/"):
        t.encoder_post("image", payload(), 0.2)
    assert t.encoder_post("video", payload(), 0.3) is flow  # the flow still waits


def test_refusals_of_a_transformer_post_and_the_window() -> None:
    t = FlowTable(5.0)
    with pytest.raises(Refused, match=r"POST to the Decoder first|posts to the Decoder first"):
        t.transformer_post("video", {}, 0.0)
    with pytest.raises(Refused, match="POST to the Decoder first"):
        t.transformer_post("video", payload(), 0.0)
    with pytest.raises(Refused, match="must carry what its Encoder POST repeats"):
        t.decoder_post("video", {}, 0.0)
    flow = t.decoder_post("video", payload(task_id="mine-1"), 0.0)
    assert flow.task_id == "mine-1"  # a client-chosen task id is kept, and is the key
    status = t.status("mine-1", 5.5)  # the Encoder POST never came
    assert status["status"] == "failed" and "did not come within 5 s" in status["error"]
    assert t.encoder_post("video", payload(task_id="mine-1"), 5.6) is None
    with pytest.raises(Refused, match="task mine-1 exists already"):
        t.decoder_post("video", payload(task_id="mine-1"), 5.7)
    # LightX2V's per-request room and rank overrides are dropped, not matched on.
    flow = t.decoder_post("video", payload(data_bootstrap_room=3), 6.0)
    assert t.encoder_post("video", payload(disagg_bootstrap_room=9), 6.1) is flow
