"""Helper of the start scripts in this folder (``common.sh``); not meant to be run by hand.

    group_tool.py prepare --group wan_t2v --config-dir configs/disagg/wan --log-dir DIR
                          [--port-offset N] [--output-dir DIR]
    group_tool.py wait --url URL --pid ROLE=PID ... [--metrics ROLE=URL ...] [--timeout S]

``prepare`` loads the four role files of a group with ``ServiceConfig.load`` (so a bad file
fails before anything starts), checks that they describe one group, applies the launcher's
overrides (``PORT_OFFSET``, ``OUTPUT_DIR``) into copies under ``LOG_DIR/config/``, checks that
every port is free, and prints shell assignments for ``eval``.

``wait`` polls until the group is ready: the controller answers ``/health``, every worker role
is listed in ``/v1/service/status``, every metrics port answers ``/metrics``. Exit status:
0 ready, 3 a watched process is gone, 4 timed out (what is missing is printed).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shlex
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contracts.config import DisaggConfig, ServiceConfig
from contracts.errors import ConfigError

ROLES = ("controller", "encoder", "transformer", "decoder")
WORKER_ROLES = ROLES[1:]
DISAGG_PORT_KEYS = (
    "control_port",
    "rdma_request_handshake_port",
    "rdma_phase1_handshake_port",
    "rdma_phase2_handshake_port",
)
# disagg_mode values a role file may carry (LightX2V calls the decoder "decode").
MODES = {
    "controller": ("controller",),
    "encoder": ("encoder", "encode"),
    "transformer": ("transformer",),
    "decoder": ("decoder", "decode"),
}
EXIT_GONE = 3
EXIT_TIMEOUT = 4


class GroupError(Exception):
    """A problem with the group's files or ports, worded for the operator."""


def _say(msg: str) -> None:
    try:
        print(msg, file=sys.stderr, flush=True)
    except OSError:  # nobody reads our output any more; the launcher goes on regardless
        pass


# ------------------------------------------------------------------------------- prepare
def role_files(group: str, config_dir: Path) -> dict[str, Path]:
    files = {role: config_dir / f"{group}_{role}.json" for role in ROLES}
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise GroupError(f"missing config file(s): {', '.join(missing)}")
    return files


def shift_ports(data: dict[str, Any], offset: int, is_controller: bool) -> None:
    """Add ``offset`` to every port of one role file, in place (defaults made explicit)."""
    disagg = data.setdefault("disagg_config", {})
    defaults = DisaggConfig()
    for key in DISAGG_PORT_KEYS:
        disagg[key] = int(disagg.get(key, getattr(defaults, key))) + offset
    server = data.setdefault("server", {})
    if is_controller:
        server["port"] = int(server.get("port", 8000)) + offset
    elif "port" in server:
        server["port"] = int(server["port"]) + offset
    if server.get("metric_port") is not None:
        server["metric_port"] = int(server["metric_port"]) + offset


def _probe_host(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host


def port_busy(host: str, port: int) -> bool:
    """True when something already listens on host:port (an address we cannot bind is
    someone else's machine: not ours to check)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # Servers set SO_REUSEADDR too, so a port in TIME_WAIT is not reported as busy.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


@dataclass(frozen=True)
class Prepared:
    configs: dict[str, Path]
    loaded: dict[str, ServiceConfig]

    def ports(self) -> list[tuple[str, str, int]]:
        """(what, host, port) of every port the group binds."""
        ctl = self.loaded["controller"]
        d = ctl.disagg_config
        out = [
            ("front door", ctl.server.host, ctl.server.port),
            ("control channel", d.bootstrap_addr, d.control_port),
        ]
        for ring in ("request", "phase1", "phase2"):
            host, port = d.ring_address(ring)
            out.append((f"{ring} ring handshake", host, port))
        for role in ROLES:
            srv = self.loaded[role].server
            if srv.metric_port is not None:
                out.append((f"{role} metrics", srv.host, srv.metric_port))
        return out


def prepare(
    group: str,
    config_dir: Path,
    log_dir: Path,
    port_offset: int = 0,
    output_dir: str | None = None,
) -> Prepared:
    files = role_files(group, config_dir)
    raw: dict[str, dict[str, Any]] = {}
    for role, path in files.items():
        try:
            ServiceConfig.load(str(path))  # the file as written must be valid on its own
            raw[role] = json.loads(path.read_text())
        except ConfigError as exc:
            raise GroupError(f"{path}: {exc}") from None
    changed = bool(port_offset) or output_dir is not None
    configs = dict(files)
    if changed:
        out_dir = log_dir / "config"
        out_dir.mkdir(parents=True, exist_ok=True)
        for role, data in raw.items():
            if port_offset:
                shift_ports(data, port_offset, role == "controller")
            if output_dir is not None and role in ("controller", "decoder"):
                data["output_dir"] = output_dir
            configs[role] = out_dir / f"{group}_{role}.json"
            configs[role].write_text(json.dumps(data, indent=2) + "\n")
    loaded: dict[str, ServiceConfig] = {}
    for role, path in configs.items():
        try:
            loaded[role] = ServiceConfig.load(str(path))
        except ConfigError as exc:
            hint = " (PORT_OFFSET too large?)" if port_offset else ""
            raise GroupError(f"{path}: {exc}{hint}") from None
    check_group(group, files, loaded)
    return Prepared(configs, loaded)


def check_group(group: str, files: dict[str, Path], loaded: dict[str, ServiceConfig]) -> None:
    """The four files must describe one group: same pipeline, same rings, no port clash."""
    ctl = loaded["controller"]
    for role, cfg in loaded.items():
        where = files[role]
        if cfg.disagg_mode is not None and cfg.disagg_mode not in MODES[role]:
            raise GroupError(
                f"{where}: disagg_mode is {cfg.disagg_mode!r}, but the file is the {role}'s"
            )
        if cfg.pipeline != group:
            raise GroupError(f"{where}: model_cls/task make {cfg.pipeline}, not {group}")
        if cfg.disagg_config != ctl.disagg_config:
            raise GroupError(
                f"{where}: disagg_config differs from {files['controller']}; every service "
                "of a group must agree on the control and ring ports, hosts and layout"
            )
    # The controller stores what the decoder sends it over the control channel, so their
    # output_dir may differ (they do when they run on different hosts). Two services may
    # share a port number only on different addresses (each binds its own).
    seen: dict[tuple[str, int], str] = {}
    for what, host, port in Prepared({}, loaded).ports():
        clash = [k for k in seen if k[1] == port and _overlap(k[0], host)]
        if clash:
            raise GroupError(f"port {port} is used twice: {seen[clash[0]]} and {what}")
        seen[(host, port)] = what


def _overlap(a: str, b: str) -> bool:
    """Whether binds on addresses ``a`` and ``b`` (same port) would collide."""
    return a == b or a in ("", "0.0.0.0", "::") or b in ("", "0.0.0.0", "::")


def shell_assignments(prep: Prepared) -> str:
    ctl = prep.loaded["controller"]
    host = _probe_host(ctl.server.host)
    lines = {
        "GROUP_FRONT_URL": f"http://{host}:{ctl.server.port}",
        "GROUP_OUTPUT_DIR": str(Path(ctl.output_dir).resolve()),
    }
    for role in ROLES:
        srv = prep.loaded[role].server
        lines[f"GROUP_CONFIG_{role}"] = str(prep.configs[role])
        lines[f"GROUP_METRICS_{role}"] = (
            f"http://{_probe_host(srv.host)}:{srv.metric_port}/metrics"
            if srv.metric_port is not None
            else ""
        )
    return "".join(f"{k}={shlex.quote(v)}\n" for k, v in lines.items())


def cmd_prepare(args: argparse.Namespace) -> int:
    try:
        prep = prepare(
            args.group,
            Path(args.config_dir),
            Path(args.log_dir),
            args.port_offset,
            args.output_dir or None,
        )
    except GroupError as exc:
        _say(f"error: {exc}")
        return 2
    busy = [(w, h, p) for w, h, p in prep.ports() if port_busy(h, p)]
    if busy:
        for what, host, port in busy:
            _say(f"error: port {port} ({what}, {host}) is in use")
        _say(
            "another group (or a previous run's services) holds these ports; stop it, or "
            "shift every port of this group with PORT_OFFSET=N"
        )
        return 2
    sys.stdout.write(shell_assignments(prep))
    return 0


# ---------------------------------------------------------------------------------- wait
def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a child its parent has not reaped yet is dead too
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def _pairs(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--{what} takes ROLE=VALUE, got {item!r}")
        out[key] = value
    return out


def cmd_wait(args: argparse.Namespace) -> int:
    import httpx

    pids = {role: int(pid) for role, pid in _pairs(args.pid, "pid").items()}
    metrics = {role: url for role, url in _pairs(args.metrics, "metrics").items() if url}
    url = args.url.rstrip("/")
    roles = [r for r in args.roles.split(",") if r]
    done: set[str] = set()
    start = time.monotonic()
    deadline = start + args.timeout
    metrics_deadline: float | None = None
    # The readiness check reads /v1/service/status, which is behind the API key if any.
    key = os.environ.get("DIFFRING_API_KEY")
    client = httpx.Client(timeout=2.0, trust_env=False,
                          headers={"Authorization": f"Bearer {key}"} if key else {})

    def mark(key: str, msg: str) -> None:
        if key not in done:
            done.add(key)
            _say(f"  ready ({time.monotonic() - start:5.1f} s): {msg}")

    def ok(u: str) -> bool:
        try:
            return client.get(u).status_code == 200
        except httpx.HTTPError:
            return False

    while True:
        gone = [role for role, pid in pids.items() if not alive(pid)]
        if gone:
            _say(f"error: {', '.join(gone)} exited during start-up")
            return EXIT_GONE
        if "health" not in done and ok(f"{url}/health"):
            mark("health", f"controller {url}/health")
        if "health" in done:
            try:
                workers = client.get(f"{url}/v1/service/status").json().get("workers", {})
            except (httpx.HTTPError, ValueError):
                workers = {}
            for role in roles:
                if workers.get(role):
                    mark(role, f"{role} registered with the controller")
        for role, murl in metrics.items():
            if f"metrics:{role}" not in done and ok(murl):
                mark(f"metrics:{role}", f"{role} metrics {murl}")
        missing_services = [k for k in ["health", *roles] if k not in done]
        missing_metrics = [r for r in metrics if f"metrics:{r}" not in done]
        if not missing_services and not missing_metrics:
            return 0
        now = time.monotonic()
        if not missing_services:
            # The services are up; metrics get a grace period of their own.
            if metrics_deadline is None:
                metrics_deadline = now + args.metrics_timeout
            if now >= metrics_deadline:
                urls = ", ".join(metrics[r] for r in missing_metrics)
                if args.metrics_required:
                    _say(f"error: metrics endpoint(s) not answering: {urls}")
                    return EXIT_TIMEOUT
                _say(f"warning: metrics endpoint(s) not answering (yet): {urls}")
                return 0
        if now >= deadline:
            what = [
                ("controller /health" if k == "health" else f"{k} registration")
                for k in missing_services
            ]
            what += [f"{r} metrics" for r in missing_metrics]
            _say(f"error: not ready after {args.timeout:g} s: still waiting for {', '.join(what)}")
            return EXIT_TIMEOUT
        time.sleep(args.interval)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--group", required=True)
    p.add_argument("--config-dir", required=True)
    p.add_argument("--log-dir", required=True)
    p.add_argument("--port-offset", type=int, default=0)
    p.add_argument("--output-dir", default="")
    w = sub.add_parser("wait")
    w.add_argument("--url", required=True)
    w.add_argument("--roles", default=",".join(WORKER_ROLES))
    w.add_argument("--pid", action="append", default=[], help="ROLE=PID to watch")
    w.add_argument("--metrics", action="append", default=[], help="ROLE=URL of /metrics")
    w.add_argument("--timeout", type=float, default=600.0)
    w.add_argument("--metrics-timeout", type=float, default=15.0)
    w.add_argument("--metrics-required", action="store_true")
    w.add_argument("--interval", type=float, default=0.25)
    args = ap.parse_args(argv)
    return cmd_prepare(args) if args.cmd == "prepare" else cmd_wait(args)


if __name__ == "__main__":
    sys.exit(main())
