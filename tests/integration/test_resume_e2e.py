"""A lost worker costs one stage, not the request (window 8 of controller.ownership.coordinator),
with real processes on loopback: a DiT killed at a fault point resumes on another DiT from its
last checkpoint -- the encoder does not run again -- and gives the bytes of an uninterrupted
run; a decoder killed after the handoff re-runs only the decoder from the kept final
latents. Every process is started and stopped here by pid."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from httpx_sse import connect_sse
from prometheus_client.parser import text_string_to_metric_families

from launcher import LocalGroup, Service, free_ports, group_config, wait_task
from tests.support.http import post_ok, result, status
from tests.support.waits import wait_log

pytestmark = pytest.mark.integration  # starts processes or servers

WAN = {"prompt": "a fox in the snow", "seed": 5, "height": 32, "width": 32,
       "target_video_length": 5, "target_fps": 8, "infer_steps": 8}
SYNTH = {"prompt": "a synthetic test", "seed": 3, "infer_steps": 8}


def wait_status(group: LocalGroup, tid: str, ok: Any, what: str, timeout: float = 300
                ) -> dict[str, Any]:
    """Until ``ok(status)`` (a bound, not a pause: the event is what is waited for)."""
    deadline = time.monotonic() + timeout
    while True:
        st = status(group.url, tid)
        if ok(st):
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"task {tid}: no {what} after {timeout} s: {st}")
        time.sleep(0.05)


def wait_dead(svc: Service, timeout: float = 300) -> int:
    try:
        return svc.proc.wait(timeout)
    except Exception:
        raise AssertionError(f"{svc.role} never died:\n{svc.log()[-3000:]}") from None


def test_dit_killed_resumes_from_its_last_checkpoint_byte_identical(
        tiny_models: Path, tmp_path: Path) -> None:
    """Wan2.1 T2V (UniPC: the scheduler with history): the DiT dies right after its second
    kept checkpoint (fault point ``dit.checkpointed``); the other DiT resumes from exactly
    that step, the encoder never runs again, and the MP4 equals an uninterrupted run's byte
    for byte.

    One checkpoint is in flight at most, and a tiny model's steps are faster than a send on
    a loaded machine: left alone, the loop can reach its end before the first is kept (the
    second one sent is then the final latents). So the loop is held at its second step
    boundary (``dit.step`` ``hold``) until the DiT logs the first kept: the second is then
    of step 2, whatever the load."""
    cfg = group_config("wan_t2v", str(tiny_models / "wan_t2v"), tmp_path, lease_timeout_s=5.0,
                       heartbeat_interval_s=0.5, video_threads=1)
    ckpt = {"transformer": {"checkpoint_every_steps": 1}}
    gate = tmp_path / "step-2-gate"
    gate.touch()
    with LocalGroup(cfg, tmp_path) as group:
        group.start("controller")
        group.wait_http()
        group.start("encoder")
        group.start("decoder")
        faulty = group.start("transformer", {
            **ckpt, "faults": f"dit.step:hold={gate}:nth=2,dit.checkpointed:exit:nth=2"})
        group.wait_workers({"encoder": 1, "decoder": 1, "transformer": 1}, timeout=600)
        post_ok(group.url, "video", {**WAN, "task_id": "resumed"})
        wait_log(faulty, "task resumed: checkpoint of step 1/8 kept", timeout=300)
        gate.unlink()
        assert wait_dead(faulty) == -signal.SIGKILL
        healthy = group.start("transformer", ckpt)
        final = wait_task(group.url, "resumed", timeout=600)
        # The same request, never interrupted.
        post_ok(group.url, "video", {**WAN, "task_id": "plain"})
        plain = wait_task(group.url, "plain", timeout=600)
        controller_log = group.services[0].log()
        resumed_bytes, plain_bytes = result(group.url, "resumed"), result(group.url, "plain")
        healthy_log = healthy.log()
    assert final["status"] == "completed" and plain["status"] == "completed", final
    kept = [int(step) for step in re.findall(
        r"task resumed: (?:checkpoint|final latents) of step (\d+)/8 kept from", controller_log)]
    assert kept[:2] == [1, 2], controller_log[-3000:]  # the killed DiT's (then the healthy's)
    assert (final["attempt"], final["resumes"], final["resumed_from"], final["failures"]) == (
        2, 1, 2, 0), final
    assert "task resumed: resuming after step 2 of 8" in healthy_log
    assert controller_log.count("task resumed stage=encoding") == 1  # the encoder ran once
    assert resumed_bytes == plain_bytes


def test_decoder_lost_after_the_handoff_reruns_only_the_decoder(
        tiny_models: Path, tmp_path: Path) -> None:
    """The decoder dies as it starts decoding; the controller's kept final latents go to
    the next decoder: no encoder, no DiT step runs again."""
    cfg = group_config("synthetic", str(tiny_models / "synthetic"), tmp_path,
                       lease_timeout_s=5.0, heartbeat_interval_s=0.5)
    with LocalGroup(cfg, tmp_path) as group:
        group.start("controller")
        group.wait_http()
        group.start("encoder")
        dit = group.start("transformer", {"transformer": {"checkpoint_every_steps": 4}})
        faulty = group.start("decoder", {"faults": "worker.stage:exit"})
        group.wait_workers({"encoder": 1, "decoder": 1, "transformer": 1}, timeout=300)
        os.kill(faulty.proc.pid, signal.SIGSTOP)  # claims nothing until the latents are kept
        post_ok(group.url, "image", {**SYNTH, "task_id": "dec"})
        wait_status(group, "dec", lambda st: st["checkpoint_step"] == 8
                    and st["stage"] == "phase2", "final latents kept")
        os.kill(faulty.proc.pid, signal.SIGCONT)
        assert wait_dead(faulty) == -signal.SIGKILL
        group.start("decoder")
        final = wait_task(group.url, "dec", timeout=300)
        post_ok(group.url, "image", {**SYNTH, "task_id": "ref"})
        ref = wait_task(group.url, "ref", timeout=300)
        controller_log = group.services[0].log()
        same = result(group.url, "dec") == result(group.url, "ref")
        dit_log = dit.log()
    assert final["status"] == "completed" and ref["status"] == "completed", final
    assert (final["attempt"], final["resumes"], final["resumed_from"], final["failures"]) == (
        2, 1, 8, 0), final
    assert controller_log.count("task dec stage=encoding") == 1
    assert controller_log.count("task dec stage=denoising") == 1
    assert len(re.findall(r"task dec stage=transformer worker=\S+ done", dit_log)) == 1
    assert same


def test_sigterm_hands_the_task_back_at_the_next_step_boundary(
        tiny_models: Path, tmp_path: Path) -> None:
    """SIGTERM arrives in the DiT after its third step (fault point ``dit.step`` with
    ``signal=TERM``): it checkpoints that step, hands the task back uncharged and exits 0
    instead of finishing the remaining steps; the next DiT resumes from step 3."""
    cfg = group_config("synthetic", str(tiny_models / "synthetic"), tmp_path,
                       lease_timeout_s=5.0, heartbeat_interval_s=0.5)
    ckpt = {"transformer": {"checkpoint_every_steps": 100}}  # no periodic one: the drain's
    with LocalGroup(cfg, tmp_path) as group:
        group.start("controller")
        group.wait_http()
        group.start("encoder")
        group.start("decoder")
        draining = group.start("transformer", {**ckpt, "faults": "dit.step:signal=TERM:nth=3"})
        group.wait_workers({"encoder": 1, "decoder": 1, "transformer": 1}, timeout=300)
        post_ok(group.url, "image", {**SYNTH, "task_id": "drained", "infer_steps": 40})
        assert draining.proc.wait(timeout=120) == 0, draining.log()[-3000:]
        st = wait_status(group, "drained", lambda s: s["attempt"] == 2, "hand-back")
        assert (st["failures"], st["resumed_from"], st["checkpoint_step"]) == (0, 3, 3), st
        group.start("transformer", ckpt)
        final = wait_task(group.url, "drained", timeout=300)
        post_ok(group.url, "image", {**SYNTH, "task_id": "whole", "infer_steps": 40})
        whole = wait_task(group.url, "whole", timeout=300)
        same = result(group.url, "drained") == result(group.url, "whole")
        drained_log = draining.log()
        controller_log = group.services[0].log()
    assert final["status"] == "completed" and whole["status"] == "completed", final
    assert (final["attempt"], final["failures"], final["resumes"]) == (2, 0, 1), final
    assert "handed back after step 3 of 40 (drain)" in drained_log
    assert controller_log.count("task drained stage=encoding") == 1
    assert same


def test_a_high_priority_request_preempts_a_low_one_that_resumes_unchanged(
        tiny_models: Path, tmp_path: Path) -> None:
    """One DiT, busy with a long low-priority request; a short high-priority one (through the
    OpenAI route, ``priority`` as an ``extra_body`` field) waits past ``preempt_after_s``:
    the DiT yields at a step boundary, runs the urgent one, then resumes the low one, whose
    result equals an uninterrupted run's, uncharged."""
    cfg = group_config("synthetic", str(tiny_models / "synthetic"), tmp_path,
                       lease_timeout_s=5.0, heartbeat_interval_s=0.5, preempt_after_s=0.3)
    (metric_port,) = free_ports(1)
    with LocalGroup(cfg, tmp_path) as group, ThreadPoolExecutor(1) as pool:
        group.start("controller", {"server": {**cfg["server"], "metric_port": metric_port}})
        group.wait_http()
        group.start("encoder")
        group.start("decoder")
        group.start("transformer", {"transformer": {"checkpoint_every_steps": 100}})
        group.wait_workers({"encoder": 1, "decoder": 1, "transformer": 1}, timeout=300)
        post_ok(group.url, "image",
                {**SYNTH, "task_id": "long", "infer_steps": 80, "priority": "low"})
        stream = pool.submit(events, group.url, "long")
        wait_status(group, "long", lambda s: s["stage"] == "denoising" and s["step"] >= 2,
                    "denoising")
        r = httpx.post(f"{group.url}/v1/images/generations", timeout=300, json={
            "prompt": "urgent", "size": "16x16", "infer_steps": 2, "priority": "high"})
        assert r.status_code == 200, r.text
        at_urgent_done = status(group.url, "long")
        final = wait_task(group.url, "long", timeout=300)
        post_ok(group.url, "image", {**SYNTH, "task_id": "same", "infer_steps": 80})
        same = wait_task(group.url, "same", timeout=300)
        equal = result(group.url, "long") == result(group.url, "same")
        bad = httpx.post(f"{group.url}/v1/tasks/image/", timeout=30,
                         json={**SYNTH, "priority": "urgent"})
        seen = stream.result(timeout=60)
        service = httpx.get(f"{group.url}/v1/service/status", timeout=30).json()
        metrics = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for fam in text_string_to_metric_families(
                       httpx.get(f"http://127.0.0.1:{metric_port}/metrics", timeout=30).text)
                   for s in fam.samples}
    assert at_urgent_done["status"] != "completed", at_urgent_done  # it was overtaken
    assert final["status"] == "completed" and same["status"] == "completed", final
    assert (final["preemptions"], final["failures"], final["resumes"]) == (1, 0, 1), final
    assert final["priority"] == "low" and final["resumed_from"] >= 2
    assert equal
    assert bad.status_code == 422 and "low, normal, high" in bad.text
    # The stream, the service status and the metrics show it.
    names = [name for name, _ in seen]
    assert names.index("preempting") < names.index("preempted") < names.index("resumed")
    preempted = next(data for name, data in seen if name == "preempted")
    assert preempted["preemptions"] == 1 and preempted["priority"] == "low"
    assert any(name == "checkpoint" and data["final"] for name, data in seen)
    assert service["priorities"]["preemptions"] == 1
    assert service["checkpoints"]["kept"] >= 1 and service["checkpoints"]["resumes"] >= 1
    assert metrics[("diffring_task_events_total", (("event", "preempted"),))] == 1
    assert metrics[("diffring_checkpoints", (("outcome", "kept"),))] >= 1
    assert metrics[("diffring_priority_actions", (("action", "preemptions"),))] == 1


def events(url: str, task_id: str) -> list[tuple[str, dict[str, Any]]]:
    """Every event of the task's stream, until the server ends it (the task is over)."""
    out = []
    with httpx.Client(timeout=httpx.Timeout(30, read=300)) as c, \
            connect_sse(c, "GET", f"{url}/v1/tasks/{task_id}/events") as source:
        for sse in source.iter_sse():
            out.append((sse.event, json.loads(sse.data)))
    return out
