"""One peer's connection to a ring host: the handshake, then the verbs of a tcp peer.

The host greets every connection with a nonce; the peer answers with a JOIN that proves the
cluster token (:mod:`rings.wire`) and names the ring, its layout, its role and its transport;
:func:`check_join` refuses a JOIN that does not fit this host, and the host registers the
peer (:meth:`rings.host.RingHost._welcome`). A tcp peer then sends verb batches, executed in
order on the region; an rdma peer keeps the connection open, idle, as its liveness.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import struct
from typing import Any, Protocol

from rings import wire
from rings.errors import VerbsError
from rings.layout import WRITABLE_FROM, RingLayout
from rings.repair import PeerInfo, log
from rings.verbs import READ, Region, Verbs, check_op, execute_ops


class ServingHost(Protocol):
    """What a connection needs of its :class:`~rings.host.RingHost` (typed here so that this
    module does not import the host that imports it)."""

    layout: RingLayout
    region: Region
    local: Verbs

    @property
    def rdma_join(self) -> object | None: ...

    def _welcome(self, proto: PeerProtocol, join: dict[str, Any], nonce: bytes) -> bytes: ...

    def _lost(self, proto: PeerProtocol) -> None: ...


def check_join(join: dict[str, Any], *, layout: RingLayout, token: str, nonce: bytes
               ) -> tuple[str, bytes, str]:
    """Refuse (VerbsError) a JOIN that does not fit the ring ``layout`` served here, answers
    the greeting ``nonce`` without the cluster token, or names an unknown role; else the ring's
    name, the peer's nonce and its role."""
    name = layout.name
    if join.get("proto") != wire.PROTO or join.get("version") != wire.PROTO_VERSION:
        raise VerbsError(
            f"protocol mismatch: host speaks {wire.PROTO!r} v{wire.PROTO_VERSION}, peer "
            f"speaks {join.get('proto')!r} v{join.get('version')}"
        )
    client_nonce = join.get("client_nonce")
    ring = join.get("ring")
    if not isinstance(client_nonce, bytes) or not isinstance(ring, str):
        raise VerbsError("malformed join message")
    expected = wire.mac(token, b"join", nonce, client_nonce, ring.encode())
    got = join.get("mac")
    if not isinstance(got, bytes) or not wire.hmac.compare_digest(got, expected):
        raise VerbsError(
            f"authentication failed: the peer did not prove the cluster token for ring "
            f"{name!r} (check that every service is configured with the same token)"
        )
    if ring != name:
        raise VerbsError(f"ring mismatch: this port serves ring {name!r}, peer asked {ring!r}")
    want = join.get("layout")
    have = layout.describe()
    if want is not None and want != have:
        raise VerbsError(
            f"layout mismatch on ring {name!r}: host has {_fmt_layout(have)}, "
            f"peer expects {_fmt_layout(want)}"
        )
    role = join.get("role", "peer")
    if role not in ("peer", "inspect"):
        raise VerbsError(f"unknown role {role!r} (expected 'peer' or 'inspect')")
    return ring, client_nonce, role


def _fmt_layout(d: Any) -> str:
    if not isinstance(d, dict):
        return repr(d)
    return (
        f"{d.get('slot_count')} slots x {d.get('slot_size')} bytes "
        f"(layout v{d.get('version')}, ring {d.get('name')!r})"
    )


class PeerProtocol(asyncio.Protocol):
    """One peer connection: handshake first, then in-order verb requests."""

    def __init__(self, host: ServingHost) -> None:
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
