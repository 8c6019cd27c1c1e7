"""The ``tcp`` verbs transport, peer side: the host executes our verbs on its region.

One blocking socket per peer (TCP_NODELAY: a verb batch is one small frame and must not
wait for Nagle), opened and joined by :func:`rings.handshake.join`, the handshake the rdma
transport runs on the same port too.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

from rings import wire
from rings.errors import ConnectionLost, HandshakeError
from rings.handshake import join, recv_frame
from rings.layout import RingLayout
from rings.verbs import (
    RDMA_ONLY_OPTIONS,
    Op,
    Verbs,
    refuse_unknown_options,
    transport_options,
)


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
