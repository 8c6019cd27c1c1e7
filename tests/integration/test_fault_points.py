"""Kill or fail a worker at each named fault point (contracts.faults), with real processes:
every task still completes, exactly once.

One group serves every point, to keep the test short: the faulty workers (one per point that
kills its process) and three healthy ones start together; the healthy ones are SIGSTOPped
before any task exists, so only faulty workers can take the tasks at first, and each healthy
one is let go (SIGCONT) once every faulty worker of its role has died at its point. The
healthy ones carry the points that fail without killing (control connection drop, Mooncake
read failure, stage exception), each firing once.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from launcher import LocalGroup, Service, free_ports, group_config, wait_task

pytestmark = pytest.mark.integration  # starts processes or servers

PIPELINE = "synthetic"
BODY = {"prompt": "a fault test"}

# Each kills its worker (SIGKILL, no cleanup) the first time a task reaches it.
KILLS = {
    "encoder": ["worker.after_pop:exit", "worker.after_publish:exit"],
    "transformer": ["worker.after_claim:exit", "transfer.pull:exit",
                    "worker.before_publish:exit"],
    "decoder": ["decoder.result_write:exit"],
}
# Each fails one attempt and the worker goes on.
# (Not on the encoder: a producer that reconnects looks gone to the controller, and its
# consumer's read failure would then be free, which this test counts on being charged.)
FAILS = {
    "encoder": "",
    "transformer": "transfer.read:raise:nth=1",
    "decoder": "worker.stage:raise:nth=1,control.drop:raise:nth=12",
}


def _wait_dead(svc: Service, timeout: float) -> int:
    try:
        return svc.proc.wait(timeout)
    except Exception:
        raise AssertionError(f"{svc.role} with faults never died:\n{svc.log()[-3000:]}") from None


def test_kill_or_fail_at_every_point_and_each_task_completes_once(
        tiny_models: Path, tmp_path: Path) -> None:
    # One task may meet all three faulty transformers in a row (idle workers are woken
    # together), which the default poison_worker_deaths (3) would rightly quarantine; this
    # test is about the points, the quarantine has its own (tests/unit/test_recovery.py).
    cfg = group_config(PIPELINE, str(tiny_models / PIPELINE), tmp_path, lease_timeout_s=3.0,
                       heartbeat_interval_s=0.5, poison_worker_deaths=10)
    with LocalGroup(cfg, tmp_path) as group:
        group.start("controller")
        group.wait_http()
        faulty: dict[str, list[Service]] = {role: [] for role in KILLS}
        for role, specs in KILLS.items():
            for spec in specs:
                faulty[role].append(group.start(role, {"faults": spec}))
        healthy = {role: group.start(role, {"faults": FAILS[role] or None}) for role in KILLS}
        group.wait_workers({r: len(s) + 1 for r, s in KILLS.items()}, timeout=600)
        for svc in healthy.values():
            os.kill(svc.proc.pid, signal.SIGSTOP)  # registered, and takes nothing for now
        ids = [f"fp-{i}" for i in range(4)]
        for i, tid in enumerate(ids):
            r = httpx.post(f"{group.url}/v1/tasks/image/",
                           json={**BODY, "seed": i, "task_id": tid}, timeout=30)
            assert r.status_code == 200, r.text
        for role in KILLS:  # the encoders die first, then the transformers, the decoder
            for svc in faulty[role]:
                assert _wait_dead(svc, 300) == -signal.SIGKILL
            os.kill(healthy[role].proc.pid, signal.SIGCONT)
        final = {tid: wait_task(group.url, tid, timeout=300) for tid in ids}
        status = httpx.get(f"{group.url}/v1/service/status", timeout=10).json()
        controller_log = group.services[0].log()
        healthy_logs = {role: svc.log() for role, svc in healthy.items()}
        for svc in healthy.values():
            assert svc.proc.poll() is None, svc.log()[-3000:]
    results = tmp_path / "results"
    for tid, st in final.items():
        assert st["status"] == "completed", (st.get("error_type"), st.get("error"), st)
        assert controller_log.count(f"task {tid} stage=completed") == 1
        assert [p.name for p in results.glob(f"{tid}.*")] == [f"{tid}.png"]
    assert not list(results.glob("*.part"))
    # Each point fired where it was armed.
    for role, specs in KILLS.items():
        for spec, svc in zip(specs, faulty[role], strict=True):
            assert f"fault point {spec.split(':')[0]} fired" in svc.log()
    for role, spec in FAILS.items():
        for entry in filter(None, spec.split(",")):
            assert f"fault point {entry.split(':')[0]} fired" in healthy_logs[role], role
    # Every kill was free; the stage exception and the read failure from a live producer
    # are charged to their tasks -- each as the controller judged it when the report came.
    # On a loaded machine that judgement may rightly be "free": the decoder's dropped
    # connection (control.drop counts heartbeats too) may take the stage failure's report
    # with it, a starved holder's lease may expire first, a starved producer may look gone.
    # So the charges are counted from the controller's log, and must be exactly those: a
    # kill, a lease expiry or a freed buffer (a checksum failure) adds none.
    reported = (controller_log.count("(StageError, task): fault point worker.stage fired")
                + controller_log.count("(TransferFailed, transfer): mooncake read of"))
    free = (controller_log.count("(its producer is gone); retrying")
            + controller_log.count("transfer failure refunded"))
    charged: dict[str, Any] = {tid: st["failures"] for tid, st in final.items()}
    assert sum(charged.values()) == reported - free, (charged, reported, free)
    recovery = status["recovery"]
    assert recovery["reconciled"] >= 1  # the item popped by the encoder killed after its pop
    assert recovery["workers_lost"] >= 3
    assert "lost the controller" in healthy_logs["decoder"]  # the dropped control connection


def _wait(what: str, ok: Callable[[], bool], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _pool_blocks(port: int) -> int:
    """Live blocks in the staging pool of the worker whose metrics are on ``port``."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    m = re.search(r"^diffring_staging_pool_blocks\{[^}]*\} (\S+)$", text, re.M)
    assert m, text[-2000:]
    return int(float(m.group(1)))


def test_producer_frees_a_superseded_attempt_and_keeps_the_current_one(
        tiny_models: Path, tmp_path: Path) -> None:
    """The encoder holds attempt 1's outputs of a task (the DiT that claimed them died at
    ``worker.after_claim``, before pulling) beside attempt 2's, which the next DiT will read.
    Its heartbeat frees attempt 1's only: were attempt 2's freed too, the next tasks' outputs
    would be staged in their place and the DiT's read of attempt 2 would fail its checksum,
    charged to the task as its own fault (found under load, where a read comes late)."""
    cfg = group_config(PIPELINE, str(tiny_models / PIPELINE), tmp_path, lease_timeout_s=3.0,
                       heartbeat_interval_s=0.5)
    (metric_port,) = free_ports(1)
    with LocalGroup(cfg, tmp_path) as group:
        group.start("controller")
        group.wait_http()
        group.start("encoder", {"server": {**cfg["server"], "metric_port": metric_port}})
        doomed = group.start("transformer", {"faults": "worker.after_claim:exit"})
        dit = group.start("transformer")
        group.start("decoder")
        group.wait_workers({"encoder": 1, "transformer": 2, "decoder": 1}, timeout=600)
        for svc in (doomed, dit):
            os.kill(svc.proc.pid, signal.SIGSTOP)  # registered, and takes nothing for now

        def stage(tid: str, attempt: int, want: str) -> Callable[[], bool]:
            def ok() -> bool:
                st = httpx.get(f"{group.url}/v1/tasks/{tid}/status", timeout=30).json()
                assert st["status"] not in ("completed", "failed", "cancelled"), st
                return bool(st["attempt"] == attempt and st["stage"] == want)
            return ok

        def post(tid: str, seed: int) -> None:
            r = httpx.post(f"{group.url}/v1/tasks/image/",
                           json={**BODY, "seed": seed, "task_id": tid}, timeout=30)
            assert r.status_code == 200, r.text

        post("twice", 0)
        _wait("attempt 1 staged", stage("twice", 1, "phase1"))
        per_attempt = _pool_blocks(metric_port)
        assert per_attempt > 0
        os.kill(doomed.proc.pid, signal.SIGCONT)  # claims attempt 1 and dies, pulling nothing
        assert _wait_dead(doomed, 300) == -signal.SIGKILL
        _wait("attempt 2 staged", stage("twice", 2, "phase1"))
        # Both attempts' outputs were staged; a heartbeat frees what nobody will pull.
        _wait("the encoder freeing attempt 1's outputs",
              lambda: _pool_blocks(metric_port) < 2 * per_attempt)
        assert _pool_blocks(metric_port) == per_attempt, "attempt 2's outputs were freed"
        # Two more tasks: with attempt 2's blocks freed they would be staged over them.
        for i, tid in enumerate(("after-1", "after-2"), start=1):
            post(tid, i)
            _wait(f"{tid} staged", stage(tid, 1, "phase1"))
        os.kill(dit.proc.pid, signal.SIGCONT)
        final = {tid: wait_task(group.url, tid, timeout=300)
                 for tid in ("twice", "after-1", "after-2")}
    for tid, st in final.items():
        assert st["status"] == "completed", (tid, st.get("error"), st)
        assert st["failures"] == 0, (tid, st.get("error"), st)  # no fault of the task's own
    assert final["twice"]["attempt"] == 2
