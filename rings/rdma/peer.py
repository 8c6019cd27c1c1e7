"""The peer side: :func:`connect` opens an RC queue pair onto a ring host's region.

The peer opens its device (context, protection domain, one completion queue, one RC queue
pair, one small registered local buffer), runs the byte-order self-test of
:mod:`rings.rdma.selftest` once per device and port, then runs the ordinary ring handshake
(:func:`rings.handshake.handshake`) on the ring's port with ``transport="rdma"``; the queue-pair
details it exchanges are listed in :mod:`rings.rdma`. Both queue pairs then go
INIT -> RTR -> RTS. The TCP connection stays open and idle: it is the peer's liveness.

:class:`RdmaVerbs` refuses invalid verbs (out of range, misaligned atomic, a write from an
``inspect`` peer, a message larger than the port allows) before anything is posted, with the
same errors as tcp. A batch that fails after posting (error completion, or no completion
within ``verb_timeout``) raises :class:`~rings.errors.ConnectionLost` and closes the verbs
object: its queue pair is in the error state. As with a TCP connection that drops
mid-batch, earlier verbs of that batch may have taken effect. When the host has closed the
handshake connection too, the error says the peer was revoked.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

from rings.errors import (
    ConnectionLost,
    DiffringError,
    HandshakeError,
    VerbRangeError,
    VerbsError,
)
from rings.handshake import join
from rings.layout import WRITABLE_FROM, RingLayout
from rings.rdma import _pyverbs
from rings.rdma._pyverbs import TCP_HINT
from rings.rdma.device import Device, Endpoint
from rings.rdma.qp import VERB_NAMES, QpPeer, Target
from rings.rdma.selftest import check_atomics
from rings.verbs import READ, WRITE, Op, Verbs, check_op, refuse_unknown_options, transport_options


def _peer_closed(sock: socket.socket) -> bool:
    """Whether the host has closed our handshake connection (it does so when revoking)."""
    try:
        sock.setblocking(False)
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


class RdmaVerbs(Verbs):
    """Verbs executed by this machine's NIC on the host's region (no host CPU involved)."""

    def __init__(
        self,
        endpoint: Endpoint,
        target: Target,
        layout: RingLayout,
        peer_id: int,
        *,
        read_only: bool,
        where: str,
        sock: socket.socket | None,
        verb_timeout: float,
        owns_device: bool,
    ) -> None:
        self._ep: Endpoint | None = endpoint
        self._target = target
        self.layout = layout
        self.peer_id = peer_id
        self.read_only = read_only
        self.where = where
        self._sock = sock
        self.verb_timeout = verb_timeout
        self._owns_device = owns_device
        self._max_msg = endpoint.dev.max_msg
        self._lock = threading.Lock()
        self._closed_because = ""

    def batch(self, ops: Sequence[Op]) -> list[Any]:
        size = self._target.size
        for op in ops:
            check_op(op, size, WRITABLE_FROM)
            code = op[0]
            if self.read_only and code != READ:
                raise VerbsError(
                    f"peer {self.peer_id} joined as 'inspect' and may only read", offset=op[1]
                )
            n = op[2] if code == READ else len(op[2]) if code == WRITE else 8
            if n > self._max_msg:
                raise VerbRangeError(
                    f"{VERB_NAMES[code]} of {n} bytes exceeds the port's largest RDMA message "
                    f"({self._max_msg} bytes)",
                    offset=op[1],
                )
        with self._lock:
            ep = self._ep
            if ep is None:
                raise ConnectionLost(
                    f"rdma verbs to {self.where} used after close{self._closed_because}"
                )
            try:
                deadline = time.monotonic() + self.verb_timeout
                return ep.execute(ops, self._target, deadline, self.where)
            except ConnectionLost as exc:
                revoked = self._sock is not None and _peer_closed(self._sock)
                self._close_locked(f" ({exc})")
                if revoked:
                    raise ConnectionLost(
                        f"{exc}; the ring host has closed this peer's connection (revoked)",
                        offset=exc.offset,
                    ) from exc
                raise
            except VerbsError:
                self._close_locked(" (a local rdma resource failed)")
                raise

    def __enter__(self) -> RdmaVerbs:
        return self

    def _close_locked(self, because: str = "") -> None:
        if self._ep is not None:
            dev = self._ep.dev
            self._ep.close()
            self._ep = None
            self._closed_because = because
            if self._owns_device:
                dev.close()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._close_locked()


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
    device_name: str | None = None,
    ib_port: int = 1,
    gid_index: int = 0,
    self_test: bool = True,
    **unknown: Any,
) -> RdmaVerbs:
    """Connect to ring ``ring`` at host:port with a queue pair onto its region.

    Raises ConfigError naming any option it does not take (before looking for a device),
    TransportUnavailable (naming the tcp alternative) when pyverbs or a usable device is
    missing, HandshakeError when the host refuses, ConnectionLost when it is unreachable.
    """
    refuse_unknown_options("rdma", unknown, transport_options(connect))
    # Through the module, not a name imported from it: tests substitute a fake pyverbs there.
    pv = _pyverbs.load_pyverbs()
    dev = Device(pv, device_name, ib_port, gid_index)
    where = f"{host}:{port}"
    ep: Endpoint | None = None
    sock: socket.socket | None = None
    try:
        if self_test:
            check_atomics(dev)
        ep = Endpoint(dev)
        sock, welcome = join(
            host, port, timeout, ring=ring, layout=layout, token=token, transport="rdma",
            role=role, peer_name=peer_name, extras=ep.info(),
        )
        try:
            agreed = RingLayout(**welcome["layout"])
            remote = QpPeer.parse(welcome, f"ring host {where}")
            target = Target(
                int(welcome["addr"]),
                int(welcome["rkey"]),
                int(welcome["write_rkey"]),
                int(welcome["region_size"]),
            )
            mtu = min(int(welcome["mtu"]), dev.mtu)
            max_rd_atomic = min(dev.max_rd_atomic, int(welcome["max_dest_rd_atomic"]))
            host_link = welcome["link_layer"]
            peer_id = int(welcome["peer_id"])
        except (KeyError, TypeError, ValueError, DiffringError) as exc:
            raise HandshakeError(
                f"ring host {where} sent an unusable rdma welcome ({exc}); do both sides run "
                "the same diffring version?"
            ) from exc
        if host_link != dev.link_layer:
            raise HandshakeError(
                f"ring host {where} is on {host_link} but this peer's {dev.where} is on "
                f"{dev.link_layer}: their RDMA ports cannot reach each other; {TCP_HINT}"
            )
        if target.size != agreed.region_size:
            raise HandshakeError(
                f"ring host {where} announced a region of {target.size} bytes, but its layout "
                f"needs {agreed.region_size}"
            )
        ep.connect(remote, mtu=mtu, max_rd_atomic=max_rd_atomic)
        # From here on the connection carries nothing: it only tells the host we are alive.
        sock.settimeout(None)
    except BaseException:
        if sock is not None:
            sock.close()
        if ep is not None:
            ep.close()
        dev.close()
        raise
    return RdmaVerbs(
        ep,
        target,
        agreed,
        peer_id,
        read_only=role == "inspect",
        where=where,
        sock=sock,
        verb_timeout=verb_timeout,
        owns_device=True,
    )
