"""The role files of a group: the four config files a start script runs
(``configs/disagg/<family>/<pipeline>_<role>.json``), loaded, checked and shifted.

:func:`prepare` loads each file with ``ServiceConfig.load`` (so a bad file fails before
anything starts), checks that the four describe one group (same pipeline, same rings, no port
used twice), and applies the launcher's overrides (a port offset, a results folder) into
copies under ``LOG_DIR/config/``; :meth:`Prepared.ports` lists every port the group binds,
for :func:`launcher.ports.port_busy`. Used by :mod:`launcher.launch`.

A ``split`` group (Wan2.2-A14B, one expert per DiT worker: ``transformer.experts`` ``high`` /
``low``) has two transformer files in place of ``<pipeline>_transformer.json``:
``<pipeline>_transformer_high.json`` and ``<pipeline>_transformer_low.json`` (keys
``transformer_high`` / ``transformer_low`` of :attr:`Prepared.configs`), each a worker of
its own with a metrics port of its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contracts.config import DisaggConfig, ServiceConfig
from contracts.errors import ConfigError
from contracts.lightx2v import LIGHTX2V_PORTS
from contracts.pipelines import TASK_SPECS
from contracts.roles import Role
from launcher.lightx2v_files import PREFIXES, ROOT, lightx2v_files, role_data

ROLES = ("controller", *(role.value for role in Role))
SPLIT_HALVES = ("transformer_high", "transformer_low")
"""The two transformer files of a split group, in start order."""
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


class GroupError(Exception):
    """A problem with the group's files or ports, worded for the operator."""


def role_of(key: str) -> str:
    """The role a key of :attr:`Prepared.configs` is a service of (``transformer_high``:
    ``transformer``)."""
    return "transformer" if key in SPLIT_HALVES else key


def role_keys(split: bool = False) -> tuple[str, ...]:
    """The keys of a group's role files: :data:`ROLES`, the transformer's in two when
    ``split``."""
    if not split:
        return ROLES
    return ("controller", "encoder", *SPLIT_HALVES, "decoder")


def role_files(group: str, config_dir: Path,
               split: bool = False) -> tuple[dict[str, Path], bool]:
    """The role files of ``group`` in ``config_dir`` and whether they are LightX2V's stage
    files (``<prefix>_disagg_{encoder,transformer,decode}.json``, no controller's);
    ``split``: the two transformer files of the split placement in place of the one."""
    files = {key: config_dir / f"{group}_{key}.json" for key in role_keys(split)}
    if split:
        missing = [str(p) for p in files.values() if not p.is_file()]
        if missing:
            raise GroupError(
                f"split group {group}: missing config file(s): {', '.join(missing)} (a split "
                "group runs one high-noise and one low-noise DiT worker, each from a file of "
                "its own)")
        return files, False
    missing = [str(p) for p in files.values() if not p.is_file()]
    if not missing:
        return files, False
    theirs = lightx2v_files(group, config_dir)
    if theirs is not None:
        return theirs, True
    prefix = PREFIXES.get(group)
    theirs_too = "" if prefix is None else \
        f" (or LightX2V's {prefix}_disagg_{{encoder,transformer,decode}}.json)"
    raise GroupError(f"missing config file(s): {', '.join(missing)}{theirs_too}")


def shift_ports(data: dict[str, Any], offset: int, is_controller: bool) -> None:
    """Add ``offset`` to every port of one role file, in place (defaults made explicit)."""
    disagg = data.setdefault("disagg_config", {})
    defaults = DisaggConfig()
    for key in DISAGG_PORT_KEYS:
        disagg[key] = int(disagg.get(key, getattr(defaults, key))) + offset
    server = data.setdefault("server", {})
    if is_controller:
        server["port"] = int(server.get("port", 8000)) + offset
        if server.get("lightx2v_ports"):
            server["lightx2v_ports"] = {r: int(p) + offset
                                        for r, p in server["lightx2v_ports"].items()}
    elif "port" in server:
        server["port"] = int(server["port"]) + offset
    if server.get("metric_port") is not None:
        server["metric_port"] = int(server["metric_port"]) + offset


def probe_host(host: str) -> str:
    """The address to reach a service bound to ``host`` at (a wildcard: loopback)."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host


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
        for role, port in (ctl.server.lightx2v_ports or {}).items():
            if port != ctl.server.port:
                out.append((f"LightX2V {role} port", ctl.server.host, port))
        for ring in ("request", "phase1", "phase2"):
            host, port = d.ring_address(ring)
            out.append((f"{ring} ring handshake", host, port))
        for key, cfg in self.loaded.items():
            srv = cfg.server
            if srv.metric_port is not None:
                out.append((f"{key.replace('_', ' ')} metrics", srv.host, srv.metric_port))
        return out


def prepare(
    group: str,
    config_dir: Path,
    log_dir: Path,
    port_offset: int = 0,
    output_dir: str | None = None,
    lightx2v_ports: bool = False,
    split: bool = False,
) -> Prepared:
    """The group's role files loaded, checked, and with the launcher's changes applied in
    copies under ``log_dir/config``: a port offset, a results folder, and
    ``lightx2v_ports``: the controller opens LightX2V's per-stage API ports of the group
    (its request scripts' table: contracts/lightx2v.py) and moves its front door to the
    encoder's. ``split``: the group of the split placement (:func:`role_files`)."""
    if split and TASK_SPECS[group].experts != 2:
        raise GroupError(f"split: {group} has one DiT; the split placement (one expert per "
                         "DiT worker) is Wan2.2-A14B's (wan22_a14b_t2v, wan22_a14b_i2v)")
    files, theirs = role_files(group, config_dir, split)
    raw: dict[str, dict[str, Any]] = {}
    if theirs:  # LightX2V's stage files: completed for diffring (launcher/lightx2v_files.py)
        raw = role_data(group, files)
        files = {"controller": ROOT / "configs" / "disagg" / TASK_SPECS[group].family /
                 f"{group}_controller.json", **files}
    for role, path in files.items():
        try:
            if theirs:
                ServiceConfig.from_dict(raw[role], role)
            else:
                ServiceConfig.load(str(path), role_of(role))  # valid on its own as written
                raw[role] = json.loads(path.read_text())
        except ConfigError as exc:
            raise GroupError(f"{path}: {exc}") from None
    if lightx2v_ports:
        server = raw["controller"].setdefault("server", {})
        server["lightx2v_ports"] = dict(LIGHTX2V_PORTS[group])
        server["port"] = LIGHTX2V_PORTS[group]["encoder"]
    changed = bool(port_offset) or output_dir is not None or theirs or lightx2v_ports
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
            loaded[role] = ServiceConfig.load(str(path), role_of(role))
        except ConfigError as exc:
            hint = " (PORT_OFFSET too large?)" if port_offset else ""
            raise GroupError(f"{path}: {exc}{hint}") from None
    check_experts(group, files, loaded, split)
    check_group(group, files, loaded)
    return Prepared(configs, loaded)


def check_experts(group: str, files: dict[str, Path], loaded: dict[str, ServiceConfig],
                  split: bool) -> None:
    """A split group's halves say ``experts`` ``high`` and ``low``; a group started with one
    transformer must not hold a single expert (its requests would wait at the boundary
    for a low-noise worker that never comes)."""
    if split:
        for key, want in zip(SPLIT_HALVES, ("high", "low"), strict=True):
            got = loaded[key].transformer.experts
            if got != want:
                raise GroupError(f"{files[key]}: transformer.experts is {got!r}; this split "
                                 f"group's {want}-noise worker needs \"experts\": \"{want}\"")
        return
    got = loaded["transformer"].transformer.experts
    if got in ("high", "low"):
        raise GroupError(
            f"{files['transformer']}: transformer.experts is {got!r} (the split placement), "
            "but the group starts one DiT worker; start a split group with --split "
            f"(EXPERTS=split), from {group}_transformer_high.json and "
            f"{group}_transformer_low.json")


def check_group(group: str, files: dict[str, Path], loaded: dict[str, ServiceConfig]) -> None:
    """The four files must describe one group: same pipeline, same rings, no port clash."""
    ctl = loaded["controller"]
    for key, cfg in loaded.items():
        where, role = files[key], role_of(key)
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
