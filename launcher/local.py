"""Start a whole group on this machine — a controller and its workers as subprocesses.

The one launcher of the repository: the tests, the demo, the benchmarks and the start scripts
(through :mod:`launcher.launch`, ``python -m launcher``) all start their services with
:class:`LocalGroup`. Every process is started here and stopped here, by its pid: workers
first (they drain), then the controller.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from contracts.pipelines import TASK_SPECS
from contracts.roles import Role
from launcher.ports import free_ports

ROOT = Path(__file__).resolve().parent.parent


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
    name: str | None = None
    """The key it was started under (:meth:`LocalGroup.start`'s ``name``), if not its role."""

    @property
    def label(self) -> str:
        """What messages call it: its name (``transformer high``), else its role."""
        return (self.name or self.role).replace("_", " ")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def status(self) -> int | None:
        """None while running; else the exit status as a shell reports it (128 + N when
        killed by signal N)."""
        rc = self.proc.poll()
        return None if rc is None else (128 - rc if rc < 0 else rc)


class ServiceExited(RuntimeError):
    """A service of the group exited; the message carries its log tail."""

    def __init__(self, service: Service) -> None:
        self.service = service
        super().__init__(
            f"{service.role} exited with {service.proc.returncode}:\n{service.log()[-3000:]}")


@dataclass
class LocalGroup:
    """A controller and workers: each started from :attr:`config` (with its own settings
    merged in), or from a role file of its own (:attr:`files`)."""

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
    files: Mapping[str, Path] = field(default_factory=dict)
    """Role (or a service's ``name``, :meth:`start`) -> a config file its services start
    from as it is (the start scripts' role files); the others get one written from
    :attr:`config`."""
    args: Mapping[str, Sequence[str]] = field(default_factory=dict)
    """Role (or ``name``) -> more ``run_service.py`` arguments (e.g. ``--model_path``,
    ``--device``)."""
    log_dir: Path | None = None
    """Logs as ``<log_dir>/<role or name>.log`` (an earlier one kept as ``.log.prev``); default
    ``<workdir>/<role>-<n>.log``, beside the config written for it."""
    detached: bool = False
    """Each service in a session of its own, so a Ctrl+C in the terminal reaches only the
    launcher (which stops the group in order), and SIGTERMed should the launcher die
    (``setpriv --pdeathsig``, where util-linux has it). For a launcher started from a
    terminal: the parent-death signal follows the thread that started the service."""

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

    def _config_path(self, role: str, n: int, extra: Mapping[str, Any] | None) -> Path:
        if role in self.files and not extra:
            return self.files[role]
        cfg = merged(self.config, self.own_settings(role))
        if extra:
            cfg = merged(cfg, extra)
        path = self.workdir / f"{role}-{n}.json"
        path.write_text(json.dumps(cfg, indent=2))
        return path

    def _log_path(self, role: str, n: int) -> Path:
        if self.log_dir is None:
            return self.workdir / f"{role}-{n}.log"
        path = self.log_dir / f"{role}.log"
        if path.exists():
            path.replace(path.with_name(path.name + ".prev"))
        return path

    def start(self, role: str, extra: Mapping[str, Any] | None = None,
              name: str | None = None) -> Service:
        """Start a ``role`` service; ``name`` (e.g. ``transformer_high``, a split group's
        high-noise DiT worker): its key in :attr:`files` and :attr:`args` and its log's name,
        where two services of one role start from files of their own."""
        n = self.started
        self.started += 1
        key = name or role
        if key in self.files and not extra:
            path = self.files[key]
        else:
            path = self._config_path(role, n, extra)
        log_path = self._log_path(key, n)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        cmd = [sys.executable, str(ROOT / "run_service.py"), "--service", role,
               "--config", str(path), *self.args.get(key, ())]
        if self.detached and _pdeathsig_works():
            cmd = ["setpriv", "--pdeathsig", "TERM", "--", *cmd]  # setpriv execs: same pid
        with log_path.open("wb") as out:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                cwd=str(ROOT), env=env, start_new_session=self.detached,
            )
        svc = Service(role, proc, log_path, name)
        self.services.append(svc)
        return svc

    def check_alive(self) -> None:
        """Raise :class:`ServiceExited`, with its log tail, if any service has exited."""
        for svc in self.services:
            if svc.proc.poll() is not None:
                raise ServiceExited(svc)

    def healthy(self) -> bool:
        """Whether the front door answers ``/health`` now."""
        try:
            return httpx.get(f"{self.url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def registered(self) -> dict[str, int] | None:
        """Workers registered with the controller, by role (None: it did not answer)."""
        try:
            status = httpx.get(f"{self.url}/v1/service/status", timeout=5,
                               headers=self.headers).json()
        except (httpx.HTTPError, ValueError):
            return None  # e.g. a busy controller, many workers joining at once: ask again
        return {r: len(ws) for r, ws in status.get("workers", {}).items()}

    def wait_http(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            if self.healthy():
                return
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
            have = self.registered()
            if have is not None and all(have.get(r, 0) >= n for r, n in counts.items()):
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

    def stop(self, timeout: float = 30, say: Callable[[str], None] | None = None) -> None:
        """SIGTERM the workers (they drain: each finishes its claimed task, which needs the
        controller), wait for them, then the controller; SIGKILL what is still running
        after ``timeout`` seconds of its phase. ``say`` hears what is done."""
        workers = [s for s in self.services if s.role != "controller"]
        controllers = [s for s in self.services if s.role == "controller"]
        for what, phase in (("workers", workers), ("controller", controllers)):
            running = [s for s in phase if s.proc.poll() is None]
            if not running:
                continue
            pids = " ".join(str(s.proc.pid) for s in running)
            if say is not None:
                say(f"stopping workers (SIGTERM, they finish their claimed task): {pids}"
                    if what == "workers" else f"stopping controller: {pids}")
            _terminate(running, timeout, what, say)
        if say is not None:
            say("group stopped")

    def kill(self) -> None:
        """SIGKILL every service still running, now."""
        for svc in self.services:
            if svc.proc.poll() is None:
                svc.proc.kill()

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


def _terminate(services: list[Service], timeout: float, what: str,
               say: Callable[[str], None] | None) -> None:
    for svc in services:
        svc.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    left = []
    for svc in services:
        try:
            svc.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            left.append(svc)
    if left and say is not None:
        say(f"{what} still running after {timeout:g} s: SIGKILL "
            + " ".join(str(s.proc.pid) for s in left))
    for svc in left:
        svc.proc.kill()
        svc.proc.wait()


_PDEATHSIG: list[bool] = []


def _pdeathsig_works() -> bool:
    """Whether ``setpriv --pdeathsig`` runs here (util-linux; asked once)."""
    if not _PDEATHSIG:
        try:
            ok = subprocess.run(["setpriv", "--pdeathsig", "TERM", "true"],
                                capture_output=True).returncode == 0
        except OSError:
            ok = False
        _PDEATHSIG.append(ok)
    return _PDEATHSIG[0]
