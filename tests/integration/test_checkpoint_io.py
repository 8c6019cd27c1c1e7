"""Checkpoint I/O off the control path (issue 39): a dead or frozen DiT costs only its own
task. The handler of a DiT's control connection never waits on its checkpoint's tensor I/O
(controller.control), each DiT's checkpoint pulls run in a lane of their own
(controller.tasks.checkpoints), and the worker's control client matches answers to calls
(workers.control), so:

* a DiT killed while the controller writes its checkpoint's release words is noticed, and
  its task back in play, within a second -- not after one failed release per tensor;
* a DiT frozen in the middle of a pull holds up only its own checkpoints: another DiT's are
  kept meanwhile and its lease, as short as 6 s, holds.

Each case is made to happen on demand with fault points (contracts/faults.py: ``keep.release``
and ``transfer.read`` held at a gate in the controller) and processes are killed or frozen by
pid."""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from contracts.errors import ConnectionLost
from contracts.messages import (
    Checkpoint,
    CheckpointReply,
    Claim,
    ClaimReply,
    Heartbeat,
    HeartbeatReply,
    Progress,
    ProgressReply,
    Register,
    RegisterReply,
)
from controller.control import ControlServer
from controller.tasks.tasks import Task
from launcher import LocalGroup, Service, group_config, wait_task
from rings.layout import HOLDER_LOCAL, RingLayout
from rings.ring import Ring
from rings.verbs import LocalVerbs, Region
from tests.support.coordinators import make_coordinator
from tests.support.waits import wait_log
from workers.control import ControlClient
from workers.models.families.synthetic import write_config

pytestmark = pytest.mark.integration  # starts processes and servers

TOKEN = "checkpoint-io"
EVERY_STEP = {"transformer": {"checkpoint_every_steps": 1}}


# -- the control connection, in this process ---------------------------------------------------
def test_the_control_handler_never_waits_on_a_checkpoints_tensor_io(tmp_path: Path) -> None:
    """A DiT's checkpoint whose pull does not end (held here): the same connection's
    heartbeat and progress are answered meanwhile, and when the connection drops, the task is
    back in play at once and the pull is cancelled."""
    request = Ring(LocalVerbs(Region(RingLayout("request", 4, 1024)), HOLDER_LOCAL))
    co = make_coordinator(tmp_path, request)
    pulling, cancelled = threading.Event(), threading.Event()

    async def held(worker: Any, msg: Any) -> CheckpointReply:
        pulling.set()
        try:
            await asyncio.Event().wait()  # a pull from a wedged peer
        except asyncio.CancelledError:
            cancelled.set()
            raise
        raise AssertionError("never")

    co.on_checkpoint = held  # type: ignore[method-assign]
    task = Task(task_id="x", kind="image", pipeline="qwen_t2i",
                request={"task": "qwen_t2i", "prompt": "x"}, save_result_path="")
    co.submit(task)
    enc = co.on_register("encoder", "e", 1, "qwen_t2i", "s1")
    assert co.on_claim(enc, "x", 1)[0]
    co.on_handoff(enc, "x", 1)

    async def scenario() -> None:
        server = ControlServer(co, "127.0.0.1", 0, TOKEN)
        await server.start()
        client = ControlClient("127.0.0.1", server.port, TOKEN, timeout=10)
        try:
            await asyncio.to_thread(client.connect, "transformer")
            await asyncio.to_thread(
                client.call, Register(role="transformer", name="dit", pid=2,
                                      pipeline="qwen_t2i", segment="s2", checkpoints=True),
                RegisterReply)
            claim = await asyncio.to_thread(client.call, Claim(task_id="x", attempt=1),
                                            ClaimReply)
            assert claim.proceed is True
            checkpoint = asyncio.ensure_future(asyncio.to_thread(
                client.call, Checkpoint(task_id="x", attempt=1, step=1, steps=4, final=False,
                                        meta={}, state=[], phase1=[]), CheckpointReply))
            await asyncio.to_thread(pulling.wait, 30)
            beat = await asyncio.to_thread(
                client.call, Heartbeat(tasks=["x"], staged=[]), HeartbeatReply)
            assert beat.cancel == []
            step = await asyncio.to_thread(
                client.call, Progress(task_id="x", attempt=1, step=2, steps=4), ProgressReply)
            assert step.cancel is False and task.step == 2
            assert not checkpoint.done()
            client.close()  # the connection drops with the pull still held
            deadline = time.monotonic() + 5
            while task.attempt == 1:
                assert time.monotonic() < deadline, "the task never went back in play"
                await asyncio.sleep(0.005)
            assert task.worker_id is None
            with pytest.raises(ConnectionLost):
                await checkpoint
            await asyncio.to_thread(cancelled.wait, 5)
            assert cancelled.is_set()
        finally:
            client.close()
            await server.close()

    asyncio.run(scenario())


# -- groups of processes -----------------------------------------------------------------------
def synthetic(tmp_path: Path, step_s: float) -> Path:
    """A synthetic model folder whose DiT takes ``step_s`` per step (real time); a checkpoint
    is one tensor (the latents), the first one with the encoder's one (the prompt)."""
    folder = tmp_path / f"synthetic-{step_s:g}"
    write_config(folder, step_s=step_s,
                 phase1={"prompt_embeds": {"shape": [1, 16, 64], "dtype": "float32"}},
                 phase2={"latents": {"shape": [1, 4, 16, 16], "dtype": "float32"}})
    return folder


def post(group: LocalGroup, tid: str, steps: int) -> None:
    r = httpx.post(f"{group.url}/v1/tasks/image/", timeout=30,
                   json={"prompt": "checkpoint io", "seed": 1, "infer_steps": steps,
                         "task_id": tid})
    assert r.status_code == 200, r.text


def status(group: LocalGroup, tid: str) -> dict[str, Any]:
    out: dict[str, Any] = httpx.get(f"{group.url}/v1/tasks/{tid}/status", timeout=30).json()
    return out


def wait_for(ok: Callable[[], bool], what: str, timeout: float) -> None:
    """Until ``ok()`` (a bound, not a pause: the event is what is waited for)."""
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"no {what} after {timeout:g} s"
        time.sleep(0.01)


def stamped(log: str, pattern: str) -> list[tuple[float, re.Match[str]]]:
    """(wall-clock time, match) of every log line matching ``pattern``, in order."""
    out = []
    for line in log.splitlines():
        m = re.search(pattern, line)
        if m is not None:
            at = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append((at, m))
    return out


def holder(group: LocalGroup, worker: str) -> Service:
    """The DiT service a status names (a worker's name ends in its pid)."""
    return next(s for s in group.services
                if s.role == "transformer" and worker.endswith(f"-{s.proc.pid}"))


def start(group: LocalGroup, faults: str, dits: int) -> list[Service]:
    group.start("controller", {"faults": faults})
    group.wait_http()
    group.start("encoder")
    group.start("decoder")
    out = [group.start("transformer", EVERY_STEP) for _ in range(dits)]
    group.wait_workers({"encoder": 1, "decoder": 1, "transformer": dits}, timeout=600)
    return out


@pytest.mark.timeout(600)
def test_a_dit_killed_during_its_checkpoints_release_writes_is_back_in_play_at_once(
        tmp_path: Path) -> None:
    """The controller has read the DiT's second checkpoint and is about to release its blocks
    (``keep.release``, held) when the DiT is SIGKILLed. The task is back in play within a
    second -- the lease (60 s) plays no part -- while the pull is still held; let go, its
    release writes to the dead DiT are dropped, not tried one by one. Another DiT resumes the
    task from the first checkpoint, and it completes once, uncharged."""
    gate = tmp_path / "release-gate"
    gate.touch()
    cfg = group_config("synthetic", str(synthetic(tmp_path, 0.02)), tmp_path,
                       lease_timeout_s=60.0, heartbeat_interval_s=0.5)
    with LocalGroup(cfg, tmp_path) as group:
        (dit,) = start(group, f"keep.release:hold={gate}:nth=2", 1)
        ctl = group.services[0]
        post(group, "killed", 8)
        wait_log(ctl, "fault point keep.release fired (action hold, hit 2)")
        killed_at = time.time()
        os.kill(dit.proc.pid, signal.SIGKILL)
        try:
            wait_for(lambda: status(group, "killed")["attempt"] == 2, "task back in play", 20)
        finally:
            gone = stamped(ctl.log(), r"worker \d+ \(transformer \S+\) gone: control "
                                      r"connection dropped; 1 task\(s\) back in play")
            gate.unlink()
        wait_log(ctl, "release(s) of producer blocks at")
        group.start("transformer", EVERY_STEP)
        final = wait_task(group.url, "killed", timeout=300)
        log = ctl.log()
    assert len(gone) == 1, log[-3000:]
    back_s = gone[0][0] - killed_at
    print(f"task back in play {back_s:.3f} s after the kill")
    assert back_s < 1.0, log[-3000:]
    kept = [int(m.group(1)) for _, m in stamped(log, r"task killed: checkpoint of step (\d+)/8 "
                                                     r"kept from")]
    assert kept[0] == 1, kept
    assert (final["status"], final["attempt"], final["resumed_from"], final["failures"]) == (
        "completed", 2, 1, 0), final
    assert "release of producer block failed" not in log
    assert log.count("task killed stage=completed") == 1


@pytest.mark.timeout(600)
def test_a_dit_frozen_mid_pull_holds_up_only_its_own_checkpoints(tmp_path: Path) -> None:
    """The controller's third checkpoint read (``transfer.read``, held) is of DiT A's second
    checkpoint (its first was the prompt and the latents); A is SIGSTOPped, then the read
    goes on, against a frozen peer, until Mooncake gives up (10 s).
    Meanwhile DiT B, on another task, checkpoints every step: its checkpoints are kept
    throughout and its 6 s lease holds (A's expires). A is let go (SIGCONT) once its read
    failed: both tasks complete once, uncharged, B's in its first attempt."""
    gate = tmp_path / "read-gate"
    gate.touch()
    steps = 200
    cfg = group_config("synthetic", str(synthetic(tmp_path, 0.1)), tmp_path,
                       lease_timeout_s=6.0, heartbeat_interval_s=0.5)
    with LocalGroup(cfg, tmp_path) as group:
        start(group, f"transfer.read:hold={gate}:nth=3", 2)
        ctl = group.services[0]
        post(group, "frozen", steps)
        wait_log(ctl, "fault point transfer.read fired (action hold, hit 3)")
        a = holder(group, status(group, "frozen")["worker"])
        os.kill(a.proc.pid, signal.SIGSTOP)
        try:
            wait_for(lambda: _stopped(a.proc.pid), "DiT A frozen", 30)
            post(group, "healthy", steps)
            wait_for(lambda: status(group, "healthy")["step"] >= 1, "B denoising", 120)
            opened = time.time()
            gate.unlink()
            wait_for(lambda: re.search(r"task frozen: checkpoint of step \d+ refused: mooncake "
                                       r"read", ctl.log()) is not None, "A's read failing", 120)
            b_status = status(group, "healthy")
        finally:
            gate.unlink(missing_ok=True)
            os.kill(a.proc.pid, signal.SIGCONT)
        healthy = wait_task(group.url, "healthy", timeout=300)
        frozen = wait_task(group.url, "frozen", timeout=300)
        log = ctl.log()
    (failed_at, _), = stamped(log, r"task frozen: checkpoint of step \d+ refused")
    assert failed_at - opened >= 5.0, log[-3000:]  # the read was wedged: Mooncake gave up
    kept = [at for at, _ in stamped(log, r"task healthy: checkpoint of step \d+/\d+ kept from")]
    around = [opened] + [at for at in kept if opened < at < failed_at] + [failed_at]
    gap = max(b - a for a, b in itertools.pairwise(around))
    print(f"A's read wedged {failed_at - opened:.1f} s; B's checkpoints kept meanwhile: "
          f"{len(around) - 2}, longest gap {gap:.2f} s")
    assert gap < 3.0, log[-3000:]
    assert b_status["attempt"] == 1 and b_status["worker"] != a.proc.pid, b_status
    assert (healthy["status"], healthy["attempt"], healthy["failures"]) == (
        "completed", 1, 0), healthy
    assert (frozen["status"], frozen["failures"]) == ("completed", 0), frozen
    assert frozen["attempt"] >= 2  # A's lease expired while it was frozen
    for tid in ("healthy", "frozen"):
        assert log.count(f"task {tid} stage=completed") == 1


def _stopped(pid: int) -> bool:
    """``pid`` is frozen by SIGSTOP (state T)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1].startswith("T")
