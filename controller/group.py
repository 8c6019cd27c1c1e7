"""Start a whole group on this machine — a controller and its workers as subprocesses.

Used by the demo, the tests and ``python -m controller.group`` (which the start scripts
wrap). Every process is started here and stopped here, by its pid.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from contracts.pipelines import TASK_SPECS
from contracts.roles import Role

ROOT = Path(__file__).resolve().parent.parent


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def group_config(
    pipeline: str,
    model_path: str,
    workdir: Path,
    *,
    ports: Mapping[str, int] | None = None,
    token: str = "diffring-local-group",
    host: str = "127.0.0.1",
    **overrides: Any,
) -> dict[str, Any]:
    """The config every role of a group starts from (each service reads what it needs);
    ``host`` is the controller's address. Per-service differences (a worker's own address,
    its metrics port, the decoder's folder) are :meth:`LocalGroup.start`'s ``extra`` or
    :attr:`LocalGroup.hosts`."""
    spec = TASK_SPECS[pipeline]
    p = dict(ports or {})
    if not p:
        ctl, req, ph1, ph2, http = free_ports(5, host)
        p = {"control": ctl, "request": req, "phase1": ph1, "phase2": ph2, "http": http}
    disagg = {
        "bootstrap_addr": host,
        "control_port": p["control"],
        "rdma_request_handshake_port": p["request"],
        "rdma_phase1_handshake_port": p["phase1"],
        "rdma_phase2_handshake_port": p["phase2"],
        "cluster_token": token,
        "ring_transport": "tcp",
    }
    disagg.update(overrides.pop("disagg_config", {}))
    cfg: dict[str, Any] = {
        "model_cls": spec.model_cls,
        "task": spec.task,
        "model_path": str(model_path),
        "output_dir": str(workdir / "results"),
        # Several CPU workers share the cores of one machine here: one thread each.
        "torch_threads": 1,
        "disagg_config": disagg,
        "server": {"host": host, "port": p["http"]},
    }
    cfg.update(overrides)
    return cfg


def merged(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` merged in, nested objects key by key."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


MULTI_HOST: dict[str, tuple[str, ...]] = {
    "controller": ("127.0.0.10",),
    "encoder": ("127.0.0.11",),
    "transformer": ("127.0.0.12", "127.0.0.13"),
    "decoder": ("127.0.0.14",),
}
"""One loopback address per service (the whole of 127.0.0.0/8 is loopback on Linux): a group
laid out as if each service ran on a host of its own."""


@dataclass
class Service:
    role: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@dataclass
class LocalGroup:
    """A controller and workers started from one config file."""

    config: dict[str, Any]
    workdir: Path
    services: list[Service] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    started: int = 0
    """Services started so far: numbers their config and log files (services that were
    stopped and dropped from ``services`` keep theirs)."""
    hosts: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Role -> addresses, one per instance in start order (e.g. :data:`MULTI_HOST`). A
    worker given an address binds its metrics endpoint there, advertises its Mooncake
    segment there, and keeps its results in a folder of its own (``<workdir>/<address>/``),
    as on a host of its own; it gets a metrics port too."""

    @property
    def url(self) -> str:
        return f"http://{self.config['server']['host']}:{self.config['server']['port']}"

    def own_settings(self, role: str) -> dict[str, Any]:
        """What the next ``role`` service gets of its own from :attr:`hosts` (else nothing)."""
        addrs = self.hosts.get(role)
        if not addrs:
            return {}
        n = sum(1 for s in self.services if s.role == role)
        host = addrs[n % len(addrs)]
        if role == "controller":
            return {"server": {"host": host}}  # its rings and control: group_config(host=)
        return {
            "server": {"host": host, "metric_port": free_ports(1, host)[0]},
            "output_dir": str(self.workdir / host / f"{role}-{n}-results"),
        }

    def _config_path(self, role: str, extra: Mapping[str, Any] | None) -> Path:
        cfg = merged(self.config, self.own_settings(role))
        if extra:
            cfg = merged(cfg, extra)
        path = self.workdir / f"{role}-{self.started}.json"
        self.started += 1
        path.write_text(json.dumps(cfg, indent=2))
        return path

    def start(self, role: str, extra: Mapping[str, Any] | None = None) -> Service:
        path = self._config_path(role, extra)
        log_path = path.with_suffix(".log")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        with log_path.open("wb") as out:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    str(ROOT / "run_service.py"),
                    "--service",
                    role,
                    "--config",
                    str(path),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=str(ROOT),
                env=env,
            )
        svc = Service(role, proc, log_path)
        self.services.append(svc)
        return svc

    def check_alive(self) -> None:
        """Raise, with its log tail, if any service of the group has exited."""
        for svc in self.services:
            if svc.proc.poll() is not None:
                raise RuntimeError(
                    f"{svc.role} exited with {svc.proc.returncode}:\n{svc.log()[-3000:]}"
                )

    def wait_http(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"front door {self.url} did not answer within {timeout} s")

    @property
    def headers(self) -> dict[str, str]:
        """What a client of this group's front door sends (its API key, if it has one)."""
        key = self.env.get("DIFFRING_API_KEY") or self.config["server"].get("api_key")
        return {"Authorization": f"Bearer {key}"} if key else {}

    def wait_workers(self, counts: Mapping[str, int], timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                status = httpx.get(f"{self.url}/v1/service/status", timeout=5,
                                   headers=self.headers).json()
            except httpx.TimeoutException:
                continue  # a busy controller (many workers joining at once): ask again
            have = {r: len(ws) for r, ws in status["workers"].items()}
            if all(have.get(r, 0) >= n for r, n in counts.items()):
                return
            time.sleep(0.2)
        raise TimeoutError(f"workers {dict(counts)} did not all register within {timeout} s")

    def start_all(self, encoders: int = 1, transformers: int = 1, decoders: int = 1) -> None:
        self.start("controller")
        self.wait_http()
        counts = {Role.ENCODER: encoders, Role.TRANSFORMER: transformers, Role.DECODER: decoders}
        for role, n in counts.items():
            for _ in range(n):
                self.start(role)
        self.wait_workers({role.value: n for role, n in counts.items()})

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM workers first (they drain), then the controller; kill what lingers."""
        order = sorted(self.services, key=lambda s: s.role == "controller")
        for svc in order:
            if svc.proc.poll() is None:
                svc.proc.send_signal(signal.SIGTERM)
            if svc.role == "controller":
                continue
        deadline = time.monotonic() + timeout
        for svc in order:
            try:
                svc.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                svc.proc.kill()
                svc.proc.wait()

    def __enter__(self) -> LocalGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def submit(url: str, kind: str, body: Mapping[str, Any], timeout: float = 600) -> dict[str, Any]:
    """POST a task and wait for it; returns the final status (raises on HTTP errors)."""
    r = httpx.post(f"{url}/v1/tasks/{kind}/", json=dict(body), timeout=30)
    r.raise_for_status()
    task_id = r.json()["task_id"]
    return wait_task(url, task_id, timeout)


def wait_task(url: str, task_id: str, timeout: float = 600) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        st: dict[str, Any] = httpx.get(f"{url}/v1/tasks/{task_id}/status", timeout=30).json()
        if st["status"] in ("completed", "failed", "cancelled"):
            return st
        if time.monotonic() > deadline:
            raise TimeoutError(f"task {task_id} still {st['stage']} after {timeout} s")
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="run a local group until Ctrl+C")
    ap.add_argument("--pipeline", choices=sorted(TASK_SPECS), required=True)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--workdir", default="out/group")
    ap.add_argument("--encoders", type=int, default=1)
    ap.add_argument("--transformers", type=int, default=1)
    ap.add_argument("--decoders", type=int, default=1)
    args = ap.parse_args(argv)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    group = LocalGroup(group_config(args.pipeline, args.model_path, workdir), workdir)
    stop = False

    def on_signal(_s: int, _f: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        group.start_all(args.encoders, args.transformers, args.decoders)
        print(f"group ready: {group.url}  (docs: {group.url}/docs)", flush=True)
        while not stop:
            time.sleep(0.2)
    finally:
        group.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
