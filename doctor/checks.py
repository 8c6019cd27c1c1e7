"""The checks of ``run_service.py --check``, one function per concern.

Each check records ``ok``, ``warn`` or ``fail`` with a line a person can act on. Sockets are
opened only to test (a bind that is closed at once, a connect with a short timeout); nothing
is kept, and nothing but the controller's own ports is connected to.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from contracts.addresses import (
    advertised_problem,
    default_advertised_host,
    is_loopback,
    is_wildcard,
    resolve,
)
from contracts.config import DEFAULT_TOKEN, RING_NAMES, ServiceConfig
from contracts.errors import ConfigError, DiffringError
from contracts.messages import Describe, DescribeReply
from contracts.pipelines import task_spec
from contracts.roles import Role
from rings.ports import port_holder
from tensorplane.engine import INFINIBAND_SYSFS, MooncakeSettings, check_installed
from workers.control import ControlClient

Status = Literal["ok", "warn", "fail"]
CONNECT_TIMEOUT_S = 2.0
MIN_TOKEN_CHARS = 16


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str


@dataclass
class _Report:
    checks: list[Check] = field(default_factory=list)
    exposed: list[str] = field(default_factory=list)
    """Addresses the service binds or uses that are not loopback (the token check's input)."""

    def add(self, name: str, status: Status, detail: str) -> None:
        self.checks.append(Check(name, status, detail))


def run_checks(
    service: str,
    cfg: ServiceConfig,
    token: str,
    env: Mapping[str, str],
    *,
    infiniband_dir: str = INFINIBAND_SYSFS,
) -> list[Check]:
    """Every check for ``service`` (controller, a worker role, or all) with config ``cfg``."""
    r = _Report()
    d = cfg.disagg_config
    r.add("config", "ok", f"{service}: pipeline {cfg.pipeline}, ring transport "
          f"{d.ring_transport}, Mooncake config {cfg.mooncake_config_path or 'none'}")
    for note in cfg.lightx2v:  # a LightX2V stage config: what each of its keys became
        r.add("lightx2v", "ok", note.line())
    workers = _roles(service)
    for what, host, port in _binds(service, cfg):
        _check_bind(r, what, host, port)
    if workers and service != "all":
        if cfg.server.metric_port is None:
            r.add("probes", "warn", "no server.metric_port: no /metrics, /ready or /live for "
                  "Prometheus or an orchestrator's probes")
        answers = [_check_connect(r, what, host, port) for what, host, port in _connects(cfg)]
        if answers[0]:  # the control channel
            _controller_pipeline(r, service, cfg, token)
    devices = _rdma(r, cfg, infiniband_dir)
    if (workers and service != "all") or (service == "controller" and task_spec(
        cfg.pipeline
    ).takes_image):
        _mooncake(r, service, cfg, env, infiniband_dir, devices)
    _token(r, cfg, token, env)
    found = _checkpoint(r, cfg, workers) if workers else None
    for role in workers:
        _model(r, role, cfg, found)
    if workers:
        _device(r, cfg.device)
    return r.checks


def _roles(service: str) -> list[str]:
    if service == "all":
        return [role.value for role in Role]
    return [service] if service in {role.value for role in Role} else []


# -- addresses and ports -----------------------------------------------------------------------
def _binds(service: str, cfg: ServiceConfig) -> Iterator[tuple[str, str, int]]:
    srv, d = cfg.server, cfg.disagg_config
    if service in ("controller", "all"):
        yield "front door", srv.host, srv.port
    if service == "controller":
        yield "control channel", d.bootstrap_addr, d.control_port
        for ring in RING_NAMES:
            host, port = d.ring_address(ring)
            yield f"{ring} ring", host, port
    if srv.metric_port is not None:
        yield "metrics and probes", srv.host, srv.metric_port


def _connects(cfg: ServiceConfig) -> Iterator[tuple[str, str, int]]:
    d = cfg.disagg_config
    yield "control channel", d.bootstrap_addr, d.control_port
    for ring in RING_NAMES:
        host, port = d.ring_address(ring)
        yield f"{ring} ring", host, port


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _try_bind(host: str, port: int) -> OSError | None:
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the services do
        try:
            s.bind((host.strip("[]"), port))
        except OSError as exc:
            return exc
    return None


def _check_bind(r: _Report, what: str, host: str, port: int) -> None:
    name = f"bind {what}"
    if not is_loopback(host):
        r.exposed.append(host or "0.0.0.0")
    if not is_wildcard(host):
        try:
            resolve(host)
        except ConfigError as exc:
            r.add(name, "fail", str(exc))
            return
    err = _try_bind(host, port)
    if err is None:
        where = "every interface" if is_wildcard(host) else "this host"
        r.add(name, "ok", f"{host}:{port} can be bound ({where})")
    elif err.errno == errno.EADDRINUSE:
        holder = port_holder(port)
        r.add(name, "fail", f"port {port} on {host} is in use"
              + (f" by {holder}" if holder else "") + ": stop that process or pick another port")
    elif err.errno == errno.EADDRNOTAVAIL:
        r.add(name, "fail", f"{host} is not an address of this host: bind to one of its own "
              "addresses (or 0.0.0.0 for every interface)")
    else:
        r.add(name, "fail", f"cannot bind {host}:{port}: {err.strerror or err}")


def _check_connect(r: _Report, what: str, host: str, port: int) -> bool:
    """Whether ``host:port`` answers (a check recorded either way)."""
    name = f"reach {what}"
    if is_wildcard(host):
        r.add(name, "fail", f"{host!r} is not an address to connect to: set bootstrap_addr (or "
              "the ring host) to the controller's address")
        return False
    if not is_loopback(host):
        r.exposed.append(host)
    try:
        addrs = resolve(host)
    except ConfigError as exc:
        r.add(name, "fail", str(exc))
        return False
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as exc:
        r.add(name, "warn", f"{host}:{port} ({', '.join(addrs)}) does not answer now "
              f"({exc.strerror or exc}); fine if the controller is not started yet")
        return False
    r.add(name, "ok", f"{host}:{port} answers")
    return True


def _controller_pipeline(r: _Report, role: str, cfg: ServiceConfig, token: str) -> None:
    """Ask the running controller what it serves: a worker of another pipeline would be
    refused at registration (after loading its model, minutes for a real checkpoint)."""
    d = cfg.disagg_config
    client = ControlClient(d.bootstrap_addr, d.control_port, token, timeout=CONNECT_TIMEOUT_S)
    try:
        client.connect(role)
        served = client.call(Describe(), DescribeReply).pipeline
    except (DiffringError, OSError) as exc:
        r.add("controller's pipeline", "warn", f"could not ask the controller at "
              f"{client.where}: {exc}")
        return
    finally:
        client.close()
    if served != cfg.pipeline:
        r.add("controller's pipeline", "fail", f"the controller at {client.where} serves "
              f"{served}; this {role} is configured for {cfg.pipeline} (model_cls/task): "
              "it would be refused when it registers. Point it at a controller of "
              f"{cfg.pipeline}, or configure it for {served}")
        return
    r.add("controller's pipeline", "ok", f"{served}, as this {role}")


# -- token -------------------------------------------------------------------------------------
def _token(r: _Report, cfg: ServiceConfig, token: str, env: Mapping[str, str]) -> None:
    source = ("DIFFRING_CLUSTER_TOKEN" if env.get("DIFFRING_CLUSTER_TOKEN")
              else "disagg_config.cluster_token" if cfg.disagg_config.cluster_token
              else "the development default")
    if token == DEFAULT_TOKEN:
        if r.exposed:
            r.add("token", "fail", f"the development token on a non-loopback address "
                  f"({', '.join(sorted(set(r.exposed)))}): anyone who reaches it can join the "
                  "group; set DIFFRING_CLUSTER_TOKEN (the same secret on every service)")
        else:
            r.add("token", "warn", "the development default (fine on loopback only); set "
                  "DIFFRING_CLUSTER_TOKEN before a group spans hosts")
        return
    if len(token) < MIN_TOKEN_CHARS:
        r.add("token", "warn", f"set from {source}, but only {len(token)} characters; use "
              f"{MIN_TOKEN_CHARS} or more random ones (e.g. `openssl rand -hex 32`)")
        return
    r.add("token", "ok", f"set from {source} ({len(token)} characters)")


# -- RDMA --------------------------------------------------------------------------------------
def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return "?"


def rdma_ports(infiniband_dir: str) -> dict[str, dict[int, dict[str, str]]]:
    """device -> port -> {state, phys_state, link_layer, rate} from the kernel's sysfs."""
    out: dict[str, dict[int, dict[str, str]]] = {}
    root = Path(infiniband_dir)
    if not root.is_dir():
        return out
    for dev in sorted(root.iterdir()):
        ports: dict[int, dict[str, str]] = {}
        for port in sorted((dev / "ports").glob("*")):
            if port.name.isdigit():
                ports[int(port.name)] = {k: _read(port / k) for k in
                                         ("state", "phys_state", "link_layer", "rate")}
        out[dev.name] = ports
    return out


def _active(port: Mapping[str, str]) -> bool:
    return "ACTIVE" in port.get("state", "")


def _rdma(r: _Report, cfg: ServiceConfig, infiniband_dir: str) -> dict[str, dict[int, dict]]:
    d = cfg.disagg_config
    devices = rdma_ports(infiniband_dir)
    if not devices:
        status: Status = "fail" if d.ring_transport == "rdma" else "ok"
        r.add("rdma devices", status, f"none under {infiniband_dir}: rings and Mooncake use tcp"
              + ("; ring_transport is 'rdma', set it to 'tcp' or 'auto'" if status == "fail"
                 else ""))
        return devices
    for dev, ports in devices.items():
        for n, p in ports.items():
            r.add(f"rdma {dev} port {n}", "ok" if _active(p) else "warn",
                  f"state {p['state']}, phys {p['phys_state']}, {p['link_layer']}, {p['rate']}")
    if d.rdma_device_name is not None:
        port = devices.get(d.rdma_device_name, {}).get(d.rdma_ib_port)
        if port is None:
            r.add("ring rdma device", "fail", f"rdma_device_name {d.rdma_device_name!r} port "
                  f"{d.rdma_ib_port} does not exist (found: {', '.join(devices)})")
        elif not _active(port):
            r.add("ring rdma device", "fail", f"{d.rdma_device_name} port {d.rdma_ib_port} is "
                  f"{port['state']}, not ACTIVE")
    if d.ring_transport != "tcp":
        from rings.rdma import rdma_available

        if not rdma_available():
            r.add("ring rdma", "fail" if d.ring_transport == "rdma" else "warn",
                  "devices exist but pyverbs cannot list them (apt-get install python3-pyverbs"
                  "; check permissions on /dev/infiniband): rings fall back to tcp")
    return devices


# -- Mooncake ----------------------------------------------------------------------------------
def _mooncake(
    r: _Report, service: str, cfg: ServiceConfig, env: Mapping[str, str],
    infiniband_dir: str, devices: Mapping[str, Mapping[int, Mapping[str, str]]],
) -> None:
    try:
        check_installed()
    except DiffringError as exc:
        r.add("mooncake", "fail", str(exc))
    controller = service == "controller"
    try:
        own = default_advertised_host(cfg, controller=controller)
        s = MooncakeSettings.resolve(cfg.mooncake_config_path, env,
                                     defaults={"local_hostname": own},
                                     service=cfg.mooncake,
                                     infiniband_dir=infiniband_dir)
    except DiffringError as exc:
        r.add("mooncake settings", "fail", str(exc))
        return
    r.add("mooncake protocol", "ok", f"{s.protocol} (metadata {s.metadata_server}"
          + (f", devices {s.device_name}" if s.device_name else "") + ")")
    if s.protocol == "rdma":
        active = [dev for dev, ports in devices.items() if any(map(_active, ports.values()))]
        wanted = [x for x in s.device_name.split(",") if x]
        missing = [x for x in wanted if x not in devices]
        if not active or missing:
            r.add("mooncake rdma", "fail", "protocol rdma but "
                  + (f"no device named {', '.join(missing)}" if missing
                     else "no RDMA device with an ACTIVE port")
                  + "; set MOONCAKE_PROTOCOL=tcp or fix the device")
    host = s.local_hostname.rsplit(":", 1)[0] if s.local_hostname.count(":") == 1 else (
        s.local_hostname.strip("[]"))
    if not is_loopback(host):
        r.exposed.append(host)
    problem = advertised_problem(host, cfg.disagg_config.bootstrap_addr)
    if problem is not None:
        r.add("mooncake advertises", "fail", problem)
        return
    try:
        resolve(host)
    except ConfigError as exc:
        r.add("mooncake advertises", "fail", str(exc))
        return
    err = _try_bind(host, 0)
    if err is not None and err.errno == errno.EADDRNOTAVAIL:
        r.add("mooncake advertises", "fail", f"{host} is not an address of this host: peers "
              "would look for this worker's tensors on another machine")
        return
    r.add("mooncake advertises", "ok", f"{host} (an address of this host; the controller "
          "connects back to it at start-up)")


# -- model folder and device -------------------------------------------------------------------
def _model(r: _Report, role: str, cfg: ServiceConfig, found: Any) -> None:
    from workers.models.components import ON_DEMAND, STAGE_COMPONENTS, component_problem

    name = f"model ({role})"
    if not cfg.model_path:
        r.add(name, "fail", "no model_path (config, --model_path or DIFFRING_MODEL_PATH)")
        return
    root = Path(cfg.model_path)
    if not root.is_dir():
        r.add(name, "fail", f"model folder {root} does not exist")
        return
    if found is None:
        return  # the folder's layout or checkpoint check failed and says why
    source = found.source or root  # a folder in another layout: its diffusers view
    needs = STAGE_COMPONENTS[cfg.pipeline][role]
    problems = {c: f"{c} ({kind}): {p}" for c, kind in needs.items()
                if (p := component_problem(source / c, kind)) is not None}
    required = [p for c, p in problems.items() if needs[c] != ON_DEMAND]
    if required:
        r.add(name, "fail", f"{root} is incomplete for the {role} of {cfg.pipeline}: "
              + "; ".join(required))
    elif problems:  # what only some requests load: those fail, the others are served
        r.add(name, "warn", f"{root}: " + "; ".join(problems.values()) + " (the requests "
              "that need it fail; the others are served)")
    else:
        r.add(name, "ok", f"{root}: {', '.join(f'{c} ({k})' for c, k in needs.items())}")


def _checkpoint(r: _Report, cfg: ServiceConfig, roles: list[str]) -> Any:
    """The folder's layout, and whether it is a checkpoint of the configured pipeline (its
    model index and DiT config: what a stage checks before it loads). What was found, or
    None when a check failed."""
    from workers.models.model_folder import check_model_folder

    if not cfg.model_path or not Path(cfg.model_path).is_dir():
        return None  # the model check says so
    dit = cfg.dit_original_ckpt if "transformer" in roles else None
    try:
        found = check_model_folder(Path(cfg.model_path), cfg.pipeline, dit, cfg.vae_path)
    except DiffringError as exc:
        r.add("checkpoint", "fail", str(exc))
        return None
    r.add("layout", "ok", f"{cfg.model_path}: {found.layout} layout"
          + ("" if found.source is None else
             f" (read through a diffusers-layout view, converted at load: {found.source})"))
    r.add("checkpoint", "ok", f"{cfg.model_path}: {found.describe()}, served as {cfg.pipeline}")
    return found


def _device(r: _Report, device: str) -> None:
    if device == "cpu":
        r.add("device", "ok", "cpu")
        return
    import torch

    index = int(device.split(":", 1)[1]) if ":" in device else 0
    if not torch.cuda.is_available():
        r.add("device", "fail", f"{device} asked for, but this torch sees no GPU "
              f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'})")
    elif index >= torch.cuda.device_count():
        r.add("device", "fail", f"{device} asked for, but only {torch.cuda.device_count()} "
              "GPU(s) are visible (CUDA_VISIBLE_DEVICES?)")
    else:
        r.add("device", "ok", f"{device}: {torch.cuda.get_device_name(index)}")
