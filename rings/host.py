"""Hosting a ring: its region, its handshake port, peer liveness and stall repair.

A :class:`RingHost` owns one :class:`~rings.verbs.Region` and serves it on one port. Each
connection is a peer: it authenticates (see :mod:`rings.wire`), gets a holder id, and then
either sends verbs (tcp) or keeps the connection open while it uses its queue pair (rdma).

Liveness. A peer is alive while its connection is open. When the connection drops, or when
one of its claims is older than ``claim_timeout_s`` (timed by the host itself from when it
first saw the claim, so no peer clock is trusted), the host

  1. revokes the peer: marks it revoked, so none of its buffered or later verbs is executed,
     and closes its connection (an rdma peer's queue pair is destroyed by its revoke hook);
  2. then repairs the peer's slots: an unpublished CLAIMED_PUSH becomes a TOMBSTONE that
     consumers skip, an unfreed CLAIMED_POP is freed, each by a CAS on the stamp, counted in
     the region header;
  3. and gives up the tickets it held but had not claimed (its seat words, and positions no
     live peer declares; see :mod:`rings.tickets`): a producer's becomes a TOMBSTONE
     (counted), a consumer's item becomes ORPHANED for any consumer to take.

Order matters: a slot is never repaired while its holder could still write to it. A live
peer's declared ticket is given up without revoking it when it has been ready and unused past
the claim timeout (its holder claims by CAS first, so it just takes a new ticket); a live peer
stuck between a ticket and its claim past the timeout is revoked like a stuck claimer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from rings import wire
from rings.errors import VerbsError
from rings.layout import (
    HOLDER_LOCAL,
    MAX_HOLDER,
    OFF_FREED,
    OFF_HEAD,
    OFF_ORPHAN_HINT,
    OFF_ORPHANED,
    OFF_REVOKED,
    OFF_TOMBSTONES,
    PUSH,
    SEAT_BYTES,
    SEATS,
    STAMPS_OFFSET,
    WRITABLE_FROM,
    RingLayout,
    SlotState,
    stamp,
    unpack_stamp,
)
from rings.ports import bind_error
from rings.tickets import SIDE_NAMES, RegionView, TicketWatch, seat_holds
from rings.verbs import READ, LocalVerbs, Region, Verbs, check_op, execute_ops

log = logging.getLogger("diffring.rings.host")


@dataclass
class PeerInfo:
    """What the host knows about one connected peer."""

    peer_id: int
    name: str
    role: str
    transport: str
    address: str
    connected_at: float
    revoked: bool = False
    revoke_hook: Callable[[], None] | None = None
    verbs_served: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RepairCounts:
    tombstones: int
    freed: int
    revoked: int
    orphaned: int = 0


class RdmaJoin(Protocol):
    """What the rdma transport plugs into a host (``rings.rdma.make_rdma_join``)."""

    def __call__(self, host: RingHost, peer: PeerInfo, join: dict[str, Any]) -> dict[str, Any]:
        """Take over a JOIN asking for transport "rdma": the extra WELCOME fields (it sets
        ``peer.revoke_hook``); raise VerbsError to refuse."""

    def loopback(self, host: RingHost) -> Verbs:
        """The host's own verbs on its region through the NIC (see ``start``)."""

    def release(self, region: Region) -> None:
        """Tear down every queue pair onto ``region`` and deregister it."""


class RingHost:
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
        rdma_join: RdmaJoin | None = None,
    ) -> None:
        self.layout = layout
        self.host = host
        self.port = port
        self.token = token
        self.claim_timeout_s = claim_timeout_s
        self.scan_interval_s = scan_interval_s
        self.rdma_join = rdma_join
        self.region = Region(layout)
        # The host's own verbs. With rdma, start() swaps in a loopback queue pair: a NIC's
        # atomics are not atomic with respect to CPU updates made under region.lock.
        self.local: Verbs = LocalVerbs(self.region, HOLDER_LOCAL)
        self.peers: dict[int, PeerInfo] = {}
        self._protocols: dict[int, _PeerProtocol] = {}
        self._next_id = HOLDER_LOCAL + 1
        self._first_seen: dict[tuple[int, int], float] = {}
        self._pending_revoke: dict[int, PeerInfo] = {}
        self._tickets = TicketWatch(layout)
        self._in_ticket_repair = False
        self._server: asyncio.base_events.Server | None = None
        self._scanner: asyncio.Task[None] | None = None

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self.rdma_join is not None:
            self.local = self.rdma_join.loopback(self)
        try:
            self._server = await loop.create_server(
                lambda: _PeerProtocol(self), self.host, self.port, reuse_address=True
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

    def _holds_any(self, pid: int) -> bool:
        return any(holder == pid for _s, _p, _st, holder in self._stamps())

    def _stamps(self) -> list[tuple[int, int, SlotState, int]]:
        raw = self.local.read(STAMPS_OFFSET, 8 * self.layout.slot_count)
        out = []
        for slot, (word,) in enumerate(struct.iter_unpack("<Q", raw)):
            pos, state, holder = unpack_stamp(word)
            out.append((slot, pos, state, holder))
        return out

    def revoke(self, peer_id: int, reason: str, *, timed_out: bool = False) -> None:
        """Cut a peer off, then repair every slot it holds.

        A peer that leaves holding no claim is just gone; a peer cut off while holding
        claims (or for holding one too long) counts as revoked in the region header.
        """
        peer = self.peers.pop(peer_id, None)
        proto = self._protocols.pop(peer_id, None)
        holds = self._holds_any(peer_id)
        if peer is not None and not peer.revoked:
            peer.revoked = True
            counted = holds or timed_out or self._seat_holds(peer_id)
            if peer.revoke_hook is not None and not self._run_revoke_hook(peer):
                # Its queue pair may still be able to write: repair only once the hook
                # succeeds (retried by the scanner), never while the peer can write.
                self._pending_revoke[peer_id] = peer
                holds = False
            else:
                self._release_seats(peer_id)
            if counted:
                self.local.fetch_and_add(OFF_REVOKED, 1)
                log.warning(
                    "ring %s: revoked peer %d (%s, %s): %s",
                    self.layout.name,
                    peer_id,
                    peer.name,
                    peer.address,
                    reason,
                )
            else:
                log.info("ring %s: peer %d (%s) left", self.layout.name, peer_id, peer.name)
        if proto is not None:
            proto.drop()
        if holds:
            self.repair(peer_id)
        self.repair_tickets()

    def _run_revoke_hook(self, peer: PeerInfo) -> bool:
        assert peer.revoke_hook is not None
        try:
            peer.revoke_hook()
        except Exception:
            log.exception(
                "ring %s: revoke hook of peer %d failed; repair deferred",
                self.layout.name,
                peer.peer_id,
            )
            return False
        return True

    def repair(self, peer_id: int) -> int:
        """Turn ``peer_id``'s claimed slots into tombstones / free slots; returns count."""
        repaired = 0
        cap = self.layout.slot_count
        for slot, pos, state, holder in self._stamps():
            if holder != peer_id:
                continue
            off = STAMPS_OFFSET + 8 * slot
            old = stamp(pos, state, holder)
            if state == SlotState.CLAIMED_PUSH:
                new, counter = stamp(pos, SlotState.TOMBSTONE), OFF_TOMBSTONES
            elif state == SlotState.CLAIMED_POP:
                new, counter = stamp(pos + cap, SlotState.FREE), OFF_FREED
            else:
                continue
            if self.local.compare_and_swap(off, old, new) == old:
                self.local.fetch_and_add(counter, 1)
                repaired += 1
                log.warning(
                    "ring %s: repaired slot %d (position %d, %s of peer %d)",
                    self.layout.name,
                    slot,
                    pos,
                    state.name,
                    peer_id,
                )
        return repaired

    # -- tickets (see rings.tickets) -------------------------------------------------------
    def _view(self, extra: tuple[int, ...] = ()) -> RegionView:
        """Counters, then stamps, then the seats of every peer that can act (and ``extra``):
        one batch, read in this order (what rings.tickets relies on)."""
        lay = self.layout
        head_raw, stamps_raw, seats_raw = self.local.batch(
            [
                (READ, OFF_HEAD, OFF_ORPHAN_HINT + 8 - OFF_HEAD),
                (READ, STAMPS_OFFSET, 8 * lay.slot_count),
                (READ, lay.seats_offset, SEATS * SEAT_BYTES),
            ]
        )
        head, tail = struct.unpack_from("<QQ", head_raw)
        (hint,) = struct.unpack_from("<Q", head_raw, OFF_ORPHAN_HINT - OFF_HEAD)
        pids = {*self.peers, *self._pending_revoke, HOLDER_LOCAL, *extra}
        return RegionView(
            head,
            tail,
            hint,
            tuple(w for (w,) in struct.iter_unpack("<Q", stamps_raw)),
            {p: struct.unpack_from("<QQ", seats_raw, SEAT_BYTES * (p % SEATS)) for p in pids},
        )

    def _seat_holds(self, peer_id: int) -> bool:
        """Whether a peer's seats say it holds a ticket (or may: TAKING)."""
        view = self._view((peer_id,))
        return seat_holds(view, view.seats[peer_id], self.layout.slot_count)

    def _release_seats(self, peer_id: int) -> None:
        """A cut-off peer's declared tickets are given up; its seat is free for another."""
        view = self._view((peer_id,))
        self._tickets.forget_peer(view, view.seats[peer_id])
        self.local.write(self.layout.seat_offset(peer_id, PUSH), bytes(SEAT_BYTES))

    def repair_tickets(self, now: float | None = None) -> None:
        """Give up the tickets whose holders are gone or idle past the claim timeout; revoke
        live peers stuck between a ticket and its claim past it; renew the orphan hint."""
        if self._in_ticket_repair:  # a revoke below comes back here
            return
        self._in_ticket_repair = True
        try:
            now = time.monotonic() if now is None else now
            view = self._view()
            live = {*self.peers, *self._pending_revoke, HOLDER_LOCAL}
            acts = self._tickets.step(view, live, now, self.claim_timeout_s)
            orphans = {
                pos
                for pos, state, _ in map(unpack_stamp, view.stamps)
                if state == SlotState.ORPHANED
            }
            for g in acts.give_up:
                off = self.layout.stamp_offset(g.position)
                if self.local.compare_and_swap(off, g.old, g.new) != g.old:
                    continue
                new_state = unpack_stamp(g.new)[1]
                if new_state == SlotState.TOMBSTONE:
                    self.local.fetch_and_add(OFF_TOMBSTONES, 1)
                elif new_state == SlotState.ORPHANED:
                    self.local.fetch_and_add(OFF_ORPHANED, 1)
                    orphans.add(g.position)
                log.warning(
                    "ring %s: gave up the %s ticket of position %d (%s)",
                    self.layout.name,
                    SIDE_NAMES[g.side],
                    g.position,
                    new_state.name,
                )
            hint = min(orphans) + 1 if orphans else 0
            if hint != view.orphan_hint:
                self.local.write(OFF_ORPHAN_HINT, struct.pack("<Q", hint))
            for pid in acts.revoke:
                if pid in self.peers:
                    self.revoke(
                        pid,
                        f"ticket held unclaimed longer than the {self.claim_timeout_s:g} s "
                        "claim timeout",
                        timed_out=True,
                    )
        finally:
            self._in_ticket_repair = False
        if acts.revoke:
            self.repair_tickets(now)

    def repair_counts(self) -> RepairCounts:
        raw = self.local.read(OFF_TOMBSTONES, OFF_ORPHANED + 8 - OFF_TOMBSTONES)
        t, f, r, _hint, o = struct.unpack("<QQQQQ", raw)
        return RepairCounts(t, f, r, o)

    def scan_once(self, now: float | None = None) -> None:
        """Time every claim; revoke holders of over-age claims and repair orphaned ones."""
        now = time.monotonic() if now is None else now
        for pid, peer in list(self._pending_revoke.items()):
            if self._run_revoke_hook(peer):
                del self._pending_revoke[pid]
                self.repair(pid)
                self._release_seats(pid)
        seen: dict[tuple[int, int], float] = {}
        stale: set[int] = set()
        for slot, pos, state, holder in self._stamps():
            if state not in (SlotState.CLAIMED_PUSH, SlotState.CLAIMED_POP):
                continue
            if holder == HOLDER_LOCAL:
                continue
            if holder in self._pending_revoke:
                continue  # not yet cut off: must not be repaired
            if holder not in self.peers:
                # The holder is gone (its revoke raced with this claim's verb, or it was
                # never a live peer): nobody can write this slot any more, repair it.
                stale.add(holder)
                continue
            key = (slot, stamp(pos, state, holder))
            first = self._first_seen.get(key, now)
            seen[key] = first
            if now - first > self.claim_timeout_s:
                stale.add(holder)
        self._first_seen = seen
        for holder in stale:
            if holder in self.peers:
                self.revoke(
                    holder,
                    f"claim held longer than the {self.claim_timeout_s:g} s claim timeout",
                    timed_out=True,
                )
            else:
                self.repair(holder)
        self.repair_tickets(now)

    async def _scan_loop(self) -> None:
        while True:
            await asyncio.sleep(self.scan_interval_s)
            try:
                self.scan_once()
            except Exception:  # the scanner must survive anything and keep the ring alive
                log.exception("ring %s: scan failed", self.layout.name)

    # -- handshake -----------------------------------------------------------------------
    def _welcome(self, proto: _PeerProtocol, join: dict[str, Any], nonce: bytes) -> bytes:
        """Validate a JOIN; return the WELCOME frame (registering the peer) or raise."""
        name = self.layout.name
        if join.get("proto") != wire.PROTO or join.get("version") != wire.PROTO_VERSION:
            raise VerbsError(
                f"protocol mismatch: host speaks {wire.PROTO!r} v{wire.PROTO_VERSION}, peer "
                f"speaks {join.get('proto')!r} v{join.get('version')}"
            )
        client_nonce = join.get("client_nonce")
        ring = join.get("ring")
        if not isinstance(client_nonce, bytes) or not isinstance(ring, str):
            raise VerbsError("malformed join message")
        expected = wire.mac(self.token, b"join", nonce, client_nonce, ring.encode())
        got = join.get("mac")
        if not isinstance(got, bytes) or not wire.hmac.compare_digest(got, expected):
            raise VerbsError(
                f"authentication failed: the peer did not prove the cluster token for ring "
                f"{name!r} (check that every service is configured with the same token)"
            )
        if ring != name:
            raise VerbsError(f"ring mismatch: this port serves ring {name!r}, peer asked {ring!r}")
        want = join.get("layout")
        have = self.layout.describe()
        if want is not None and want != have:
            raise VerbsError(
                f"layout mismatch on ring {name!r}: host has {_fmt_layout(have)}, "
                f"peer expects {_fmt_layout(want)}"
            )
        role = join.get("role", "peer")
        if role not in ("peer", "inspect"):
            raise VerbsError(f"unknown role {role!r} (expected 'peer' or 'inspect')")
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
                "layout": have,
                "region_size": self.region.size,
                "mac": wire.mac(self.token, b"welcome", client_nonce, nonce, ring.encode()),
                **extras,
            }
        )

    def _lost(self, proto: _PeerProtocol) -> None:
        peer = proto.peer
        if peer is not None and peer.peer_id in self.peers:
            self.revoke(peer.peer_id, "connection dropped")


def _fmt_layout(d: Any) -> str:
    if not isinstance(d, dict):
        return repr(d)
    return (
        f"{d.get('slot_count')} slots x {d.get('slot_size')} bytes "
        f"(layout v{d.get('version')}, ring {d.get('name')!r})"
    )


class _PeerProtocol(asyncio.Protocol):
    """One peer connection: handshake first, then in-order verb requests."""

    def __init__(self, host: RingHost) -> None:
        self.host = host
        self.peer: PeerInfo | None = None
        self.transport: asyncio.Transport | None = None
        self.address = "?"
        self.buf = bytearray()
        self.nonce = secrets.token_bytes(32)
        self.dropped = False
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses; they have the same API.
        tr: asyncio.Transport = transport  # type: ignore[assignment]
        self.transport = tr
        peername = transport.get_extra_info("peername")
        self.address = f"{peername[0]}:{peername[1]}" if peername else "?"
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        tr.write(
            wire.pack_msg({"proto": wire.PROTO, "version": wire.PROTO_VERSION, "nonce": self.nonce})
        )
        self._timer = asyncio.get_running_loop().call_later(
            wire.HANDSHAKE_TIMEOUT_S, self._handshake_timeout
        )

    def _handshake_timeout(self) -> None:
        if self.peer is None:
            log.warning(
                "ring %s: %s never completed the handshake", self.host.layout.name, self.address
            )
            self.drop()

    def drop(self) -> None:
        self.dropped = True
        if self._timer is not None:
            self._timer.cancel()
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.dropped = True
        if self._timer is not None:
            self._timer.cancel()
        self.host._lost(self)

    def _refuse(self, message: str) -> None:
        log.warning("ring %s: refused %s: %s", self.host.layout.name, self.address, message)
        assert self.transport is not None
        self.transport.write(wire.pack_msg({"ok": False, "error": message}))
        self.dropped = True
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.dropped:
            return
        buf = self.buf
        buf += data
        limit = wire.MAX_FRAME if self.peer is not None else wire.MAX_HANDSHAKE_FRAME
        start = 0
        out: list[bytes] = []
        try:
            while len(buf) - start >= 4:
                (n,) = wire.LEN.unpack_from(buf, start)
                if n > limit:
                    raise ValueError(f"frame of {n} bytes exceeds the limit of {limit}")
                if len(buf) - start - 4 < n:
                    break
                body = bytes(buf[start + 4 : start + 4 + n])
                start += 4 + n
                if self.peer is None:
                    self._handle_join(body)
                    if self.dropped:
                        return
                else:
                    out.append(self._handle_verbs(body))
                    if self.peer.revoked:  # revoked mid-buffer: nothing more of it runs
                        return
        except (ValueError, struct.error, IndexError, TypeError) as exc:
            log.warning(
                "ring %s: dropping %s after a malformed message: %s",
                self.host.layout.name,
                self.address,
                exc,
            )
            self.drop()
            return
        finally:
            del buf[:start]
        if out and self.transport is not None:
            self.transport.write(b"".join(out))

    def _handle_join(self, body: bytes) -> None:
        try:
            join = wire.unpack_msg(body)
        except Exception as exc:  # msgpack raises many unrelated types on garbage
            raise ValueError(f"handshake is not a msgpack map: {exc}") from exc
        try:
            welcome = self.host._welcome(self, join, self.nonce)
        except VerbsError as exc:
            self._refuse(str(exc))
            return
        if self._timer is not None:
            self._timer.cancel()
        assert self.transport is not None
        self.transport.write(welcome)

    def _handle_verbs(self, body: bytes) -> bytes:
        peer = self.peer
        assert peer is not None
        if peer.transport != "tcp":
            raise ValueError("verbs over the handshake connection of an rdma peer")
        ops = wire.decode_request(body)
        region = self.host.region
        size = region.size
        try:
            for op in ops:
                check_op(op, size, WRITABLE_FROM)
                if peer.role == "inspect" and op[0] != READ:
                    raise VerbsError(
                        f"peer {peer.peer_id} joined as 'inspect' and may only read", offset=op[1]
                    )
        except VerbsError as exc:
            return wire.encode_error(wire.error_kind(exc), str(exc))
        if self.host.rdma_join is None:
            with region.lock:
                results = execute_ops(region.buf, ops)
        else:  # rdma peers' NICs touch the region too: go through the host's loopback
            try:
                results = self.host.local.batch(ops)
            except VerbsError as exc:
                return wire.encode_error(wire.error_kind(exc), str(exc))
        peer.verbs_served += len(ops)
        return wire.encode_response(ops, results)
