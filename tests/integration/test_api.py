"""The front door's API: every endpoint, every refusal, backpressure, cancel, metrics."""

from __future__ import annotations

import base64
import io
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from launcher import LocalGroup, free_ports, group_config, wait_task
from tests.support.controller import run_controller_to_exit
from tests.support.groups import start_group
from tests.support.http import post
from tests.support.waits import wait_log

pytestmark = pytest.mark.integration  # starts processes or servers

SMALL = {"height": 32, "width": 48, "infer_steps": 2}


@pytest.fixture(scope="module")
def t2i(tiny_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalGroup]:
    """A controller with NO workers: tasks queue up and stay queued."""
    with start_group(
        "qwen_t2i", tiny_models, tmp_path_factory.mktemp("api-t2i"), workers=(),
        disagg_config={"rdma_buffer_slots": 4, "rdma_buffer_slot_size": 2048},
        release_ahead=None,  # every task to the ring at once: a full ring answers 429
    ) as group:
        yield group


@pytest.fixture(scope="module")
def i2i(tiny_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalGroup]:
    with start_group("qwen_i2i", tiny_models, tmp_path_factory.mktemp("api-i2i"),
                     workers=()) as group:
        yield group


def detail(r: httpx.Response) -> str:
    out: str = r.json()["detail"]
    return out


def cancel_all(group: LocalGroup) -> None:
    for t in httpx.get(f"{group.url}/v1/tasks/", params={"limit": 1000}).json()["tasks"]:
        httpx.delete(f"{group.url}/v1/tasks/{t['task_id']}")


# -- accepted tasks, status, list, queue, cancel ----------------------------------------------
def test_create_status_list_queue_and_cancel(t2i: LocalGroup) -> None:
    r = post(t2i.url, "image", {"prompt": "a red cube", "task_id": "api-1", **SMALL,
                                "save_result_path": "cubes/red.png"})
    assert r.status_code == 200, r.text
    assert r.json() == {"task_id": "api-1", "task_status": "pending",
                        "save_result_path": "cubes/red.png"}
    r2 = post(t2i.url, "image", {"prompt": "a blue cube", "task_id": "api-2", **SMALL})
    assert r2.status_code == 200
    st = httpx.get(f"{t2i.url}/v1/tasks/api-2/status").json()
    assert st["status"] == "pending" and st["stage"] == "queued"
    assert st["queue_position"] == 2 and st["error"] is None
    listing = httpx.get(f"{t2i.url}/v1/tasks/", params={"limit": 1}).json()
    assert listing["total"] >= 2 and len(listing["tasks"]) == 1
    q = httpx.get(f"{t2i.url}/v1/tasks/queue/status").json()
    assert {"api-1", "api-2"} <= set(q["queue"]) and q["rings"]["request"]["depth"] >= 2
    assert httpx.get(f"{t2i.url}/v1/tasks/api-1/result").status_code == 404
    svc = httpx.get(f"{t2i.url}/v1/service/status").json()
    assert svc["service_status"] == "busy" and svc["pipeline"] == "qwen_t2i"
    assert set(svc["workers"]) == {"encoder", "transformer", "decoder"}
    d = httpx.delete(f"{t2i.url}/v1/tasks/api-1").json()
    assert d["stop_status"] == "success"
    st = httpx.get(f"{t2i.url}/v1/tasks/api-1/status").json()
    assert st["status"] == "cancelled" and st["error_type"] == "cancelled"
    assert httpx.delete(f"{t2i.url}/v1/tasks/api-1").json()["stop_status"] == "do_nothing"
    assert httpx.delete(f"{t2i.url}/v1/tasks/nope").json()["stop_status"] == "error"
    assert httpx.get(f"{t2i.url}/v1/tasks/nope/status").status_code == 404
    filtered = httpx.get(f"{t2i.url}/v1/tasks/", params={"status": "cancelled"}).json()
    assert [t["task_id"] for t in filtered["tasks"]] == ["api-1"]
    cancel_all(t2i)


def test_health_and_docs(t2i: LocalGroup) -> None:
    assert httpx.get(f"{t2i.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{t2i.url}/docs").status_code == 200
    spec = httpx.get(f"{t2i.url}/openapi.json").json()
    assert "/v1/tasks/image/" in spec["paths"] and "/v1/tasks/{task_id}" in spec["paths"]


# -- refusals ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"prompt": "x", "colour": "red"}, "unknown field 'colour'"),
        ({"prompt": "x", "infer_steps": 0}, "infer_steps"),
        ({"prompt": "x", "infer_steps": 100000}, "infer_steps"),
        ({"prompt": "x", "seed": -1}, "seed"),
        ({"prompt": "x", "height": 40, "width": 48}, "multiple of 16"),
        ({"prompt": "x", "aspect_ratio": "wide"}, "aspect_ratio"),
        ({"prompt": "x", "aspect_ratio": "0:9"}, "aspect_ratio"),
        ({"prompt": "x", "lora_strength": 0.5}, "lora_strength needs lora_name"),
        ({"prompt": "x", "loras": [{"name": "a", "strength": 9}]}, "between -4 and 4"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x", "image_path": "aGVsbG8="}, "takes no input image"),
        ({"prompt": "x", "task_id": "../evil"}, "task_id"),
    ],
)
def test_bad_input_is_422_with_reason(t2i: LocalGroup, body: dict[str, Any], needle: str) -> None:
    r = post(t2i.url, "image", body)
    assert r.status_code == 422, r.text
    assert needle in detail(r)


def test_video_length_must_be_4k_plus_1(tiny_models: Path, tmp_path: Path) -> None:
    with start_group("wan_t2v", tiny_models, tmp_path, workers=()) as group:
        r = post(group.url, "video", {"prompt": "x", "target_video_length": 10})
        assert r.status_code == 422 and "4k+1" in detail(r)
        r = post(group.url, "image", {"prompt": "x"})
        assert r.status_code == 400 and "serves wan_t2v" in detail(r)


def test_duplicate_task_id_is_409(t2i: LocalGroup) -> None:
    assert post(t2i.url, "image", {"prompt": "x", "task_id": "dup", **SMALL}).status_code == 200
    r = post(t2i.url, "image", {"prompt": "y", "task_id": "dup", **SMALL})
    assert r.status_code == 409 and "dup" in detail(r)
    cancel_all(t2i)


@pytest.mark.parametrize("path", ["../x.png", "/etc/passwd", "a/../../b.png", "C:\\x.png"])
def test_escaping_result_path_is_400(t2i: LocalGroup, path: str) -> None:
    r = post(t2i.url, "image", {"prompt": "x", "save_result_path": path, **SMALL})
    assert r.status_code == 400
    assert "output folder" in detail(r) or "must be relative" in detail(r)


def test_request_too_large_for_slot_is_413(t2i: LocalGroup) -> None:
    r = post(t2i.url, "image", {"prompt": "x" * 5000, **SMALL})
    assert r.status_code == 413
    assert "limit 2024 bytes" in detail(r) and "payload of" in detail(r)


def test_sync_endpoint_times_out_with_504(t2i: LocalGroup) -> None:
    r = httpx.post(f"{t2i.url}/v1/tasks/image/sync",
                   json={"prompt": "x", **SMALL, "timeout_seconds": 0.3,
                         "poll_interval_seconds": 0.05}, timeout=30)
    assert r.status_code == 504 and "did not finish" in detail(r)
    cancel_all(t2i)


def test_full_request_ring_is_429_and_nothing_half_accepted(t2i: LocalGroup) -> None:
    cancel_all(t2i)
    # The ring has 4 slots and no encoder drains it; cancelled tasks still hold their slots
    # until an encoder claims and drops them, so count the free ones from the ring itself.
    ring = httpx.get(f"{t2i.url}/v1/tasks/queue/status").json()["rings"]["request"]
    free = ring["slot_count"] - ring["depth"]
    before = httpx.get(f"{t2i.url}/v1/tasks/").json()["total"]
    codes = [post(t2i.url, "image", {"prompt": f"p{i}", "task_id": f"fill-{i}", **SMALL})
             for i in range(free + 2)]
    assert [c.status_code for c in codes] == [200] * free + [429, 429]
    assert int(codes[-1].headers["Retry-After"]) >= 1
    assert "request ring is full" in detail(codes[-1])
    after = httpx.get(f"{t2i.url}/v1/tasks/").json()
    assert after["total"] == before + free
    assert httpx.get(f"{t2i.url}/v1/tasks/fill-{free}/status").status_code == 404
    cancel_all(t2i)


def test_image_inputs_are_checked(i2i: LocalGroup, input_png: bytes) -> None:
    base = {"prompt": "edit", "height": 32, "width": 32, "infer_steps": 2}
    cases = [
        ({}, 422, "needs an input image"),
        ({"image_path": "http://example.com/cat.png"}, 422, "scheme 'http' is not allowed"),
        ({"image_path": "file:///etc/passwd"}, 422, "scheme 'file' is not allowed"),
        ({"image_path": "/tmp/cat.png"}, 422, "file path"),
        ({"image_path": "!!notbase64!!"}, 422, "not valid base64"),
        ({"image_path": base64.b64encode(b"not an image").decode()}, 422, "does not decode"),
    ]
    for extra, code, needle in cases:
        r = post(i2i.url, "image", {**base, **extra})
        assert r.status_code == code and needle in detail(r), (extra, r.text)
    data_url = "data:image/png;base64," + base64.b64encode(input_png).decode()
    r = post(i2i.url, "image", {**base, "image_path": data_url, "task_id": "img-ok"})
    assert r.status_code == 200, r.text
    httpx.delete(f"{i2i.url}/v1/tasks/img-ok")


# -- a whole group: sync result, cancel of a running task, metrics ---------------------------
def metrics_of(port: int) -> dict[str, list[Any]]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_group_sync_cancel_running_and_metrics(tiny_models: Path, tmp_path: Path) -> None:
    m_ctl, m_enc, m_dit, m_dec = free_ports(4)
    cfg = group_config("qwen_t2i", str(tiny_models / "qwen_t2i"), tmp_path)
    group = LocalGroup(cfg, tmp_path)

    def with_metrics(port: int) -> dict[str, Any]:
        return {"server": {**cfg["server"], "metric_port": port}}

    gate = tmp_path / "cancel-gate"
    gate.touch()
    try:
        group.start("controller", with_metrics(m_ctl))
        group.wait_http()
        group.start("encoder", with_metrics(m_enc))
        # Held after the long task's second step (after the sync task's steps), for the cancel.
        held = f"dit.step:hold={gate}:nth={SMALL['infer_steps'] + 2}"
        dit = group.start("transformer", {**with_metrics(m_dit), "faults": held})
        group.start("decoder", with_metrics(m_dec))
        group.wait_workers({"encoder": 1, "transformer": 1, "decoder": 1})

        r = httpx.post(f"{group.url}/v1/tasks/image/sync", json={"prompt": "sync", **SMALL},
                       timeout=300)
        assert r.status_code == 200 and r.headers["content-type"] == "image/png"
        from PIL import Image

        assert Image.open(io.BytesIO(r.content)).size == (48, 32)

        # A longer task, cancelled while its DiT is held after step 2: the worker hears of
        # it, and once released stops at the step boundary it is at.
        r = post(group.url, "image", {"prompt": "long", "task_id": "long", **SMALL,
                                      "infer_steps": 8})
        assert r.status_code == 200
        wait_log(dit, "fault point dit.step fired", timeout=300)
        deadline = time.monotonic() + 120
        while (st := httpx.get(f"{group.url}/v1/tasks/long/status").json())["step"] < 2:
            assert time.monotonic() < deadline, st  # the report of step 2 is on its way
            time.sleep(0.05)
        assert st["step"] == 2 and "denoising step" in st["progress"], st
        assert httpx.delete(f"{group.url}/v1/tasks/long").json()["stop_status"] == "success"
        wait_log(dit, "task long: the controller asked to cancel it", timeout=120)
        gate.unlink()
        st = wait_task(group.url, "long", timeout=120)
        assert st["status"] == "cancelled" and st["step"] == 2, st
        # ... and every worker's staging pool is empty again: its buffers were freed.
        deadline = time.monotonic() + 30
        for port in (m_enc, m_dit, m_dec):
            while True:
                used = metrics_of(port)["diffring_staging_pool_used_bytes"][0].value
                if used == 0:
                    break
                assert time.monotonic() < deadline, (port, used)
                time.sleep(0.2)

        # Every service's metrics parse, and carry what an operator looks for.
        ctl = metrics_of(m_ctl)
        for name in ("diffring_http_requests", "diffring_ring_depth", "diffring_task_e2e_seconds",
                     "diffring_workers", "diffring_worker_heartbeat_age_seconds",
                     "diffring_task_stage_seconds"):
            assert name in ctl, name
        codes = {(s.labels["endpoint"], s.labels["code"]) for s in ctl["diffring_http_requests"]}
        assert ("/v1/tasks/image/sync", "200") in codes
        dit = metrics_of(m_dit)
        for name in ("diffring_stage_seconds", "diffring_ring_claim_seconds",
                     "diffring_transfer_bytes", "diffring_staging_pool_used_bytes",
                     "diffring_worker_heartbeats"):
            assert name in dit, name
        pulled = [s.value for s in dit["diffring_transfer_bytes"] if s.name.endswith("_total")]
        assert pulled and pulled[0] > 0
    finally:
        group.stop()


def test_controller_holds_its_metric_port_before_it_opens_ports_of_its_own(
        tiny_models: Path, tmp_path: Path) -> None:
    """The metric port and the control port are bound at start with the front door's,
    before the Mooncake engine binds or connects from ephemeral ports, so it cannot take
    them. (A CI run once failed with "controller metrics endpoint cannot listen ...: held by
    pid N", N the controller itself: a port of its own had taken the one the test chose.)
    Held where all its ports are open (fault point ``controller.ports``), the controller
    already holds the metric port: binding it fails."""
    (mport,) = free_ports(1)
    gate = tmp_path / "ports-gate"
    gate.touch()
    cfg = group_config("qwen_t2i", str(tiny_models / "qwen_t2i"), tmp_path)
    with LocalGroup(cfg, tmp_path) as group:
        ctl = group.start("controller", {"server": {**cfg["server"], "metric_port": mport},
                                         "faults": f"controller.ports:hold={gate}"})
        wait_log(ctl, "fault point controller.ports fired")
        for port in (mport, cfg["disagg_config"]["control_port"]):
            with socket.socket() as probe, pytest.raises(OSError):
                probe.bind(("127.0.0.1", port))
        gate.unlink()
        group.wait_http()
        assert "diffring_ring_depth" in metrics_of(mport)


def test_metric_port_in_use_fails_fast_naming_holder(tiny_models: Path, tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        cfg = group_config("qwen_t2i", str(tiny_models / "qwen_t2i"), tmp_path)
        cfg["server"]["metric_port"] = port
        out = run_controller_to_exit(tmp_path, cfg)
    assert out.returncode == 2
    assert f"controller metrics endpoint cannot listen on 127.0.0.1:{port}" in out.stderr
    assert f"held by pid {os.getpid()}" in out.stderr
