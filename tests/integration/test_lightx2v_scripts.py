"""A LightX2V user moves in unchanged: its Wan T2V stage configs (their keys as published,
only the model knobs made tiny), a tiny folder in the original Wan2.1 layout, and its request
scripts' three-POST flow against the seed's per-stage ports, on a group of real processes.

Checked: ``--check`` passes on each role's config; the script's flow (Decoder, Transformer,
Encoder, poll the Decoder) gets its video; the Qwen T2I script's shapes (``save_result_path``
alone to the Decoder, ``{}`` to the Transformer); two clients interleaving their POSTs each
get their own task; two that cannot be told apart are both refused, and nothing else
breaks; a single POST to the encoder's port (the front door's) is a task of its own.
"""

from __future__ import annotations

import io
import json
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests  # what LightX2V's request scripts post with
from PIL import Image

from contracts.config import ServiceConfig
from launcher import LocalGroup, port_busy, wait_task
from launcher.role_files import Prepared, prepare
from tests.support.controller import TOKEN
from tests.support.scripts import lightx2v_stage_configs

pytestmark = pytest.mark.integration  # starts a group

ENDPOINT = "/v1/tasks/video/"
# Its Wan T2V script's payload, shortened: a prompt, a Chinese negative prompt, a seed, a
# result path.
PAYLOAD = {"prompt": "Two anthropomorphic cats in boxing gear fight on a stage.",
           "negative_prompt": "镜头晃动\uff0c色调艳丽\uff0c过曝", "seed": 42,
           "save_result_path": "save_results/wan_t2v_disagg.mp4"}
TINY = {"infer_steps": 2, "target_video_length": 5, "target_height": 32, "target_width": 32}
MP4_BOX = b"ftyp"


def free_offset(prep: Prepared) -> int:
    """A port offset under which every port of the group is free, below the kernel's
    ephemeral range and outside Mooncake's own (12000-17000)."""
    ports = [(host, port) for _what, host, port in prep.ports()]
    rng = random.Random()
    for _ in range(200):
        offset = rng.randrange(1000, 32767 - max(p for _h, p in ports))
        if any(12000 <= p + offset <= 17000 for _h, p in ports):
            continue
        if not any(port_busy(h, p + offset) for h, p in ports):
            return offset
    raise RuntimeError("no free port offset")


@pytest.fixture(scope="module")
def group(wan_pairs: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[LocalGroup, Prepared]]:
    work = tmp_path_factory.mktemp("lightx2v-group")
    configs = work / "configs"
    configs.mkdir()
    for name, data in lightx2v_stage_configs().items():
        if name.startswith("wan_t2v_"):
            (configs / f"{name}.json").write_text(json.dumps({**data, **TINY}))
    probe = prepare("wan_t2v", configs, work / "probe", lightx2v_ports=True)
    prep = prepare("wan_t2v", configs, work / "logs", port_offset=free_offset(probe),
                   output_dir=str(work / "results"), lightx2v_ports=True)
    ctl = prep.loaded["controller"]
    # LightX2V's configs ask Mooncake for rdma; without a device, its guide's advice.
    env = {"MOONCAKE_PROTOCOL": "tcp", "DIFFRING_CLUSTER_TOKEN": TOKEN}
    g = LocalGroup({"server": {"host": "127.0.0.1", "port": ctl.server.port}}, work,
                   env=env, files=prep.configs,
                   args={r: ["--model_path", str(wan_pairs / "wan_t2v-original"),
                             "--device", "cpu"] for r in ("encoder", "transformer", "decoder")})
    try:
        g.start_all()
        yield g, prep
    finally:
        g.stop()


def urls(prep: Prepared) -> dict[str, str]:
    ports = prep.loaded["controller"].server.lightx2v_ports
    assert ports is not None
    return {role: f"http://127.0.0.1:{port}" for role, port in ports.items()}


def three_posts(prep: Prepared, decoder: dict[str, Any], transformer: dict[str, Any],
                encoder: dict[str, Any]) -> tuple[str, list[requests.Response]]:
    """The script's three POSTs in its order; the Decoder's task id."""
    u = urls(prep)
    out = [requests.post(f"{u[role]}{ENDPOINT}", json=body, timeout=30)
           for role, body in (("decoder", decoder), ("transformer", transformer),
                              ("encoder", encoder))]
    return out[0].json().get("task_id"), out


def poll(prep: Prepared, task_id: str) -> dict[str, Any]:
    """The script's poll, on the Decoder's port."""
    return wait_task(urls(prep)["decoder"], task_id, timeout=300)


def test_each_role_config_passes_check(group: tuple[LocalGroup, Prepared],
                                      wan_pairs: Path) -> None:
    import dataclasses

    from doctor import run_checks

    _g, prep = group
    for role in ("controller", "encoder", "transformer", "decoder"):
        cfg = ServiceConfig.load(str(prep.configs[role]), role)
        if role != "controller":  # as the launcher's --model_path gives it
            cfg = dataclasses.replace(cfg, model_path=str(wan_pairs / "wan_t2v-original"))
        checks = run_checks(role, cfg, TOKEN * 2, {"MOONCAKE_PROTOCOL": "tcp"})
        failed = [c for c in checks if c.status == "fail" and not c.name.startswith("bind")]
        assert not failed, failed  # (its ports are bound: the group runs)
        if role == "transformer":
            assert any(c.name == "lightx2v" and "sample_shift = 5" in c.detail for c in checks)
            assert any(c.name == "layout" and "wan_original" in c.detail for c in checks)


def test_the_scripts_three_posts_get_their_video(group: tuple[LocalGroup, Prepared]) -> None:
    _g, prep = group
    task_id, (d, t, e) = three_posts(prep, PAYLOAD, PAYLOAD, PAYLOAD)
    assert d.status_code == t.status_code == e.status_code == 200, (d.text, t.text, e.text)
    assert d.json() == {"task_id": task_id, "task_status": "pending",
                        "save_result_path": PAYLOAD["save_result_path"]}
    assert e.json()["task_id"] == task_id
    done = poll(prep, task_id)
    assert done["status"] == "completed", done
    result = httpx.get(f"{urls(prep)['decoder']}/v1/tasks/{task_id}/result", timeout=30)
    assert result.status_code == 200 and MP4_BOX in result.content[:16]
    assert done["save_result_path"].endswith("save_results/wan_t2v_disagg.mp4")


def test_qwen_t2i_scripts_shapes(group: tuple[LocalGroup, Prepared]) -> None:
    _g, prep = group
    full = {**PAYLOAD, "save_result_path": "qwen-shapes.mp4"}
    task_id, responses = three_posts(prep, {"save_result_path": "qwen-shapes.mp4"}, {}, full)
    assert [r.status_code for r in responses] == [200, 200, 200]
    assert poll(prep, task_id)["status"] == "completed"


def test_interleaved_clients_each_get_their_own(group: tuple[LocalGroup, Prepared]) -> None:
    """Two clients' POSTs interleave (each in its own thread, ordered by events): A's
    Decoder, B's Decoder, B's Transformer, A's Transformer, B's Encoder, A's Encoder."""
    _g, prep = group
    u = urls(prep)
    bodies = {"A": {**PAYLOAD, "seed": 1, "save_result_path": "a.mp4"},
              "B": {**PAYLOAD, "seed": 2, "save_result_path": "b.mp4"}}
    order = [("A", "decoder"), ("B", "decoder"), ("B", "transformer"), ("A", "transformer"),
             ("B", "encoder"), ("A", "encoder")]
    turn = [threading.Event() for _ in order]
    got: dict[tuple[str, str], requests.Response] = {}

    def client(name: str) -> None:
        for i, (who, role) in enumerate(order):
            if who != name:
                continue
            turn[i].wait(60)
            got[(who, role)] = requests.post(f"{u[role]}{ENDPOINT}", json=bodies[who],
                                             timeout=30)
            if i + 1 < len(order):
                turn[i + 1].set()

    threads = [threading.Thread(target=client, args=(n,)) for n in bodies]
    for th in threads:
        th.start()
    turn[0].set()
    for th in threads:
        th.join(120)
    assert all(r.status_code == 200 for r in got.values()), {k: r.text for k, r in got.items()}
    ids = {n: got[(n, "decoder")].json()["task_id"] for n in bodies}
    assert ids["A"] != ids["B"]
    for name, task_id in ids.items():
        assert got[(name, "encoder")].json()["task_id"] == task_id
        done = poll(prep, task_id)
        assert done["status"] == "completed"
        assert done["save_result_path"].endswith(bodies[name]["save_result_path"])


def test_flows_that_cannot_be_told_apart_are_refused_and_nothing_breaks(
        group: tuple[LocalGroup, Prepared]) -> None:
    _g, prep = group
    u = urls(prep)
    same = {**PAYLOAD, "save_result_path": "same.mp4"}
    first = requests.post(f"{u['decoder']}{ENDPOINT}", json=same, timeout=30)
    second = requests.post(f"{u['decoder']}{ENDPOINT}", json={**same, "seed": 9}, timeout=30)
    assert first.status_code == 200 and second.status_code == 409
    assert "give each request its own save_result_path" in second.json()["detail"]
    status = requests.get(f"{u['decoder']}/v1/tasks/{first.json()['task_id']}/status",
                          timeout=10).json()
    assert status["status"] == "failed" and "at once" in status["error"]
    late = requests.post(f"{u['encoder']}{ENDPOINT}", json=same, timeout=30)
    assert late.status_code == 409  # neither client's Encoder POST makes a task
    # A Transformer POST with no Decoder POST before it is refused, naming the order.
    lone = requests.post(f"{u['transformer']}{ENDPOINT}", json={**PAYLOAD, "seed": 5,
                                                                 "save_result_path": "z.mp4"},
                         timeout=30)
    assert lone.status_code == 409 and "Decoder first" in lone.json()["detail"]
    # A bad Decoder POST is refused at once, field by field.
    bad = requests.post(f"{u['decoder']}{ENDPOINT}", json={**PAYLOAD, "infer_steps": 0,
                                                            "save_result_path": "bad.mp4"},
                        timeout=30)
    assert bad.status_code == 422 and "infer_steps" in bad.json()["detail"]
    # The group still serves: a single POST to the encoder's port (the front door) is a
    # task of its own, and another three-POST flow completes.
    single = requests.post(f"{u['encoder']}{ENDPOINT}", json={**PAYLOAD, "seed": 3,
                                                               "save_result_path": "one.mp4"},
                           timeout=30)
    assert single.status_code == 200
    assert poll(prep, single.json()["task_id"])["status"] == "completed"
    other = {**PAYLOAD, "save_result_path": "after.mp4"}
    task_id, _responses = three_posts(prep, other, other, other)
    assert poll(prep, task_id)["status"] == "completed"


def test_the_one_process_baseline_opens_the_stage_ports_too(tiny_models: Path,
                                                            tmp_path: Path) -> None:
    """``--service all`` with ``server.lightx2v_ports``: LightX2V's Qwen T2I script's shapes
    (``save_result_path`` alone to the Decoder, ``{}`` to the Transformer, the whole payload
    with ``aspect_ratio`` and ``target_shape`` to the Encoder) on /v1/tasks/image/."""
    from launcher import free_ports, group_config

    transformer, decoder = free_ports(2)
    cfg = group_config("qwen_t2i", str(tiny_models / "qwen_t2i"), tmp_path,
                       request_defaults={"infer_steps": 2})
    cfg["server"]["lightx2v_ports"] = {"encoder": cfg["server"]["port"],
                                       "transformer": transformer, "decoder": decoder}
    with LocalGroup(cfg, tmp_path) as g:
        g.start("all")
        g.wait_http()
        base = "http://127.0.0.1"
        payload = {"prompt": "A cute cat on a wooden table.", "seed": 42,
                   "save_result_path": "qwen_t2i_3way.png", "aspect_ratio": "16:9",
                   "target_shape": [32, 48]}
        d = requests.post(f"{base}:{decoder}/v1/tasks/image/",
                          json={"save_result_path": "qwen_t2i_3way.png"}, timeout=30)
        t = requests.post(f"{base}:{transformer}/v1/tasks/image/", json={}, timeout=30)
        e = requests.post(f"{g.url}/v1/tasks/image/", json=payload, timeout=30)
        assert [d.status_code, t.status_code, e.status_code] == [200, 200, 200], e.text
        task_id = d.json()["task_id"]
        done = wait_task(f"{base}:{decoder}", task_id, timeout=300)
        assert done["status"] == "completed", done
        image = httpx.get(f"{base}:{decoder}/v1/tasks/{task_id}/result", timeout=30).content
        assert Image.open(io.BytesIO(image)).size == (48, 32)  # target_shape beat 16:9
