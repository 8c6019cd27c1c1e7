"""Wan2.2-A14B's ``split`` placement (``transformer.experts`` ``high`` / ``low``): a worker
holding one expert, the request handed from a high-noise worker to a low-noise one at the
boundary as a checkpoint (:mod:`workers.checkpoints`, :data:`controller.ownership.requeue.LOW`).

In this process: the high-noise loop hands its state over at the boundary, the low-noise
loop resumes it, and the two give the bytes of ``both`` and the pixels of diffusers; each
loads one expert, and the budget counts one. In a group started by the launcher (controller,
encoder, one high-noise and one low-noise DiT worker, decoder, on loopback): a request
visits both DiT workers and gives the pixels of the one-process pipeline (T2V, I2V); a
low-noise worker killed after it took a handed-over task, a drained low-noise worker and a
high-noise worker killed as the controller kept its boundary state each leave the task to
a low-noise worker (never the high-noise one), which completes it identically, uncharged.
So does a controller SIGKILLed and started again while a handed-over task waits for a
low-noise worker: restored from its journal and checkpoint files, it waits for one again.
Through the launcher's own entry (the start script with ``EXPERTS=split``, the role files
``wan22_a14b_{t2v,i2v}_transformer_{high,low}.json``): a split group starts, a request completes
after the handover. Every process is started and stopped here by pid.
"""

from __future__ import annotations

import base64
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

torch.set_num_threads(1)

from contracts.errors import CheckpointError, StageYielded  # noqa: E402
from contracts.request import GenerationRequest  # noqa: E402
from contracts.stage_options import StageOptions  # noqa: E402
from launcher import LocalGroup, Service, group_config, wait_task  # noqa: E402
from tests.support.groups import events_of  # noqa: E402
from tests.support.http import pixels, post_ok, result, status  # noqa: E402
from tests.support.models import diffusers_reference, small_request, stage, wire  # noqa: E402
from tests.support.paths import ROOT  # noqa: E402
from tests.support.scripts import Launched, free_offset, launcher_env, pid_alive  # noqa: E402
from tests.support.waits import wait_for, wait_log  # noqa: E402
from workers.models import LocalPipeline, TransformerAdapter  # noqa: E402
from workers.models.loop_state import LoopState, from_wire, to_wire  # noqa: E402

pytestmark = [pytest.mark.integration,  # builds and runs the tiny models, starts groups
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

A14B = ("wan22_a14b_t2v", "wan22_a14b_i2v")


def _image(task: str, png: bytes) -> bytes | None:
    return png if task.endswith("i2v") else None


def _expert(models: Path, task: str, experts: str) -> Any:
    dit = TransformerAdapter.for_task(models / task, task, options=StageOptions(experts=experts))
    dit.load()
    return dit


class Handover:
    """Loop hooks of a worker holding one expert: resume from ``resume``; at the boundary
    take the state through the wire format and end the loop, as the worker's hooks do."""

    def __init__(self, resume: LoopState | None = None) -> None:
        self.resume = resume
        self.taken: LoopState | None = None

    def boundary(self, step: int, steps: int, snapshot: Callable[[], LoopState]) -> None:
        pass

    def hand_over(self, step: int, steps: int, snapshot: Callable[[], LoopState]) -> None:
        state = snapshot()
        tensors, meta = to_wire(state)
        moved = {k: wire({k: v.reshape(-1)})[k].reshape(v.shape) for k, v in tensors.items()}
        self.taken = from_wire(state.step, state.steps, moved, meta, "cpu")
        raise StageYielded("handed over", step, steps, "handover")


@pytest.mark.parametrize("task", A14B)
def test_split_hands_over_at_the_boundary_with_the_bytes_of_both(
        tiny_models: Path, input_png: bytes, task: str) -> None:
    """The high-noise worker runs the steps above the boundary (2 of 3) and hands its state
    over; the low-noise worker resumes it for the last step: the latents of ``both``, the
    pixels of diffusers. Each holds one expert; a worker given the other expert's step
    hands the task back untouched, and a loop without hooks says why it cannot go on."""
    req = small_request(task)
    cond = wire(stage("encoder", tiny_models, task).encode(req, _image(task, input_png)))
    high, low = _expert(tiny_models, task, "high"), _expert(tiny_models, task, "low")
    assert high.experts.holds(0) and not high.experts.holds(1) and len(high.dits()) == 1
    assert low.experts.holds(1) and not low.experts.holds(0) and len(low.dits()) == 1
    ran: list[tuple[str, str | None]] = []
    hooks = Handover()
    with pytest.raises(StageYielded, match="handed over"):
        high.denoise(req, cond, loop=hooks,
                     on_step=lambda k, n: ran.append(("high", high.active_expert)))
    state = hooks.taken
    assert state is not None and (state.step, state.steps, state.expert) == (2, 3, "low")
    got = low.denoise(req, cond, loop=Handover(resume=state),
                      on_step=lambda k, n: ran.append(("low", low.active_expert)))
    assert ran == [("high", "high"), ("high", "high"), ("low", "low")]
    both = stage("transformer", tiny_models, task).denoise(req, cond)
    assert torch.equal(got["latents"], both["latents"])
    ours = stage("decoder", tiny_models, task).decode_float(req, wire(got))
    reference = diffusers_reference(tiny_models, req, _image(task, input_png), "float32")
    assert float(np.abs(ours - reference).max()) == 0.0
    # The other kind of worker: a low-noise worker given a fresh task (its first step is
    # the high-noise expert's), a high-noise one given the handed-over state.
    with pytest.raises(StageYielded, match="runs the high-noise expert, which this worker"):
        low.denoise(req, cond, loop=Handover())
    with pytest.raises(StageYielded, match="runs the low-noise expert, which this worker"):
        high.denoise(req, cond, loop=Handover(resume=state))
    with pytest.raises(CheckpointError, match="split placement"):
        high.denoise(req, cond)


def test_a_split_worker_warms_up_alone(tiny_models: Path) -> None:
    """``warmup_shapes`` on a worker of one expert: its expert runs every warm-up step (no
    handover, no refusal), and requests afterwards still hand over at the boundary."""
    task = "wan22_a14b_t2v"
    for experts in ("high", "low"):
        dit = _expert(tiny_models, task, experts)
        assert dit.warm_up(["32x32x9"], steps=3) > 0
        assert not dit.experts.holds(1 if experts == "high" else 0)
    req = small_request(task)
    cond = wire(stage("encoder", tiny_models, task).encode(req))
    with pytest.raises(CheckpointError, match="split placement"):
        dit = _expert(tiny_models, task, "high")
        dit.warm_up(["32x32x9"])
        dit.denoise(req, cond)


# -- a group -------------------------------------------------------------------------------------
FIELDS = {"height": 32, "width": 32, "target_video_length": 9, "infer_steps": 3,
          "target_fps": 8, "seed": 11, "guidance_scale": 4.0, "guidance_scale_2": 2.0}
HIGH = {"transformer": {"experts": "high"}}
LOW = {"transformer": {"experts": "low"}}


def _want(models: Path, task: str, image: bytes | None = None) -> Any:
    req = GenerationRequest(task=task, prompt="a tiny wave", height=32, width=32,
                            num_frames=9, infer_steps=3, fps=8, seed=11, guidance_scale=4.0,
                            guidance_scale_2=2.0)
    return LocalPipeline(models / task, task).run(req, image)


def _group(models: Path, task: str, workdir: Path) -> LocalGroup:
    cfg = group_config(task, str(models / task), workdir, lease_timeout_s=5.0,
                       heartbeat_interval_s=0.5, video_threads=1)
    return LocalGroup(cfg, workdir)


def _start(group: LocalGroup, low: dict[str, Any] | None = None) -> tuple[Service, Service]:
    group.start("controller")
    group.wait_http(timeout=120)
    group.start("encoder")
    high_svc = group.start("transformer", HIGH)
    low_svc = group.start("transformer", {**LOW, **(low or {})})
    group.start("decoder")
    group.wait_workers({"encoder": 1, "transformer": 2, "decoder": 1}, timeout=600)
    return high_svc, low_svc


def _handover_seconds(high: Service, low: Service, controller: Service) -> dict[str, float]:
    """The parts of the boundary handover, from the logs: the high-noise worker's send
    (capture, staging, the controller's pull), the wait at the controller, the low-noise
    worker's fetch."""
    sent = re.findall(r"handed over to the low-noise expert after step \d+/\d+ \((\S+) s\)",
                      high.log())
    waited = re.findall(r"\(low-noise expert, waited (\S+) s\)", controller.log())
    fetched = re.findall(r"resuming after step \d+ of \d+ \(fetched in (\S+) s\)", low.log())
    assert sent and waited and fetched, (sent, waited, fetched)
    return {"send": float(sent[-1]), "wait": float(waited[-1]), "fetch": float(fetched[-1])}


@pytest.mark.parametrize("task", A14B)
def test_a_split_group_hands_each_request_over_with_the_pixels_of_one_process(
        tiny_models: Path, input_png: bytes, tmp_path: Path, task: str) -> None:
    """T2V- and I2V-A14B in a group with ``experts: high`` and ``experts: low`` DiT workers:
    the request visits both (events: two high-noise steps from one worker, a ``handover``,
    then a low-noise step from the other), its status ends on the low-noise expert, and its
    MP4 is the one-process pipeline's byte for byte. The handover's parts are logged (and
    printed)."""
    image = _image(task, input_png)
    want = _want(tiny_models, task, image)
    body: dict[str, Any] = {"prompt": "a tiny wave", "task_id": "split-1", **FIELDS}
    if image is not None:
        body["image_path"] = base64.b64encode(image).decode()
    with _group(tiny_models, task, tmp_path) as group:
        high, low = _start(group)
        events = events_of(group, "video", body)
        st = wait_task(group.url, "split-1", timeout=300)
        got = result(group.url, "split-1")
        seconds = _handover_seconds(high, low, group.services[0])
        high_log, low_log = high.log(), low.log()
    assert st["status"] == "completed" and st["expert"] == "low", st
    assert [(d["step"], d["expert"]) for name, d in events if name == "progress"] == \
        [(1, "high"), (2, "high"), (3, "low")]
    dits = [d["worker"] for name, d in events if name == "stage" and d["stage"] == "denoising"]
    assert len(dits) == 2 and dits[0] != dits[1], events  # the high-noise one, the low-noise
    names = [name for name, _ in events]
    assert names.index("handover") < names.index("resumed") < len(names) - 1, names
    assert "yielded" not in names and "failed" not in names, names
    assert st["failures"] == 0 and st["resumes"] == 1, st
    assert np.array_equal(pixels(got, "mp4"), pixels(want.data, "mp4"))
    assert "task split-1: resuming after step 2 of 3" in low_log
    assert "resuming" not in high_log
    print(f"split handover on loopback (CPU, tiny model): {seconds}")


def test_a_low_noise_worker_lost_after_the_take_is_replaced(tiny_models: Path,
                                                            tmp_path: Path) -> None:
    """The low-noise worker dies right after it took the handed-over task (fault point
    ``worker.after_claim``): the task goes back to the controller, waits for a low-noise
    worker (the high-noise one never takes it: a second request runs on it meanwhile), and
    the replacement completes it with the bytes of one process, uncharged."""
    task = "wan22_a14b_t2v"
    want = _want(tiny_models, task)
    with _group(tiny_models, task, tmp_path) as group:
        high, faulty = _start(group, {"faults": "worker.after_claim:exit"})
        body = {"prompt": "a tiny wave", **FIELDS}
        post_ok(group.url, "video", {**body, "task_id": "lost-low"})
        assert faulty.proc.wait(300) == -signal.SIGKILL
        st = wait_task_stage(group, "lost-low", "accepted")
        assert st["checkpoint_step"] == 2, st
        assert (st["waiting_for"], st["waiting_expert"]) == ("transformer", "low"), st
        post_ok(group.url, "video", {**body, "task_id": "meanwhile", "seed": 12})
        wait_log(high, "task meanwhile: handed over to the low-noise expert", timeout=300)
        assert wait_task_stage(group, "lost-low", "accepted")["stage"] == "accepted"
        replacement = group.start("transformer", LOW)
        st = wait_task(group.url, "lost-low", timeout=300)
        other = wait_task(group.url, "meanwhile", timeout=300)
        got = result(group.url, "lost-low")
        high_log, new_log = high.log(), replacement.log()
    assert st["status"] == "completed" and other["status"] == "completed", (st, other)
    assert st["failures"] == 0 and st["expert"] == "low", st
    assert np.array_equal(pixels(got, "mp4"), pixels(want.data, "mp4"))
    assert "task lost-low: resuming after step 2 of 3" in new_log
    assert "resuming" not in high_log


def wait_task_stage(group: LocalGroup, tid: str, stage_name: str,
                    timeout: float = 300) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        st: dict[str, Any] = status(group.url, tid)
        if st["stage"] == stage_name:
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"task {tid}: not {stage_name} after {timeout} s: {st}")
        time.sleep(0.05)


def test_a_drained_low_noise_worker_hands_the_task_to_another(tiny_models: Path,
                                                              tmp_path: Path) -> None:
    """Ten steps (the switch after step 7): the low-noise worker, checkpointing, is drained
    (SIGTERM at its first step boundary, fault point ``dit.step``) and hands the task back
    after step 8; the task waits at the controller for a low-noise worker -- the high-noise
    one, idle, never takes it -- and the next one resumes after step 8 with the bytes of one
    process, uncharged."""
    task = "wan22_a14b_t2v"
    req = GenerationRequest(task=task, prompt="a tiny wave", height=32, width=32,
                            num_frames=9, infer_steps=10, fps=8, seed=11, guidance_scale=4.0,
                            guidance_scale_2=2.0)
    want = LocalPipeline(tiny_models / task, task).run(req)
    ckpt = {"transformer": {"experts": "low", "checkpoint_every_steps": 100}}
    with _group(tiny_models, task, tmp_path) as group:
        high, drained = _start(group, {**ckpt, "faults": "dit.step:signal=TERM:nth=1"})
        post_ok(group.url, "video", {"prompt": "a tiny wave", **FIELDS, "infer_steps": 10,
                                     "task_id": "drained"})
        assert drained.proc.wait(300) == 0, drained.log()[-3000:]
        st = wait_task_stage(group, "drained", "accepted")
        assert st["checkpoint_step"] == 8, st
        replacement = group.start("transformer", LOW)
        st = wait_task(group.url, "drained", timeout=300)
        got = result(group.url, "drained")
        high_log, new_log = high.log(), replacement.log()
    assert st["status"] == "completed" and st["failures"] == 0, st
    assert np.array_equal(pixels(got, "mp4"), pixels(want.data, "mp4"))
    assert "task drained: resuming after step 8 of 10" in new_log
    assert "resuming" not in high_log


def test_a_high_noise_worker_lost_as_it_hands_over(tiny_models: Path, tmp_path: Path) -> None:
    """The high-noise worker dies right after the controller kept its state at the boundary
    (fault point ``dit.checkpointed``), before it reported the handover: the lost worker's
    attempt ends (uncharged), the kept state routes the task to the low-noise worker, which
    finishes it with the bytes of one process; no high-noise step runs again."""
    task = "wan22_a14b_t2v"
    want = _want(tiny_models, task)
    with _group(tiny_models, task, tmp_path) as group:
        group.start("controller")
        group.wait_http(timeout=120)
        group.start("encoder")
        faulty = group.start("transformer", {**HIGH, "faults": "dit.checkpointed:exit"})
        low = group.start("transformer", LOW)
        group.start("decoder")
        group.wait_workers({"encoder": 1, "transformer": 2, "decoder": 1}, timeout=600)
        post_ok(group.url, "video", {"prompt": "a tiny wave", **FIELDS, "task_id": "lost-high"})
        assert faulty.proc.wait(300) == -signal.SIGKILL
        st = wait_task(group.url, "lost-high", timeout=300)
        got = result(group.url, "lost-high")
        low_log = low.log()
    assert st["status"] == "completed" and st["failures"] == 0 and st["expert"] == "low", st
    assert (st["resumes"], st["resumed_from"]) == (1, 2), st
    assert np.array_equal(pixels(got, "mp4"), pixels(want.data, "mp4"))
    assert "task lost-high: resuming after step 2 of 3" in low_log


# -- the launcher --------------------------------------------------------------------------------
START_SCRIPTS = ROOT / "scripts" / "server" / "disagg" / "wan"
PORTS = {"wan22_a14b_t2v": (8020, 18021, 18023), "wan22_a14b_i2v": (8024, 18025, 18027)}
"""Front door and the high- and low-noise workers' metrics ports of each split group."""


@pytest.mark.timeout(900)  # five services starting on a loaded machine
@pytest.mark.parametrize("task", A14B)
def test_the_start_script_starts_a_split_group(tiny_models: Path, input_png: bytes,
                                               tmp_path: Path, task: str) -> None:
    """``EXPERTS=split`` on the A14B start scripts (``python -m launcher --split``): the
    launcher starts a high-noise and a low-noise DiT worker from the two transformer role
    files, each with its own metrics port, log and pid; a request visits both (the high-noise
    worker hands over at the boundary, the low-noise one resumes) and completes; SIGINT stops
    all five services."""
    offset = free_offset(task, "wan", split=True)
    front, high_metrics, low_metrics = (port + offset for port in PORTS[task])
    env = {**launcher_env(tmp_path, tiny_models / task, offset), "EXPERTS": "split",
           "TRANSFORMER_GPU": "cpu,cpu"}
    group = Launched(START_SCRIPTS / f"start_{task}_disagg.sh", env, tmp_path / "logs")
    try:
        group.wait_for("group ready", timeout=600)
        out = group.output()
        assert "transformer high cpu, transformer low cpu" in out, out
        for port in (high_metrics, low_metrics):  # each half's, from its own role file
            assert f"127.0.0.1:{port}/metrics" in out, out
        assert "2 transformers registered with the controller" in out, out
        pids = group.pids()
        assert sorted(pids) == sorted(["controller", "encoder", "transformer_high",
                                       "transformer_low", "decoder"]), pids
        url = f"http://127.0.0.1:{front}"
        body: dict[str, Any] = {"prompt": "a tiny wave", "task_id": "launched-split", **FIELDS}
        image = _image(task, input_png)
        if image is not None:
            body["image_path"] = base64.b64encode(image).decode()
        post_ok(url, "video", body)
        st = wait_task(url, "launched-split", timeout=600)
        assert st["status"] == "completed" and st["expert"] == "low", st
        assert st["failures"] == 0 and st["resumes"] == 1, st
        assert result(url, "launched-split")
        logs = tmp_path / "logs"
        high_log = (logs / "transformer_high.log").read_text(errors="replace")
        low_log = (logs / "transformer_low.log").read_text(errors="replace")
        assert "task launched-split: handed over to the low-noise expert" in high_log
        assert "task launched-split: resuming after step 2 of 3" in low_log
        assert "resuming" not in high_log
        os.kill(group.proc.pid, signal.SIGINT)
        assert group.proc.wait(180) == 130
        left = {key: pid for key, pid in pids.items() if pid_alive(pid)}
        assert not left, f"left running: {left}\n{group.output()}"
    finally:
        group.cleanup()  # whatever happened: the script, then any service it left, by pid


def wait_waiting_low(group: LocalGroup, tid: str, timeout: float = 300) -> dict[str, Any]:
    """``tid``'s status once it waits, accepted at the controller, for a low-noise worker."""
    deadline = time.monotonic() + timeout
    while True:
        st: dict[str, Any] = status(group.url, tid)
        if st["stage"] == "accepted" and st.get("waiting_expert") == "low":
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"task {tid}: not waiting for a low-noise worker: {st}")
        time.sleep(0.05)


def test_a_controller_restart_keeps_a_handed_over_task_for_a_low_noise_worker(
        tiny_models: Path, tmp_path: Path) -> None:
    """The controller is SIGKILLed while a handed-over task waits for a low-noise worker
    (none started yet) and started again on the same task store: the task, restored from its
    journal and checkpoint files (their ``split`` and next-expert marks), waits again for a
    low-noise worker -- never in the Phase1 ring, so the reconnected high-noise worker never
    takes it -- and the low-noise worker started then completes it with the pixels of one
    process, uncharged."""
    task, tid = "wan22_a14b_t2v", "restart-low"
    want = _want(tiny_models, task)
    state_file = tmp_path / "results" / ".journal" / "checkpoints" / f"{tid}.state"
    with _group(tiny_models, task, tmp_path) as group:
        group.start("controller")
        group.wait_http(timeout=120)
        group.start("encoder")
        high = group.start("transformer", HIGH)
        group.start("decoder")
        group.wait_workers({"encoder": 1, "transformer": 1, "decoder": 1}, timeout=600)
        post_ok(group.url, "video", {"prompt": "a tiny wave", **FIELDS, "task_id": tid})
        st = wait_waiting_low(group, tid)
        assert (st["checkpoint_step"], st["failures"]) == (2, 0), st
        wait_for(state_file.exists, f"{state_file} written")  # files are written off the loop
        old = group.services[0]
        os.kill(old.proc.pid, signal.SIGKILL)
        old.proc.wait()
        group.services.remove(old)  # reaped: no longer part of the group
        group.start("controller")
        group.wait_http(timeout=120)
        group.wait_workers({"encoder": 1, "transformer": 1, "decoder": 1}, timeout=300)
        st = wait_waiting_low(group, tid)
        assert st["checkpoint_step"] == 2 and st["failures"] == 0, st
        # A second request runs on the reconnected high-noise worker meanwhile (it would pull
        # the restored task first were it in the Phase1 ring) and waits behind it.
        post_ok(group.url, "video", {"prompt": "a tiny wave", **FIELDS, "seed": 12,
                                     "task_id": "after-restart"})
        wait_log(high, "task after-restart: handed over to the low-noise expert", timeout=300)
        assert wait_waiting_low(group, tid)["stage"] == "accepted"
        low = group.start("transformer", LOW)
        st = wait_task(group.url, tid, timeout=300)
        other = wait_task(group.url, "after-restart", timeout=300)
        got = result(group.url, tid)
        high_log, low_log = high.log(), low.log()
    assert st["status"] == "completed" and other["status"] == "completed", (st, other)
    assert st["failures"] == 0 and st["expert"] == "low", st
    assert (st["resumes"], st["resumed_from"]) == (1, 2), st
    assert np.array_equal(pixels(got, "mp4"), pixels(want.data, "mp4"))
    assert f"task {tid}: resuming after step 2 of 3" in low_log
    assert "resuming" not in high_log
