"""End to end, faults: a producer, a transformer or the controller killed mid-task; the
task completes anyway, exactly once, and the group keeps serving."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from launcher import submit, wait_task
from tests.support.groups import local_group
from tests.support.http import body, result
from tests.support.waits import wait_log

pytestmark = pytest.mark.integration  # starts processes or servers


def test_dead_producer_fails_task_clearly_and_workers_keep_serving(
        tiny_models: Path, tmp_path: Path) -> None:
    """The encoder dies after publishing Phase1: the transformer's pull fails with an error
    naming task, tensor and peer; the task goes back in play and completes on attempt 2."""
    pipeline = "wan_t2v"
    with local_group(pipeline, tiny_models, tmp_path) as group:
        group.start("controller")
        group.wait_http()
        encoder = group.start("encoder")
        group.start("decoder")
        group.wait_workers({"encoder": 1, "decoder": 1})
        r = httpx.post(f"{group.url}/v1/tasks/video/",
                       json=body(pipeline, None, task_id="orphan"), timeout=30)
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 120
        while httpx.get(f"{group.url}/v1/tasks/orphan/status").json()["stage"] != "phase1":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(encoder.proc.pid, signal.SIGKILL)
        encoder.proc.wait()
        transformer = group.start("transformer")
        group.start("encoder")
        st = wait_task(group.url, "orphan", timeout=300)
        assert st["status"] == "completed" and st["attempt"] == 2, st
        log = transformer.log()
        assert "task orphan" in log and "failed (TransferFailed)" in log
        failure = next(line for line in log.splitlines() if "failed (TransferFailed)" in line)
        assert "tensor 'prompt_embeds'" in failure or "tensor '" in failure
        assert "peer 127.0.0.1:" in failure
        # And the group keeps serving.
        again = submit(group.url, "video", body(pipeline, None, seed=8), timeout=300)
        assert again["status"] == "completed" and again["attempt"] == 1


def start_with_held_dit(group: Any, gate: Path, nth: int) -> Any:
    """Start a 1/1/1 group whose transformer holds at its ``nth`` denoising step boundary
    (fault point ``dit.step``) while ``gate`` exists; returns the transformer's service."""
    group.start("controller")
    group.wait_http()
    group.start("encoder")
    group.start("decoder")
    dit = group.start("transformer", {"faults": f"dit.step:hold={gate}:nth={nth}"})
    group.wait_workers({"encoder": 1, "transformer": 1, "decoder": 1})
    return dit


def test_killed_transformer_task_is_requeued(tiny_models: Path, tmp_path: Path) -> None:
    """A transformer SIGKILLed mid-denoise loses nothing: the task completes elsewhere. The
    victim is held after its third step (fault point ``dit.step``) and killed there, so the
    kill lands mid-denoise however slowly the machine runs."""
    pipeline = "qwen_t2i"
    gate = tmp_path / "step-3-gate"
    gate.touch()  # never removed: the victim dies held
    with local_group(pipeline, tiny_models, tmp_path) as group:
        victim = start_with_held_dit(group, gate, 3)
        r = httpx.post(f"{group.url}/v1/tasks/image/",
                       json=body(pipeline, None, task_id="long", infer_steps=8), timeout=30)
        assert r.status_code == 200
        wait_log(victim, "fault point dit.step fired", timeout=300)
        st = httpx.get(f"{group.url}/v1/tasks/long/status", timeout=30).json()
        assert st["stage"] == "denoising" and st["attempt"] == 1, st
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait()
        group.start("transformer")
        st = wait_task(group.url, "long", timeout=600)
    assert st["status"] == "completed" and st["attempt"] == 2, st
    assert "gone: control connection dropped" in group.services[0].log()


def test_controller_restart_loses_no_task(tiny_models: Path, tmp_path: Path) -> None:
    """SIGKILL the controller mid-task: the journal brings every task back, the workers
    reconnect by themselves, the unfinished task completes, the finished one stays served."""
    pipeline = "qwen_t2i"
    with local_group(pipeline, tiny_models, tmp_path) as group:
        # The transformer holds after the second step of its second task ("during") until
        # the new controller is up: the controller dies mid-task however slow the machine is.
        gate = tmp_path / "held-during-restart"
        gate.touch()
        dit = start_with_held_dit(group, gate, 4)
        before = submit(group.url, "image", body(pipeline, None, seed=1, task_id="before"))
        assert before["status"] == "completed"
        first = result(group.url, "before")
        r = httpx.post(f"{group.url}/v1/tasks/image/",
                       json=body(pipeline, None, task_id="during", infer_steps=8), timeout=30)
        assert r.status_code == 200
        wait_log(dit, "fault point dit.step fired", timeout=300)
        old = group.services[0]
        os.kill(old.proc.pid, signal.SIGKILL)
        old.proc.wait()
        group.services.remove(old)  # reaped: no longer part of the group
        group.start("controller")
        group.wait_http()
        # The held transformer reconnects once its step is done (its worker is busy in it).
        group.wait_workers({"encoder": 1, "decoder": 1}, timeout=120)
        gate.unlink()
        group.wait_workers({"encoder": 1, "transformer": 1, "decoder": 1}, timeout=120)
        st = wait_task(group.url, "during", timeout=600)
        assert st["status"] == "completed" and st["attempt"] == 2, st
        assert httpx.get(f"{group.url}/v1/tasks/before/status").json()["status"] == "completed"
        assert result(group.url, "before") == first
