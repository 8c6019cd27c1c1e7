"""Hosting a ring: its region on its handshake port, the peers that join it, the scanner.

A :class:`RingHost` owns one :class:`~rings.verbs.Region` and serves it on one port. Each
connection is a peer (:mod:`rings.connection`): it authenticates (see :mod:`rings.wire`), gets a
holder id, and then either sends verbs (tcp) or keeps the connection open while it uses its
queue pair (rdma). A peer is alive while its connection is open; what the host does when it
drops, or when a claim or a ticket is held too long (revoke first, then repair), is argued in
:mod:`rings.repair`, which the host is built on; the scanner runs it every ``scan_interval_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Protocol

from rings import wire
from rings.connection import PeerProtocol, check_join
from rings.errors import VerbsError
from rings.layout import HOLDER_LOCAL, MAX_HOLDER, SEATS, RingLayout
from rings.ports import bind_error
from rings.repair import PeerInfo, RepairCounts, RingRepair, log
from rings.verbs import Region, Verbs

__all__ = ["PeerInfo", "RdmaJoinHook", "RepairCounts", "RingHost"]


class RdmaJoinHook(Protocol):
    """What the rdma transport plugs into a host: :class:`rings.rdma.RdmaJoin`, from
    ``rings.rdma.make_rdma_join``."""

    def __call__(self, host: RingHost, peer: PeerInfo, join: dict[str, Any]) -> dict[str, Any]:
        """Take over a JOIN asking for transport "rdma": the extra WELCOME fields (it sets
        ``peer.revoke_hook``); raise VerbsError to refuse."""

    def loopback(self, host: RingHost) -> Verbs:
        """The host's own verbs on its region through the NIC (see ``start``)."""

    def release(self, region: Region) -> None:
        """Tear down every queue pair onto ``region`` and deregister it."""


class RingHost(RingRepair):
    """Serves one ring region on ``host:port`` and keeps it flowing when peers die."""

    def __init__(
        self,
        layout: RingLayout,
        *,
        host: str,
        port: int,
        token: str,
        claim_timeout_s: float = 30.0,
        scan_interval_s: float = 0.2,
        rdma_join: RdmaJoinHook | None = None,
    ) -> None:
        super().__init__(layout, claim_timeout_s)
        self.host = host
        self.port = port
        self.token = token
        self.scan_interval_s = scan_interval_s
        self.rdma_join = rdma_join
        self._protocols: dict[int, PeerProtocol] = {}
        self._next_id = HOLDER_LOCAL + 1
        self._server: asyncio.base_events.Server | None = None
        self._scanner: asyncio.Task[None] | None = None

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self.rdma_join is not None:
            self.local = self.rdma_join.loopback(self)
        try:
            self._server = await loop.create_server(
                lambda: PeerProtocol(self), self.host, self.port, reuse_address=True
            )
        except OSError as exc:
            raise bind_error(f"ring {self.layout.name!r}", self.host, self.port, exc) from exc
        if self.port == 0:
            self.port = self._server.sockets[0].getsockname()[1]
        self._scanner = asyncio.create_task(self._scan_loop(), name=f"scan-{self.layout.name}")
        log.info(
            "ring %s: %d slots x %d bytes on %s:%d",
            self.layout.name,
            self.layout.slot_count,
            self.layout.slot_size,
            self.host,
            self.port,
        )

    async def close(self) -> None:
        if self._scanner is not None:
            self._scanner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._scanner
        if self._server is not None:
            self._server.close()
        for proto in list(self._protocols.values()):
            proto.drop()
        if self._server is not None:
            await self._server.wait_closed()
        if self.rdma_join is not None:
            self.local.close()
            self.rdma_join.release(self.region)

    # -- peers ---------------------------------------------------------------------------
    def _allocate_id(self) -> int:
        # Seats are shared by ids equal modulo SEATS: never by two peers that can act.
        seated = {p % SEATS for p in (*self.peers, *self._pending_revoke, HOLDER_LOCAL)}
        if len(seated) >= SEATS:
            raise VerbsError(
                f"ring {self.layout.name!r}: all {SEATS - 1} peer seats are taken; "
                "disconnect idle peers or spread them over more rings"
            )
        for _ in range(MAX_HOLDER):
            pid = self._next_id
            self._next_id = pid + 1 if pid < MAX_HOLDER else HOLDER_LOCAL + 1
            if pid % SEATS not in seated and not self._holds_any(pid):
                return pid
        raise VerbsError(f"ring {self.layout.name!r}: no free peer ids")

    def _disconnect(self, peer_id: int) -> None:
        proto = self._protocols.pop(peer_id, None)
        if proto is not None:
            proto.drop()

    async def _scan_loop(self) -> None:
        while True:
            await asyncio.sleep(self.scan_interval_s)
            try:
                self.scan_once()
            except Exception:  # the scanner must survive anything and keep the ring alive
                log.exception("ring %s: scan failed", self.layout.name)

    # -- handshake -----------------------------------------------------------------------
    def _welcome(self, proto: PeerProtocol, join: dict[str, Any], nonce: bytes) -> bytes:
        """Validate a JOIN; return the WELCOME frame (registering the peer) or raise."""
        name = self.layout.name
        ring, client_nonce, role = check_join(
            join, layout=self.layout, token=self.token, nonce=nonce
        )
        transport = join.get("transport", "tcp")
        peer = PeerInfo(
            peer_id=self._allocate_id(),
            name=str(join.get("peer_name", "?"))[:128],
            role=role,
            transport=transport,
            address=proto.address,
            connected_at=time.time(),
        )
        extras: dict[str, Any] = {}
        if transport == "rdma":
            if self.rdma_join is None:
                raise VerbsError(
                    f"ring {name!r} is not served over rdma by this host (no RDMA device or "
                    "rdma disabled); connect with transport 'tcp'"
                )
            extras = self.rdma_join(self, peer, join)
        elif transport != "tcp":
            raise VerbsError(f"unknown transport {transport!r}")
        self.peers[peer.peer_id] = peer
        self._protocols[peer.peer_id] = proto
        proto.peer = peer
        log.info(
            "ring %s: peer %d joined (%s, %s, %s, %s)",
            name,
            peer.peer_id,
            peer.name,
            role,
            transport,
            proto.address,
        )
        return wire.pack_msg(
            {
                "ok": True,
                "peer_id": peer.peer_id,
                "layout": self.layout.describe(),
                "region_size": self.region.size,
                "mac": wire.mac(self.token, b"welcome", client_nonce, nonce, ring.encode()),
                **extras,
            }
        )

    def _lost(self, proto: PeerProtocol) -> None:
        peer = proto.peer
        if peer is not None and peer.peer_id in self.peers:
            self.revoke(peer.peer_id, "connection dropped")

