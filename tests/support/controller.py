"""A controller process started alone (no workers), from a config written here, and what a
test reaches it with: its ring ports, its log, a peer's ring handle. Stopped by pid
(``rings.soak.stop_process``) by the test that started it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher import free_ports
from rings.layout import RingLayout
from rings.ring import Ring
from rings.soak import stop_process
from rings.transports import connect
from tests.support.paths import ROOT
from tests.support.waits import wait_log, wait_port

TOKEN = "test-cluster-token"
"""The cluster token of the controllers and ring hosts the tests start."""


@dataclass
class Controller:
    proc: subprocess.Popen[str]
    config_path: Path
    config: dict[str, Any]
    ports: dict[str, int]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def controller_config(
    tmp: Path, slots: int = 8, slot_size: int = 4096, **disagg: Any
) -> dict[str, Any]:
    ctl, req, p1, p2, http = free_ports(5)
    return {
        "disagg_mode": "controller",
        "disagg_config": {
            "control_port": ctl,
            "rdma_request_handshake_port": req,
            "rdma_phase1_handshake_port": p1,
            "rdma_phase2_handshake_port": p2,
            "rdma_buffer_slots": slots,
            "rdma_buffer_slot_size": slot_size,
            "cluster_token": TOKEN,
            **disagg,
        },
        "server": {"host": "127.0.0.1", "port": http},
    }


def start_controller(
    tmp: Path, cfg: dict[str, Any], extra_args: list[str] | None = None
) -> Controller:
    path = tmp / f"controller-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(cfg))
    log_path = path.with_suffix(".log")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "run_service.py"),
            "--service",
            "controller",
            "--config",
            str(path),
        ]
        + (extra_args or []),
        stdout=log_path.open("w"),
        stderr=subprocess.STDOUT,
        text=True,
        cwd=str(ROOT),
        env=env,
    )
    d = cfg["disagg_config"]
    ports = {
        "request": d["rdma_request_handshake_port"],
        "phase1": d["rdma_phase1_handshake_port"],
        "phase2": d["rdma_phase2_handshake_port"],
    }
    ctl = Controller(proc, path, cfg, ports, log_path)
    try:
        # Its ports are bound at start, before it serves them: ready is what it logs once
        # every part (rings, task store, Mooncake, control channel, front door) is up.
        wait_log(ctl, "controller ready")
        for port in ports.values():
            wait_port(port, proc)
        wait_port(d["control_port"], proc)
    except Exception:
        stop_process(proc)
        raise RuntimeError(f"controller did not start:\n{log_path.read_text()}") from None
    return ctl


def run_controller_to_exit(
    tmp: Path, cfg: dict[str, Any], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run a controller that is expected to refuse to start; its exit status and output."""
    path = tmp / f"refused-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(cfg))
    return subprocess.run(
        [sys.executable, "run_service.py", "--service", "controller", "--config", str(path)],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        timeout=timeout,
    )


def ring_of(ctl: Controller, name: str) -> Ring:
    """A peer's handle on the controller's ring ``name`` (over tcp, with the token)."""
    d = ctl.config["disagg_config"]
    layout = RingLayout(name, d["rdma_buffer_slots"], d["rdma_buffer_slot_size"])
    return Ring(connect("tcp", "127.0.0.1", ctl.ports[name], layout=layout, ring=name, token=TOKEN))
