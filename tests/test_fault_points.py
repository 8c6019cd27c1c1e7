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
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from controller.group import LocalGroup, Service, group_config, wait_task

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
    # test is about the points, the quarantine has its own (tests/test_recovery.py).
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
    # are charged to their tasks.
    charged: dict[str, Any] = {tid: st["failures"] for tid, st in final.items()}
    assert sum(charged.values()) == 2, charged
    recovery = status["recovery"]
    assert recovery["reconciled"] >= 1  # the item popped by the encoder killed after its pop
    assert recovery["workers_lost"] >= 3
    assert "lost the controller" in healthy_logs["decoder"]  # the dropped control connection
