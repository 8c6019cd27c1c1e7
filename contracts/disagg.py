"""Metadata-plane configuration of a service: where the controller's rings and control
channel are and how peers reach them (``disagg_config`` of a service's file).

Field names follow LightX2V's ``disagg_config`` so existing config files keep working; the
keys LightX2V needs for its static rooms and ranks are accepted and ignored with a warning,
because diffring's workers are pull-based and need none. Any other unknown key is an error
that names it (:func:`contracts.configio.from_mapping`).

The rest of a service's file is :class:`contracts.config.ServiceConfig`, which embeds
:class:`DisaggConfig`. The rings themselves (:mod:`rings`) know no services: they take the
plain values (layout, host, port, token) that this section resolves to.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from contracts.cluster_token import DEFAULT_TOKEN
from contracts.configio import from_mapping
from contracts.errors import ConfigError
from contracts.lightx2v import DISAGG_ROOMS, MOONCAKE_KEYS, NO_ROOMS
from rings.layout import RING_NAMES, RingLayout

log = logging.getLogger("diffring.config")


# A file read by a service has these keys translated first (contracts/lightx2v.py); readers
# of the section alone (``diffring inspect``) drop them with the same reasons.
_LIGHTX2V_IGNORED = {
    **{key: NO_ROOMS for key in DISAGG_ROOMS},
    **{key: f"Mooncake's: a service reads it as mooncake.{key}" for key in MOONCAKE_KEYS},
}


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
        """Options the rdma transport takes, for ``rings.transports.connect``."""
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
