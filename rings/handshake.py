"""A peer's side of a ring's port: open it, read a frame, run the handshake.

Both verbs transports start here: the tcp transport (:mod:`rings.tcp`) then sends its verbs
over the joined socket, the rdma transport (:mod:`rings.rdma.peer`) exchanges its queue
pair's details in the same JOIN / WELCOME and keeps the socket open, idle, as its liveness.
The control channel's client uses the same handshake on the controller's control port.
"""

from __future__ import annotations

import os
import secrets
import socket
import struct
from typing import Any

from rings import wire
from rings.errors import ConnectionLost, HandshakeError
from rings.layout import RingLayout


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionLost("ring host closed the connection")
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket, limit: int = wire.MAX_FRAME) -> bytes:
    (n,) = wire.LEN.unpack(_recv_exact(sock, 4))
    if n > limit:
        raise ConnectionLost(f"frame of {n} bytes exceeds the limit of {limit}")
    return _recv_exact(sock, n)


def handshake(
    sock: socket.socket,
    *,
    ring: str,
    layout: RingLayout | None,
    token: str,
    transport: str,
    role: str = "peer",
    peer_name: str | None = None,
    extras: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the peer side of the handshake on a connected socket; return the WELCOME map."""
    try:
        hello = wire.unpack_msg(recv_frame(sock, wire.MAX_HANDSHAKE_FRAME))
    except (ValueError, struct.error) as exc:
        raise HandshakeError(f"ring host sent a malformed greeting: {exc}") from exc
    if hello.get("proto") != wire.PROTO or hello.get("version") != wire.PROTO_VERSION:
        raise HandshakeError(
            f"ring host speaks {hello.get('proto')!r} v{hello.get('version')}, this peer "
            f"speaks {wire.PROTO!r} v{wire.PROTO_VERSION}"
        )
    nonce = bytes(hello["nonce"])
    client_nonce = secrets.token_bytes(32)
    join: dict[str, Any] = {
        "proto": wire.PROTO,
        "version": wire.PROTO_VERSION,
        "ring": ring,
        "layout": layout.describe() if layout is not None else None,
        "transport": transport,
        "role": role,
        "peer_name": peer_name or f"{socket.gethostname()}:{os.getpid()}",
        "client_nonce": client_nonce,
        "mac": wire.mac(token, b"join", nonce, client_nonce, ring.encode()),
        **(extras or {}),
    }
    sock.sendall(wire.pack_msg(join))
    try:
        reply = wire.unpack_msg(recv_frame(sock, wire.MAX_HANDSHAKE_FRAME))
    except ConnectionLost as exc:
        raise HandshakeError(f"ring host closed the connection during handshake ({exc})") from exc
    if not reply.get("ok"):
        raise HandshakeError(f"ring host refused: {reply.get('error', 'no reason given')}")
    expected = wire.mac(token, b"welcome", client_nonce, nonce, ring.encode())
    if not isinstance(reply.get("mac"), bytes) or not wire.hmac.compare_digest(
        reply["mac"], expected
    ):
        raise HandshakeError("ring host did not prove it holds the cluster token")
    return reply


def open_socket(host: str, port: int, timeout: float) -> socket.socket:
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise ConnectionLost(f"cannot reach ring host {host}:{port}: {exc}") from exc
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def join(
    host: str, port: int, timeout: float, **handshake_args: Any
) -> tuple[socket.socket, dict[str, Any]]:
    """Open the ring's port and run the handshake (:func:`handshake`'s keyword arguments):
    the connected socket and the WELCOME map. Nothing is left open when it fails; a socket
    error or a malformed greeting is a HandshakeError naming the host."""
    sock = open_socket(host, port, timeout)
    try:
        return sock, handshake(sock, **handshake_args)
    except (OSError, KeyError, TypeError) as exc:
        sock.close()
        raise HandshakeError(f"handshake with {host}:{port} failed: {exc}") from exc
    except BaseException:
        sock.close()
        raise
