"""Checkpoints of a transformer group (issue 23 on issue 24's groups), in a running cluster.

Rank 0 is the group's only face: it checkpoints the loop (every rank holds the same state),
fetches a resumed attempt's checkpoint and hands it to the other ranks with the inputs, and
hands a task back at a step boundary (drain, preemption) through the step gate, so that all
ranks leave the loop before the same step. Each test arms its faults at an exact point
(contracts/faults.py; ``point@R``: rank R only, first start of the group only) and starts
and stops its group by pid; one controller, encoder and decoder serve the module.

Wan2.1 T2V, whose UniPC scheduler keeps a history of model outputs: the state that is the
hardest to hand over. The references are one process's (``LocalPipeline``, the decoder's MP4
settings): a CFG-2 group equals it byte for byte; a Ulysses group sums in another order
(tests/integration/test_group_layouts.py bounds that on the latents), so its resumed output
is checked byte for byte against the same group uninterrupted, and against one process by
pixels.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from launcher import LocalGroup, Service, wait_task
from tests.support.groups import gone, rank_pids, start_dit_group, start_group, wait_exit
from tests.support.http import post_ok, result, status
from tests.support.waits import wait_for

pytestmark = pytest.mark.integration  # starts processes
PIPELINE = "wan_t2v"
STEPS = 8
SEED = 5
BODY = {"prompt": "a fox in a group", "seed": SEED, "height": 32, "width": 32,
        "target_video_length": 5, "target_fps": 8, "infer_steps": STEPS}
# 2 x 2 x 2 = 8 video tokens: even over 2 ranks (gloo gathers equal shards only).
EVERY_STEP = {"checkpoint_every_steps": 1}


@pytest.fixture(scope="module")
def cluster(tiny_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalGroup]:
    workdir = tmp_path_factory.mktemp("group-checkpoints")
    # A lease outlives the few seconds a test keeps rank 0 frozen (SIGSTOP) at a step.
    with start_group(PIPELINE, tiny_models, workdir, workers=("encoder", "decoder"),
                     lease_timeout_s=30.0, heartbeat_interval_s=0.5, video_threads=1,
                     preempt_after_s=0.3) as group:
        yield group


@pytest.fixture(scope="module")
def reference(tiny_models: Path) -> Callable[[int], bytes]:
    """The MP4 of the request run whole in one process with ``steps`` steps, encoded as the
    decoder encodes."""
    import torch

    from contracts.request import GenerationRequest
    from workers.models import LocalPipeline
    from workers.models.media import VideoSettings

    pipe = LocalPipeline(tiny_models / PIPELINE, PIPELINE, video=VideoSettings(threads=1))
    pipe.load()
    done: dict[int, bytes] = {}

    def run(steps: int) -> bytes:
        if steps not in done:
            req = GenerationRequest.from_dict({
                "task": PIPELINE, "prompt": BODY["prompt"], "seed": SEED, "height": 32,
                "width": 32, "num_frames": 5, "fps": 8, "infer_steps": steps})
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # as the workers (torch_threads 1): the same sums
            try:
                done[steps] = pipe.run(req).data
            finally:
                torch.set_num_threads(threads)
        return done[steps]

    return run


# -- helpers -------------------------------------------------------------------------------
def first_start(svc: Service) -> list[int]:
    """The pids of the group's first start, by rank (the supervisor logs each start)."""
    wait_for(lambda: "start 0:" in svc.log(), "group start")
    line = next(ln for ln in svc.log().splitlines() if "start 0:" in ln)
    return [int(p) for p in re.findall(r"rank \d \(cpu, pid (\d+)\)", line)]


def stopped(pid: int) -> bool:
    """``pid`` is frozen by SIGSTOP (state T)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1].startswith("T")


def signal_pending(pid: int, signum: int) -> bool:
    """A process-directed ``signum`` waits for ``pid`` (frozen, it cannot take it yet)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(ln.split()[1] for ln in f if ln.startswith("ShdPnd:"))
    return bool(int(mask, 16) >> (signum - 1) & 1)


def kept(controller_log: str, task_id: str) -> list[tuple[int, str]]:
    """(step, worker) of every checkpoint of ``task_id`` the controller kept, in order."""
    return [(int(step), who) for step, who in re.findall(
        rf"task {task_id}: (?:checkpoint|final latents) of step (\d+)/{STEPS} kept from (\S+)",
        controller_log)]


def second_checkpoint_at_step_2(gate: Path, action: str) -> str:
    """Faults for rank 0: ``action`` right after its second kept checkpoint, which is of
    step 2 whatever the load. One checkpoint is in flight at most, and the tiny model's steps
    can outrun a send on a loaded machine (the second one sent would then be a later step's,
    or the final latents): so rank 0 is held at its second step boundary until ``gate`` is
    deleted (:func:`open_gate_at_first_checkpoint`)."""
    gate.touch()
    return f"dit.step@0:hold={gate}:nth=2,dit.checkpointed@0:{action}:nth=2"


def open_gate_at_first_checkpoint(svc: Service, task_id: str, gate: Path) -> None:
    """Delete ``gate`` once rank 0 logged its first checkpoint kept (its sender is free)."""
    wait_for(lambda: f"task {task_id}: checkpoint of step 1/{STEPS} kept" in svc.log(),
             "the first checkpoint kept")
    gate.unlink()


def drain(cluster: LocalGroup, svc: Service) -> int:
    svc.proc.send_signal(signal.SIGTERM)
    return wait_exit(cluster, svc, 120)


# -- tests ---------------------------------------------------------------------------------
@pytest.mark.timeout(600)
def test_a_cfg_group_whose_rank_is_killed_resumes_from_its_last_checkpoint(
        cluster: LocalGroup, reference: Callable[[int], bytes], tmp_path: Path) -> None:
    """Rank 0 checkpoints every step and freezes (SIGSTOP) right after its second kept
    checkpoint; rank 1, waiting for it in the step's all-gather, is then SIGKILLed. The
    group is restarted, its rank 0 fetches that checkpoint and hands it to rank 1, and the
    MP4 equals one process's byte for byte; the encoder ran once."""
    gate = tmp_path / "step-2-gate"
    svc = start_dit_group(cluster, "cfg=2", second_checkpoint_at_step_2(gate, "stop"),
                          timeout_s=60, restarts=1, **EVERY_STEP)
    try:
        post_ok(cluster.url, "video", {**BODY, "task_id": "cfg-kill"})
        leader, follower = first_start(svc)
        open_gate_at_first_checkpoint(svc, "cfg-kill", gate)
        wait_for(lambda: stopped(leader), "rank 0 frozen after its second checkpoint")
        os.kill(follower, signal.SIGKILL)
        st = wait_task(cluster.url, "cfg-kill", timeout=300)
        log = svc.log()
    finally:
        code = drain(cluster, svc)
    assert code == 0, svc.log()[-3000:]
    ctl = cluster.services[0].log()
    steps = kept(ctl, "cfg-kill")
    first = [step for step, who in steps if who == steps[0][1]]
    assert first == [1, 2], steps  # rank 0 froze after its second
    last = first[1]
    assert re.search(r"rank 1 \(cpu, pid \d+\) was killed by SIGKILL; restarting the group",
                     log), log[-3000:]
    assert (st["status"], st["attempt"], st["resumes"], st["resumed_from"], st["failures"]) \
        == ("completed", 2, 1, last, 0), st
    assert f"task cfg-kill: resuming after step {last} of {STEPS}" in log
    assert ctl.count("task cfg-kill stage=encoding") == 1  # the resume needed no encoder
    assert result(cluster.url, "cfg-kill") == reference(STEPS)
    assert all(gone(pid) for pid in rank_pids(svc))


@pytest.mark.timeout(600)
def test_a_ulysses_group_whose_leader_is_killed_resumes_exactly(
        cluster: LocalGroup, reference: Callable[[int], bytes], tmp_path: Path) -> None:
    """Rank 0 is SIGKILLed right after its second kept checkpoint; the restarted group
    resumes from it. Resumed equals the same group's uninterrupted run byte for byte (the
    state handed over is the whole state), and one process's pixels up to the float order
    of Ulysses' sums."""
    from workers.models.media import read_mp4

    gate = tmp_path / "step-2-gate"
    svc = start_dit_group(cluster, "ulysses=2", second_checkpoint_at_step_2(gate, "exit"),
                          timeout_s=60, restarts=1, **EVERY_STEP)
    try:
        post_ok(cluster.url, "video", {**BODY, "task_id": "uly-kill"})
        open_gate_at_first_checkpoint(svc, "uly-kill", gate)
        st = wait_task(cluster.url, "uly-kill", timeout=300)
        post_ok(cluster.url, "video", {**BODY, "task_id": "uly-whole"})
        whole = wait_task(cluster.url, "uly-whole", timeout=300)
        log = svc.log()
    finally:
        code = drain(cluster, svc)
    assert code == 0, svc.log()[-3000:]
    steps = kept(cluster.services[0].log(), "uly-kill")
    first = [step for step, who in steps if who == steps[0][1]]
    assert first == [1, 2], steps
    last = first[1]
    assert re.search(r"rank 0 \(cpu, pid \d+\) was killed by SIGKILL; restarting the group",
                     log), log[-3000:]
    assert (st["status"], st["attempt"], st["resumed_from"], st["failures"]) == (
        "completed", 2, last, 0), st
    assert whole["status"] == "completed" and whole["attempt"] == 1, whole
    resumed = result(cluster.url, "uly-kill")
    assert resumed == result(cluster.url, "uly-whole")
    diff = np.abs(read_mp4(resumed).astype(int) - read_mp4(reference(STEPS)).astype(int))
    assert diff.max() <= 1, f"max abs pixel difference {diff.max()}"
    print(f"ulysses=2 resumed against one process: max abs pixel difference {diff.max()}")


@pytest.mark.timeout(600)
def test_sigterm_on_the_supervisor_hands_the_task_back_at_the_next_step(
        cluster: LocalGroup, reference: Callable[[int], bytes]) -> None:
    """Rank 0 freezes at its third step boundary; SIGTERM goes to the supervisor, which
    passes it on to rank 0 (pending while frozen); rank 0 goes on. At that boundary it
    checkpoints, tells rank 1 through the step gate, both leave the loop before step 4, the
    task is handed back uncharged and the group exits 0. A one-process DiT finishes the task
    from step 3 with the bytes of an uninterrupted run."""
    svc = start_dit_group(cluster, "cfg=2", "dit.step@0:stop:nth=3", timeout_s=60, restarts=0,
                          checkpoint_every_steps=100)  # no periodic one: only the drain's
    post_ok(cluster.url, "video", {**BODY, "task_id": "cfg-drain"})
    leader, _ = first_start(svc)
    wait_for(lambda: stopped(leader), "rank 0 frozen at its third step boundary")
    svc.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: signal_pending(leader, signal.SIGTERM), "SIGTERM passed on to rank 0")
    t0 = time.monotonic()
    os.kill(leader, signal.SIGCONT)
    code = wait_exit(cluster, svc, 120)
    drained_s = time.monotonic() - t0
    log = svc.log()
    assert code == 0, log[-3000:]
    assert "handed back after step 3 of 8 (drain)" in log
    assert all(gone(pid) for pid in rank_pids(svc))
    st = status(cluster.url, "cfg-drain")
    assert (st["attempt"], st["failures"], st["resumed_from"], st["checkpoint_step"]) == (
        2, 0, 3, 3), st
    plain = cluster.start("transformer", {"transformer": EVERY_STEP})
    try:
        final = wait_task(cluster.url, "cfg-drain", timeout=300)
        plain_log = plain.log()
    finally:
        assert drain(cluster, plain) == 0
    assert (final["status"], final["attempt"], final["resumes"], final["failures"]) == (
        "completed", 2, 1, 0), final
    assert f"task cfg-drain: resuming after step 3 of {STEPS}" in plain_log
    assert result(cluster.url, "cfg-drain") == reference(STEPS)
    print(f"group drained {drained_s:.2f} s after rank 0 went on")


@pytest.mark.timeout(600)
def test_a_cfg_group_preempted_at_a_step_boundary_resumes_unchanged(
        cluster: LocalGroup, reference: Callable[[int], bytes]) -> None:
    """The group is busy with a long low-priority request (rank 0 frozen after its second
    step); a high-priority one waits past ``preempt_after_s``, and the controller asks the
    group to yield. Rank 0, going on, hands the low one back at a step boundary through the
    gate, the group runs the urgent one, then resumes the low one from its checkpoint: both
    equal one process's bytes, nothing charged."""
    long = 20
    svc = start_dit_group(cluster, "cfg=2", "dit.step@0:stop:nth=2", timeout_s=60, restarts=0,
                          checkpoint_every_steps=100)
    try:
        post_ok(cluster.url, "video",
                {**BODY, "task_id": "cfg-low", "infer_steps": long, "priority": "low"})
        leader, _ = first_start(svc)
        wait_for(lambda: stopped(leader), "rank 0 frozen after its second step")
        post_ok(cluster.url, "video", {**BODY, "task_id": "cfg-high", "priority": "high"})
        asked = re.compile(rf"task cfg-low \(low, step \d+/{long} on \S+\) asked to yield")
        wait_for(lambda: asked.search(cluster.services[0].log()) is not None,
                 "the controller asking the group to yield")
        # Its next heartbeat, sent as it thaws, brings the word: it yields within a step or so.
        os.kill(leader, signal.SIGCONT)
        high = wait_task(cluster.url, "cfg-high", timeout=300)
        low = wait_task(cluster.url, "cfg-low", timeout=300)
        log = svc.log()
    finally:
        code = drain(cluster, svc)
    assert code == 0, svc.log()[-3000:]
    assert re.search(rf"handed back after step \d+ of {long} \(preempted\)", log), log[-3000:]
    assert (high["status"], high["attempt"]) == ("completed", 1), high
    assert (low["status"], low["preemptions"], low["resumes"], low["failures"]) == (
        "completed", 1, 1, 0), low
    assert 2 <= low["resumed_from"] < long, low
    assert f"task cfg-low: resuming after step {low['resumed_from']} of {long}" in log
    assert result(cluster.url, "cfg-high") == reference(STEPS)
    assert result(cluster.url, "cfg-low") == reference(long)
