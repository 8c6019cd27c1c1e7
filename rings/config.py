"""Metadata-plane configuration: where the controller's rings and control channel are and
how peers reach them (``disagg_config`` of a service's file), plus the strict JSON-object to
frozen-dataclass reader every configuration section uses.

The rest of a service's file (model, device, Mooncake, front door) is
:class:`contracts.config.ServiceConfig`; it embeds :class:`DisaggConfig`.

Field names follow LightX2V's ``disagg_config`` so existing config files keep working; the
keys LightX2V needs for its static rooms and ranks are accepted and ignored with a warning,
because diffring's workers are pull-based and need none. Any other unknown key is an error
that names it.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from rings.errors import ConfigError
from rings.layout import RingLayout

log = logging.getLogger("diffring.config")

T = TypeVar("T")

DEFAULT_TOKEN = "diffring-dev-token"
RING_NAMES = ("request", "phase1", "phase2")


def _check_type(value: Any, hint: Any, where: str) -> Any:
    """Loose type check of one JSON value against a dataclass field annotation."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_type(value, arg, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r}")
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool):
        if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
            raise ConfigError(f"{where}: expected {hint.__name__}, got {value!r}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return tuple(value) if origin is tuple else list(value)
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected an object, got {value!r}")
        return value
    return value


def from_mapping(
    cls: type[T],
    data: Mapping[str, Any] | None,
    where: str,
    ignored: Mapping[str, str] | None = None,
) -> T:
    """Build frozen dataclass ``cls`` from a JSON object, naming any unknown key.

    ``ignored``: keys accepted for compatibility and dropped, with the reason to log.
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected an object, got {data!r}")
    data = dict(data)
    assert dataclasses.is_dataclass(cls)
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key in fields:
            kwargs[key] = _check_type(value, hints[key], f"{where}.{key}")
        elif ignored and key in ignored:
            log.warning("config %s.%s is ignored: %s", where, key, ignored[key])
        else:
            known = ", ".join(sorted(fields))
            raise ConfigError(f"unknown config key {where}.{key} (known keys: {known})")
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


_LIGHTX2V_IGNORED = {
    k: "diffring workers pull from rings; there are no static rooms or ranks"
    for k in (
        "bootstrap_room",
        "sender_engine_rank",
        "receiver_engine_rank",
        "decoder_engine_rank",
        "decoder_bootstrap_room",
        "transformer_engine_rank",
        "encoder_engine_rank",
    )
}
_LIGHTX2V_IGNORED["protocol"] = "set the Mooncake protocol in the mooncake config instead"


@dataclass(frozen=True)
class DisaggConfig:
    """Where the controller's rings and control channel live, and how peers reach them."""

    bootstrap_addr: str = "127.0.0.1"
    """Address of the controller (control channel; default host of every ring)."""
    control_port: int = 5565
    """Port of the controller's control channel (register, heartbeat, progress, leases)."""
    rdma_request_handshake_port: int = 5566
    """Handshake port of the request ring."""
    rdma_phase1_handshake_port: int = 5567
    """Handshake port of the Phase1 ring (encoder -> transformer)."""
    rdma_phase2_handshake_port: int = 5568
    """Handshake port of the Phase2 ring (transformer -> decoder)."""
    rdma_request_host: str | None = None
    """Address of the request ring; defaults to bootstrap_addr."""
    rdma_phase1_host: str | None = None
    """Address of the Phase1 ring; defaults to bootstrap_addr."""
    rdma_phase2_host: str | None = None
    """Address of the Phase2 ring; defaults to bootstrap_addr."""
    rdma_buffer_slots: int = 128
    """Slots per ring (ring capacity)."""
    rdma_buffer_slot_size: int = 4096
    """Bytes per slot, payload header included; a multiple of 8."""
    decentralized_queue: bool = True
    """Queue mode. diffring implements only the decentralized queue mode."""
    ring_transport: str = "auto"
    """Verbs transport of peers: 'rdma', 'tcp', or 'auto' (rdma where a device exists)."""
    cluster_token: str | None = None
    """Shared secret every service proves at handshake. None: DIFFRING_CLUSTER_TOKEN from the
    environment (read at start-up), else a development default (a warning is logged)."""
    claim_timeout_s: float = 30.0
    """A ring claim held longer than this gets its holder revoked and the slot repaired."""
    rdma_device_name: str | None = None
    """RDMA device for the ring transport (None: the first one found)."""
    rdma_ib_port: int = 1
    """Port of that device."""
    rdma_gid_index: int = 0
    """GID index (RoCE)."""

    def __post_init__(self) -> None:
        if not self.decentralized_queue:
            raise ConfigError(
                "decentralized_queue is false, but diffring only implements the decentralized "
                "queue mode; remove the key or set it to true"
            )
        if self.ring_transport not in ("auto", "tcp", "rdma"):
            raise ConfigError(
                f"ring_transport must be 'auto', 'tcp' or 'rdma', got {self.ring_transport!r}"
            )
        ports = [
            self.control_port,
            self.rdma_request_handshake_port,
            self.rdma_phase1_handshake_port,
            self.rdma_phase2_handshake_port,
        ]
        for p in ports:
            if not 0 <= p <= 65535:
                raise ConfigError(f"port {p} is out of range")
        nonzero = [p for p in ports if p]
        if len(set(nonzero)) != len(nonzero):
            raise ConfigError(f"control and ring handshake ports must differ, got {ports}")
        if self.claim_timeout_s <= 0:
            raise ConfigError("claim_timeout_s must be positive")
        for name in RING_NAMES:
            self.layout(name)  # validates slot count and size

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> DisaggConfig:
        return from_mapping(cls, data, "disagg_config", ignored=_LIGHTX2V_IGNORED)

    def rdma_options(self) -> dict[str, Any]:
        """Options the rdma transport takes, for ``rings.verbs.connect``."""
        return {
            "device_name": self.rdma_device_name,
            "ib_port": self.rdma_ib_port,
            "gid_index": self.rdma_gid_index,
        }

    def layout(self, ring: str) -> RingLayout:
        return RingLayout(ring, self.rdma_buffer_slots, self.rdma_buffer_slot_size)

    def ring_address(self, ring: str) -> tuple[str, int]:
        host = {
            "request": self.rdma_request_host,
            "phase1": self.rdma_phase1_host,
            "phase2": self.rdma_phase2_host,
        }[ring]
        port = {
            "request": self.rdma_request_handshake_port,
            "phase1": self.rdma_phase1_handshake_port,
            "phase2": self.rdma_phase2_handshake_port,
        }[ring]
        return host or self.bootstrap_addr, port

    def resolve_token(self, env: Mapping[str, str]) -> str:
        """The cluster token: DIFFRING_CLUSTER_TOKEN, else the config's, else the dev default
        (environment over file, as everywhere)."""
        token = env.get("DIFFRING_CLUSTER_TOKEN") or self.cluster_token
        if token:
            return token
        log.warning(
            "no cluster token configured (disagg_config.cluster_token or "
            "DIFFRING_CLUSTER_TOKEN); using the development default"
        )
        return DEFAULT_TOKEN


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (127.0.0.0/8, ::1); every other
    name counts as reachable from elsewhere (nothing is resolved here)."""
    h = host.strip().lower().strip("[]")
    if h == "localhost" or h.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def require_token(token: str, addresses: Mapping[str, str], service: str) -> None:
    """Refuse the development token on a service reachable from other machines.

    ``addresses``: config key -> address the service binds, advertises or joins. The
    default token is public (it is in this file), so with it anyone who reaches a ring or
    the control channel could join as a peer.
    """
    if token != DEFAULT_TOKEN:
        return
    exposed = {k: v for k, v in addresses.items() if not is_loopback(v)}
    if exposed:
        where = ", ".join(f"{k}={v!r}" for k, v in exposed.items())
        raise ConfigError(
            f"{service}: {where} is not a loopback address, and the cluster token is the "
            "public development default. Give every service of the group the same secret "
            "token: export DIFFRING_CLUSTER_TOKEN=$(python -c 'import secrets; "
            "print(secrets.token_hex(32))') (or set disagg_config.cluster_token)"
        )
