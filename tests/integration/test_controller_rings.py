"""The controller process hosting its three rings, its config handling and the inspect CLI."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rings.soak import stop_process as stop
from tests.support.controller import (
    TOKEN,
    Controller,
    controller_config,
    ring_of,
    run_controller_to_exit,
    start_controller,
)
from tests.support.paths import ROOT

pytestmark = pytest.mark.integration  # starts processes or servers


def inspect_cli(ctl: Controller, *args: str) -> subprocess.CompletedProcess[str]:
    """``diffring inspect --config``: the rings' own command, with the file's ports and token."""
    return subprocess.run(
        [sys.executable, "-m", "diffring_cli", "inspect", "--config", str(ctl.config_path),
         *args],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        timeout=60,
    )


def test_three_rings_each_on_its_port(controller: Controller) -> None:
    for name in ("request", "phase1", "phase2"):
        ring = ring_of(controller, name)
        ring.push({"kind": "probe", "task_id": f"t-{name}"}, timeout=2)
        assert ring.pop(timeout=2) == {"kind": "probe", "task_id": f"t-{name}"}
        ring.verbs.close()


def test_inspect_reports_and_never_changes(controller: Controller) -> None:
    ring = ring_of(controller, "request")
    ring.push({"kind": "task", "task_id": "abc"}, timeout=2)
    ring.push({"kind": "task", "task_id": "def"}, timeout=2)
    out = inspect_cli(controller)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:9] == [
        "ring",
        "slots",
        "slot_size",
        "head",
        "tail",
        "depth",
        "published",
        "claimed",
        "tombstones",
    ]
    request = next(line.split() for line in lines if line.startswith("request"))
    assert request[:8] == ["request", "3", "512", "0", "2", "2", "2", "0"]
    slots = inspect_cli(controller, "--slots")
    assert "task_id=abc" in slots.stdout and "task_id=def" in slots.stdout
    data = json.loads(inspect_cli(controller, "--json", "--slots").stdout)
    assert [r["ring"] for r in data] == ["request", "phase1", "phase2"]
    assert data[0]["published"] == 2 and data[0]["slots"][0]["state"] == "published"
    assert data[0]["slots"][0]["payload_bytes"] > 0
    # Inspection claimed nothing: the items are still there, in order.
    assert ring.pop(timeout=2)["task_id"] == "abc"
    assert ring.pop(timeout=2)["task_id"] == "def"


def test_inspect_unreachable_controller_fails_clearly() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def rings_inspect(*args: str) -> subprocess.CompletedProcess[str]:
        ports = [f"--{ring}-port={port}" for ring in ("request", "phase1", "phase2")]
        return subprocess.run(
            [sys.executable, "-m", "rings", "inspect", *ports, *args],
            capture_output=True, text=True, cwd=str(ROOT), timeout=60,
            env={"PATH": "/usr/bin:/bin"},  # no DIFFRING_CLUSTER_TOKEN
        )

    out = rings_inspect("--token", TOKEN)
    assert out.returncode == 1
    assert "unreachable" in out.stdout
    # The rings know no service configuration, hence no development token of their own.
    out = rings_inspect()
    assert out.returncode == 2 and "pass --token" in out.stderr
    out = rings_inspect("--config", "x.json")
    assert out.returncode == 2 and "diffring inspect --config FILE" in out.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_shuts_down_cleanly(tmp_path: Path, sig: signal.Signals) -> None:
    ctl = start_controller(tmp_path, controller_config(tmp_path))
    ring = ring_of(ctl, "phase1")
    ctl.proc.send_signal(sig)
    assert ctl.proc.wait(60) == 0
    assert "controller shutting down" in ctl.log()
    for port in ctl.ports.values():  # every port is released
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
    ring.verbs.close()


def test_unknown_config_key_is_named(tmp_path: Path) -> None:
    cfg = controller_config(tmp_path)
    cfg["disagg_config"]["rdma_buffer_slotz"] = 4
    out = run_controller_to_exit(tmp_path, cfg)
    assert out.returncode == 2
    assert "unknown config key disagg_config.rdma_buffer_slotz" in out.stderr


def test_lightx2v_keys_are_honoured(tmp_path: Path) -> None:
    cfg = controller_config(tmp_path, slots=5, slot_size=1024)
    cfg["disagg_config"]["bootstrap_room"] = 0  # LightX2V's; meaningless here, accepted
    ctl = start_controller(tmp_path, cfg)
    try:
        ring = ring_of(ctl, "phase2")
        assert ring.layout.slot_count == 5 and ring.layout.slot_size == 1024
        ring.verbs.close()
        assert "bootstrap_room is ignored" in ctl.log()
    finally:
        stop(ctl.proc)


def test_port_in_use_fails_fast(tmp_path: Path) -> None:
    cfg = controller_config(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", cfg["disagg_config"]["rdma_phase1_handshake_port"]))
        s.listen()
        out = run_controller_to_exit(tmp_path, cfg)
    assert out.returncode == 2
    assert (
        f"cannot listen on 127.0.0.1:{cfg['disagg_config']['rdma_phase1_handshake_port']}"
        in out.stderr
    )


def test_controller_rings_use_the_verbs_the_hosts_start_with(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On rdma, ``RingHost.start()`` swaps its local verbs for the NIC loopback; the
    controller's own rings must be built on what the hosts hold after starting."""
    import asyncio

    from contracts.disagg import DisaggConfig
    from controller.rings_host import ControllerRings
    from rings.host import RingHost
    from rings.layout import HOLDER_LOCAL
    from rings.verbs import LocalVerbs

    original = RingHost.start

    async def start(self: RingHost) -> None:
        await original(self)
        self.local = LocalVerbs(self.region, HOLDER_LOCAL)  # stands in for the NIC loopback

    monkeypatch.setattr(RingHost, "start", start)
    disagg = DisaggConfig(
        ring_transport="tcp",
        control_port=0,
        rdma_request_handshake_port=0,
        rdma_phase1_handshake_port=0,
        rdma_phase2_handshake_port=0,
    )

    async def run() -> None:
        rings = ControllerRings(disagg, TOKEN)
        await rings.start()
        try:
            for name, host in rings.hosts.items():
                assert rings.local[name].verbs is host.local
        finally:
            await rings.close()

    asyncio.run(run())
