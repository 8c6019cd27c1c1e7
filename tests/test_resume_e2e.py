"""A lost worker costs one stage, not the request (window 8 of controller.coordinator), with
real processes on loopback: a DiT killed at a fault point resumes on another DiT from its
last checkpoint -- the encoder does not run again -- and gives the bytes of an uninterrupted
run; a decoder killed after the handoff re-runs only the decoder from the kept final
latents. Every process is started and stopped here by pid."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from controller.group import LocalGroup, Service, group_config, wait_task

pytestmark = pytest.mark.integration  # starts processes or servers

WAN = {"prompt": "a fox in the snow", "seed": 5, "height": 32, "width": 32,
       "target_video_length": 5, "target_fps": 8, "infer_steps": 6}
SYNTH = {"prompt": "a synthetic test", "seed": 3, "infer_steps": 8}


def post(group: LocalGroup, kind: str, tid: str, body: dict[str, Any]) -> None:
    r = httpx.post(f"{group.url}/v1/tasks/{kind}/", json={**body, "task_id": tid}, timeout=30)
    assert r.status_code == 200, r.text


def status(group: LocalGroup, tid: str) -> dict[str, Any]:
    out: dict[str, Any] = httpx.get(f"{group.url}/v1/tasks/{tid}/status", timeout=30).json()
    return out


def wait_status(group: LocalGroup, tid: str, ok: Any, what: str, timeout: float = 300
                ) -> dict[str, Any]:
    """Until ``ok(status)`` (a bound, not a pause: the event is what is waited for)."""
    deadline = time.monotonic() + timeout
    while True:
        st = status(group, tid)
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


def result(group: LocalGroup, tid: str) -> bytes:
    r = httpx.get(f"{group.url}/v1/tasks/{tid}/result", timeout=30)
    assert r.status_code == 200, r.text
    return r.content


def test_dit_killed_resumes_from_its_last_checkpoint_byte_identical(
        tiny_models: Path, tmp_path: Path) -> None:
    """Wan2.1 T2V (UniPC: the scheduler with history): the DiT dies right after its second
    kept checkpoint; the other DiT resumes from exactly that step, the encoder never runs
    again, and the MP4 equals an uninterrupted run's byte for byte."""
    cfg = group_config("wan_t2v", str(tiny_models / "wan_t2v"), tmp_path, lease_timeout_s=5.0,
                       heartbeat_interval_s=0.5, video_threads=1)
    ckpt = {"transformer": {"checkpoint_every_steps": 2}}
    with LocalGroup(cfg, tmp_path) as group:
        group.start("controller")
        group.wait_http()
        group.start("encoder")
        group.start("decoder")
        faulty = group.start("transformer", {**ckpt, "faults": "dit.checkpointed:exit:nth=2"})
        group.wait_workers({"encoder": 1, "decoder": 1, "transformer": 1}, timeout=600)
        post(group, "video", "resumed", WAN)
        assert wait_dead(faulty) == -signal.SIGKILL
        healthy = group.start("transformer", ckpt)
        final = wait_task(group.url, "resumed", timeout=600)
        post(group, "video", "plain", WAN)  # the same request, never interrupted
        plain = wait_task(group.url, "plain", timeout=600)
        controller_log = group.services[0].log()
        resumed_bytes, plain_bytes = result(group, "resumed"), result(group, "plain")
        healthy_log = healthy.log()
    assert final["status"] == "completed" and plain["status"] == "completed", final
    kept = [int(step) for step in re.findall(
        r"task resumed: checkpoint of step (\d+)/6 kept from", controller_log)]
    assert kept, controller_log[-3000:]
    last = kept[-1]
    assert 2 <= last < 6
    assert (final["attempt"], final["resumes"], final["resumed_from"], final["failures"]) == (
        2, 1, last, 0), final
    assert f"task resumed: resuming after step {last} of 6" in healthy_log
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
        post(group, "image", "dec", SYNTH)
        wait_status(group, "dec", lambda st: st["checkpoint_step"] == 8
                    and st["stage"] == "phase2", "final latents kept")
        os.kill(faulty.proc.pid, signal.SIGCONT)
        assert wait_dead(faulty) == -signal.SIGKILL
        group.start("decoder")
        final = wait_task(group.url, "dec", timeout=300)
        post(group, "image", "ref", SYNTH)
        ref = wait_task(group.url, "ref", timeout=300)
        controller_log = group.services[0].log()
        same = result(group, "dec") == result(group, "ref")
        dit_log = dit.log()
    assert final["status"] == "completed" and ref["status"] == "completed", final
    assert (final["attempt"], final["resumes"], final["resumed_from"], final["failures"]) == (
        2, 1, 8, 0), final
    assert controller_log.count("task dec stage=encoding") == 1
    assert controller_log.count("task dec stage=denoising") == 1
    assert len(re.findall(r"task dec stage=transformer worker=\S+ done", dit_log)) == 1
    assert same
