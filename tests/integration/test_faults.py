"""The fault-point registry (contracts.faults): spec parsing, firing conditions, actions."""

from __future__ import annotations

import errno
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from contracts import faults
from contracts.config import ServiceConfig
from contracts.errors import ConfigError, ConnectionLost, FaultInjected
from run_service import _parse, build_config
from tests.support.paths import ROOT

pytestmark = pytest.mark.integration  # starts processes or servers


@pytest.fixture(autouse=True)
def disarm() -> Iterator[None]:
    yield
    faults.configure(None)


def test_off_by_default_and_a_disarmed_point_does_nothing() -> None:
    assert faults.ON is False
    faults.hit("worker.after_pop")  # no fault armed: returns


@pytest.mark.parametrize(("spec", "needle"), [
    ("worker.after_popp:exit", "unknown fault point 'worker.after_popp'"),
    ("worker.after_pop:explode", "unknown action 'explode'"),
    ("worker.after_pop", "expected point:action"),
    ("worker.after_pop:exit:twice", "unknown condition 'twice'"),
    ("worker.after_pop:exit:nth=0", "at least 1"),
    ("transfer.read:raise:p=2", "p must be in 0..1"),
    ("worker.after_pop:sleep=x", "not a number"),
    ("control.drop:raise,control.drop:exit", "armed twice"),
])
def test_bad_specs_are_named(spec: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(needle)):
        faults.parse(spec)


def test_conditions() -> None:
    faults.configure("control.drop:raise:nth=2,transfer.read:raise:every=3,"
                     "worker.stage:raise:once,worker.after_claim:sleep=0.01")
    fired = []
    for i in range(1, 7):
        for point in ("control.drop", "transfer.read", "worker.stage", "worker.after_claim"):
            try:
                faults.hit(point, ConnectionLost)
            except ConnectionLost as exc:
                assert f"fault point {point} fired" in str(exc)
                fired.append((i, point))
    assert fired == [(1, "worker.stage"), (2, "control.drop"), (3, "transfer.read"),
                     (6, "transfer.read")]
    assert faults.fired() == {"control.drop": 1, "transfer.read": 2, "worker.stage": 1,
                              "worker.after_claim": 6}


def test_a_fault_that_lasts_while_a_file_exists(tmp_path: Path) -> None:
    flag = tmp_path / "full"
    faults.configure(f"decoder.before_write:raise:while={flag}")
    faults.hit("decoder.before_write", faults.no_space)  # no file: nothing fires
    flag.touch()
    for _ in range(3):
        with pytest.raises(OSError, match="No space left") as info:
            faults.hit("decoder.before_write", faults.no_space)
        assert info.value.errno == errno.ENOSPC
    flag.unlink()
    faults.hit("decoder.before_write", faults.no_space)
    assert faults.fired() == {"decoder.before_write": 3}
    with pytest.raises(ConfigError, match="while=PATH"):
        faults.parse("decoder.before_write:raise:while=")


def test_a_hold_stays_at_the_point_until_its_gate_is_deleted(tmp_path: Path) -> None:
    import threading

    gate = tmp_path / "gate"
    gate.touch()
    faults.configure(f"dit.step:hold={gate}:nth=2")
    faults.hit("dit.step")  # the first hit: not due, passes
    passed = threading.Event()
    thread = threading.Thread(target=lambda: (faults.hit("dit.step"), passed.set()))
    thread.start()
    # Held: the thread is inside the point (it fired) and has not come out while the gate is
    # there. Waited for by the fired count, an event, not by a pause.
    while faults.fired() != {"dit.step": 1}:
        thread.join(0.01)
    assert not passed.is_set() and thread.is_alive()
    gate.unlink()
    thread.join(60)
    assert passed.is_set()
    faults.hit("dit.step")  # third hit: not due
    with pytest.raises(ConfigError, match="hold=PATH"):
        faults.parse("dit.step:hold=")


def test_raise_defaults_to_fault_injected() -> None:
    faults.configure("worker.before_publish:raise")
    with pytest.raises(FaultInjected):
        faults.hit("worker.before_publish")


def test_exit_kills_the_process_without_cleanup(tmp_path: Path) -> None:
    marker = tmp_path / "atexit"
    code = (
        "import atexit, pathlib; from contracts import faults\n"
        f"atexit.register(lambda: pathlib.Path({str(marker)!r}).write_text('ran'))\n"
        "faults.configure('worker.after_pop:exit')\n"
        "faults.hit('worker.after_pop')\n"
        "print('survived')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == -9 and "survived" not in proc.stdout
    assert "fault point worker.after_pop fired" in proc.stderr
    assert not marker.exists()


def test_environment_wins_over_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text('{"disagg_mode": "encoder", "faults": "worker.after_pop:exit"}')
    _, cfg = build_config(_parse(["--config", str(path)]), {})
    assert cfg.faults == "worker.after_pop:exit"
    _, cfg = build_config(_parse(["--config", str(path)]),
                          {"DIFFRING_FAULTS": "transfer.read:raise"})
    assert cfg.faults == "transfer.read:raise"
    with pytest.raises(ConfigError, match="unknown fault point"):
        build_config(_parse(["--config", str(path)]), {"DIFFRING_FAULTS": "nope:exit"})
    with pytest.raises(ConfigError, match="unknown fault point"):
        ServiceConfig(faults="nope:exit")


def test_every_point_is_compiled_in_exactly_once() -> None:
    sources = "\n".join(p.read_text() for pkg in ("workers", "tensorplane", "controller")
                        for p in (ROOT / pkg).rglob("*.py"))
    for point in faults.POINTS:
        # A start-up boundary passes its point on: StopSignal.boundary("startup...").
        hits = sources.count(f'faults.hit("{point}"') + sources.count(f'boundary("{point}"')
        assert hits == 1, point
