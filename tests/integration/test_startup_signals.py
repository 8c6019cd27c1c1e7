"""A stop signal during start-up is never lost (workers/startup.py).

In-process: the handler records and wakes, and a signal that lands inside a library's
``except Exception`` is still acted on at the next boundary. Processes: a signal delivered at
exactly each start-up boundary (fault points ``startup.*``, action ``signal=TERM``) and a
sweep of delays over a whole start-up on a loaded machine; each ends in a prompt, clean exit.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from contracts import faults
from contracts.errors import ConfigError
from contracts.pipelines import TASK_SPECS
from launcher import LocalGroup, Service, group_config
from tests.support.waits import wait_log
from workers.startup import StartupAborted, StopSignal

pytestmark = pytest.mark.integration  # starts processes or servers

PIPELINE = "wan_t2v"
STOPPED = "stopped before it was ready"
STARTING = "worker starting (pid"
"""Logged once the handler is installed: a signal before it kills the process (-SIGTERM),
which is a prompt stop too."""
EXIT_S = 90.0
"""How long a signalled worker may take to exit on a loaded 2-core machine. A lost signal
shows as a worker that goes on (its reconnect_timeout_s below is longer than this)."""


@pytest.fixture
def stop_signal() -> Iterator[StopSignal]:
    stop = StopSignal()
    stop.install()
    try:
        yield stop
    finally:
        stop.uninstall()


def test_a_signal_inside_a_library_except_block_is_acted_on_at_the_boundary(
        stop_signal: StopSignal) -> None:
    woke = threading.Event()
    stop_signal.on_stop(woke.set)
    try:  # what the imports of the model stack do around optional parts
        signal.raise_signal(signal.SIGTERM)
        raise ImportError("an optional backend is missing")
    except Exception:
        pass
    assert woke.wait(30), "the relay thread never passed the stop on"
    assert stop_signal.requested.is_set()
    with pytest.raises(StartupAborted, match="signal 15"):
        stop_signal.boundary("startup.imported")


def test_a_listener_added_after_the_signal_is_called_at_once(stop_signal: StopSignal) -> None:
    signal.raise_signal(signal.SIGINT)
    assert stop_signal.requested.wait(30)
    called = []
    stop_signal.on_stop(lambda: called.append(1))
    assert called == [1]


def test_the_signal_fault_action() -> None:
    assert faults.parse("startup.model:signal=TERM:once")["startup.model"].signum == 15
    with pytest.raises(ConfigError, match="TERM, INT"):
        faults.parse("startup.model:signal=KILL")
    with pytest.raises(ConfigError, match="unknown action"):
        faults.parse("startup.model:signal")


# -- processes -------------------------------------------------------------------------------
def _group(tiny_models: Path, workdir: Path, pipeline: str = PIPELINE) -> LocalGroup:
    # A worker that lost the signal would retry for longer than the test waits.
    workdir.mkdir(exist_ok=True)
    cfg = group_config(pipeline, str(tiny_models / pipeline), workdir,
                       reconnect_timeout_s=3 * EXIT_S)
    return LocalGroup(cfg, workdir)


def _exit(svc: Service, signalled_at: float | None = None) -> int:
    left = EXIT_S if signalled_at is None else max(1.0, signalled_at + EXIT_S - time.monotonic())
    try:
        return svc.proc.wait(left)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"worker still running {EXIT_S:g} s after the signal:\n"
                             f"{svc.log()[-3000:]}") from None


# point armed -> the boundary that acts on it (a retry wait is woken, the next one stops it)
BOUNDARIES = {
    "startup.imported": "startup.imported",
    "startup.transport": "startup.transport",
    "startup.retry_wait": "startup.connected",
    "startup.connected": "startup.connected",
    "startup.component": "startup.component",
    "startup.model": "startup.model",
    "startup.ready": "startup.ready",
}


def test_a_signal_at_each_start_up_boundary_stops_the_worker_there(
        tiny_models: Path, tmp_path: Path) -> None:
    """One worker per boundary, each sent SIGTERM (one SIGINT) at exactly that step: each
    exits 0 from that boundary, having run no later step. The synthetic pipeline (no torch
    to import) but for the model components, which are Wan's."""
    absent = _group(tiny_models, tmp_path / "absent", "synthetic")  # the retry wait
    wan = TASK_SPECS[PIPELINE]
    with _group(tiny_models, tmp_path, "synthetic") as group:
        group.start("controller")
        group.wait_http()
        workers: dict[str, Service] = {}
        for point in BOUNDARIES:
            sig = "INT" if point == "startup.component" else "TERM"
            where = absent if point == "startup.retry_wait" else group
            where.env = {"DIFFRING_FAULTS": f"{point}:signal={sig}:once"}
            extra = None
            if point == "startup.component":  # the controller only connects back to it
                extra = {"model_cls": wan.model_cls, "task": wan.task,
                         "model_path": str(tiny_models / PIPELINE)}
            workers[point] = where.start("transformer", extra)
        try:
            for point, svc in workers.items():
                rc = _exit(svc)
                log = svc.log()
                assert rc == 0, log[-3000:]
                assert f"fault point {point} fired" in log, log[-3000:]
                assert f"{STOPPED} (signal" in log and f"stopped at {BOUNDARIES[point]})" in log, (
                    log[-3000:])
                if point != "startup.ready":
                    assert "ready: pipeline=" not in log, log[-3000:]
        finally:
            absent.stop()


def _sweep_one(group: LocalGroup, delay: float) -> None:
    svc = group.start("transformer")
    time.sleep(delay)  # the sweep itself: where in the start-up the signal lands
    svc.proc.send_signal(signal.SIGTERM)
    rc = _exit(svc, time.monotonic())
    log = svc.log()
    if rc == -signal.SIGTERM:  # before the handler existed: the default action, a stop too
        assert STARTING not in log, log[-3000:]
        return
    assert rc == 0, log[-3000:]
    # Before it was ready, or drained once it ran: never a worker that goes on starting.
    assert STOPPED in log or "draining" in log, log[-3000:]


def test_a_signal_at_any_instant_of_a_loaded_start_up_is_never_lost(
        tiny_models: Path, tmp_path: Path) -> None:
    """SIGTERM at a sweep of delays over a whole start-up of a Wan DiT worker (with a
    controller: imports, transport, the model stack's imports and components, register;
    without: the retry wait), two at a time, so that the start-ups load both cores: every
    worker exits promptly and cleanly."""
    absent = _group(tiny_models, tmp_path / "absent")
    with _group(tiny_models, tmp_path) as group:
        group.start("controller")
        group.wait_http()
        # How long one start-up to ready takes here, now: the sweep spans it.
        first = group.start("transformer")
        t0 = time.monotonic()
        wait_log(first, "ready: pipeline=", timeout=300)
        span = 1.3 * (time.monotonic() - t0)
        first.proc.send_signal(signal.SIGTERM)
        assert _exit(first) == 0
        try:
            with ThreadPoolExecutor(2) as pool:
                for i in range(3):  # result(): the first failure raises
                    pair = [pool.submit(_sweep_one, where, span * (0.05 + 0.45 * i))
                            for where in (group, absent)]
                    for fut in pair:
                        fut.result()
        finally:
            absent.stop()


def test_a_signal_during_the_controller_start_up_stops_it(
        tiny_models: Path, tmp_path: Path) -> None:
    """The controller sets an asyncio event from its handler (nothing raised): a signal at
    any instant of its start-up stops it promptly, 0 once the handler exists."""
    with _group(tiny_models, tmp_path) as group:
        first = group.start("controller")
        t0 = time.monotonic()
        group.wait_http(timeout=300)
        wait_log(first, "controller ready")  # its own front door, not another's on the port
        span = 1.3 * (time.monotonic() - t0)
        first.proc.send_signal(signal.SIGTERM)
        assert _exit(first) == 0
        for i in range(5):
            svc = group.start("controller")
            time.sleep(span * i / 4)  # the sweep
            svc.proc.send_signal(signal.SIGTERM)
            rc = _exit(svc, time.monotonic())
            assert rc in (0, -signal.SIGTERM), svc.log()[-3000:]
            group.services.remove(svc)

