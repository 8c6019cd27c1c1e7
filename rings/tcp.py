"""The ``tcp`` verbs transport, peer side: the host executes our verbs on its region.

One blocking socket per peer (TCP_NODELAY: a verb batch is one small frame and must not
wait for Nagle). The handshake is shared with the rdma transport, which uses the same port
to exchange queue-pair details and keeps the connection open as its liveness signal.
"""

from __future__ import annotations

import os
import secrets
import socket
import struct
from collections.abc import Sequence
from typing import Any

from rings import wire
from rings.errors import ConnectionLost, HandshakeError
from rings.layout import RingLayout
from rings.verbs import (
    RDMA_ONLY_OPTIONS,
    Op,
    Verbs,
    refuse_unknown_options,
    transport_options,
)


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


class TcpVerbs(Verbs):
    """Verbs executed by the host over one TCP connection (linearizable on the host)."""

    def __init__(
        self, sock: socket.socket, layout: RingLayout, peer_id: int, read_only: bool, where: str
    ) -> None:
        self._sock: socket.socket | None = sock
        self.layout = layout
        self.peer_id = peer_id
        self.read_only = read_only
        self.where = where

    def batch(self, ops: Sequence[Op]) -> list[Any]:
        sock = self._sock
        if sock is None:
            raise ConnectionLost(f"verbs to {self.where} used after close")
        try:
            sock.sendall(wire.encode_request(ops))
            body = recv_frame(sock)
        except (OSError, ConnectionLost) as exc:
            self.close()
            raise ConnectionLost(f"connection to ring host {self.where} lost: {exc}") from exc
        return wire.decode_response(body, ops)

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None


def connect(
    host: str,
    port: int,
    *,
    layout: RingLayout | None,
    ring: str,
    token: str,
    role: str = "peer",
    peer_name: str | None = None,
    timeout: float = 10.0,
    verb_timeout: float = 30.0,
    **rdma_options: Any,
) -> TcpVerbs:
    """Connect to the ring ``ring`` served at host:port and complete the handshake.

    ``rdma_options``: the rdma transport's own options (:data:`rings.verbs.RDMA_ONLY_OPTIONS`),
    accepted and ignored, since callers pass them to every transport; any other option is a
    ConfigError naming it.
    """
    refuse_unknown_options(
        "tcp", rdma_options, transport_options(connect), ignored=RDMA_ONLY_OPTIONS
    )
    sock, welcome = join(
        host, port, timeout, ring=ring, layout=layout, token=token, transport="tcp", role=role,
        peer_name=peer_name,
    )
    try:
        agreed = RingLayout(**welcome["layout"])
        # A host that stops answering must surface as ConnectionLost, never a hang.
        sock.settimeout(verb_timeout)
    except (OSError, KeyError, TypeError) as exc:
        sock.close()
        raise HandshakeError(f"handshake with {host}:{port} failed: {exc}") from exc
    return TcpVerbs(sock, agreed, int(welcome["peer_id"]), role == "inspect", f"{host}:{port}")
