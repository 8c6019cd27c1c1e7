"""The host side: :class:`RdmaJoin`, the ``rdma_join`` hook (:class:`rings.host.RdmaJoinHook`)
of :class:`rings.host.RingHost`.

:func:`make_rdma_join` returns None when pyverbs or a device is missing, so the host refuses
rdma joins with its own message that names tcp. Otherwise the :class:`RdmaJoin` it returns
opens the device on first use (after the byte-order self-test of :mod:`rings.rdma.selftest`).
It registers the region's existing ``bytearray`` in place: pyverbs 44's
``MR(pd, length, access, address=...)`` registers caller memory and does not free it on
close. The address comes from a ctypes view, which also pins the bytearray against resizing
while it is registered, so ``rings.verbs.Region`` needs no change. Two memory regions cover
it: ``rkey`` opens the whole region for RDMA READ, ``write_rkey`` only
``[WRITABLE_FROM, region_size)`` for WRITE and atomics, so the NIC itself refuses a write to
the immutable header. For each joining peer it creates one RC queue pair. Remote access on
that queue pair is READ only for ``inspect`` peers and READ|WRITE|ATOMIC for the others. It
moves the queue pair to RTS and sets ``peer.revoke_hook`` to move it to ERR and destroy it,
so a late verb of a revoked peer cannot land.

CPU and NIC atomics do not mix: a CAS by a peer's NIC can interleave with a read-compare-write
the host does under ``Region.lock``. Even ``IBV_ATOMIC_GLOB`` devices only promise atomicity
against CPU *atomic instructions*, which Python's bytearray updates are not. So once rdma
peers can reach a region, the host's verbs on it go through the NIC as well.
:meth:`RdmaJoin.loopback` returns an :class:`~rings.rdma.peer.RdmaVerbs` over a loopback
queue pair on the host's own device; ``RingHost.start`` installs it as ``RingHost.local``,
which the host uses for its own scans, repairs and counters and, since it has an rdma hook,
for the verbs of its tcp peers instead of ``Region.execute``. A device that fails the
self-test therefore stops the host from starting. ``RingHost.close`` closes the loopback and
calls :meth:`RdmaJoin.release`. ``RingHost.local`` becomes the loopback only in ``start``:
verbs taken from it before then still update the region from the CPU.

Fork caveat: registered memory is pinned. On Linux < 5.13 a process that registers the
region and then forks (fork + exec included) can lose the pinned pages to copy-on-write.
Use a recent kernel, or register only in processes that do not fork.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import secrets
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rings.errors import TransportUnavailable, VerbsError
from rings.layout import HOLDER_LOCAL, WRITABLE_FROM
from rings.rdma import _pyverbs
from rings.rdma._pyverbs import Pyverbs, close_quietly, device_names
from rings.rdma.device import Device, Endpoint
from rings.rdma.peer import RdmaVerbs
from rings.rdma.qp import QpPeer, Target, destroy_qp
from rings.rdma.selftest import check_atomics

if TYPE_CHECKING:
    from rings.host import PeerInfo, RingHost
    from rings.verbs import Region

log = logging.getLogger("diffring.rings.rdma")


@dataclass
class _Registered:
    """One region registered with the host's device, and the queue pairs that reach it."""

    export: Any  # ctypes view of the region's bytearray: pins it (no resize) while registered
    read_mr: Any
    write_mr: Any
    target: Target
    qps: dict[int, Any] = field(default_factory=dict)
    loopbacks: list[tuple[Any, RdmaVerbs]] = field(default_factory=list)


class RdmaJoin:
    """``RingHost.rdma_join`` hook: serves rdma JOINs of one or more rings' regions.

    Opens the device on first use. Thread-safe; the host calls it from its event loop.
    """

    def __init__(
        self,
        pv: Pyverbs,
        device_name: str | None = None,
        ib_port: int = 1,
        gid_index: int = 0,
        *,
        self_test: bool = True,
    ) -> None:
        self._pv = pv
        self._device_name = device_name
        self._ib_port = ib_port
        self._gid_index = gid_index
        self._self_test = self_test
        self._dev: Device | None = None
        self._cq: Any = None
        self._regions: dict[int, _Registered] = {}
        self._lock = threading.RLock()

    def _device(self) -> Device:
        if self._dev is None:
            dev = Device(self._pv, self._device_name, self._ib_port, self._gid_index)
            try:
                if self._self_test:
                    check_atomics(dev)
                # Responder-only queue pairs post nothing: this CQ never fills.
                self._cq = dev.create_cq(16)
            except BaseException:
                dev.close()
                raise
            self._dev = dev
        return self._dev

    def _register(self, region: Region) -> _Registered:
        reg = self._regions.get(id(region))
        if reg is not None:
            return reg
        dev = self._device()
        e = self._pv.enums
        buf = region.buf
        size = len(buf)
        export = (ctypes.c_char * size).from_buffer(buf)
        addr = ctypes.addressof(export)
        if addr % 8:  # atomics need 8-byte aligned remote addresses
            raise VerbsError(f"region buffer at {addr:#x} is not 8-byte aligned")
        read_mr = dev.register(size, e.IBV_ACCESS_REMOTE_READ, address=addr)
        try:
            write_mr = dev.register(
                size - WRITABLE_FROM,
                e.IBV_ACCESS_LOCAL_WRITE
                | e.IBV_ACCESS_REMOTE_READ
                | e.IBV_ACCESS_REMOTE_WRITE
                | e.IBV_ACCESS_REMOTE_ATOMIC,
                address=addr + WRITABLE_FROM,
            )
        except BaseException:
            close_quietly(read_mr)
            raise
        target = Target(addr, int(read_mr.rkey), int(write_mr.rkey), size)
        reg = self._regions[id(region)] = _Registered(export, read_mr, write_mr, target)
        return reg

    def _responder_qp(self, remote: QpPeer, mtu: int, read_only: bool) -> tuple[Any, int]:
        dev = self._device()
        e = self._pv.enums
        access = e.IBV_ACCESS_REMOTE_READ
        if not read_only:
            access |= e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_ATOMIC
        qp = dev.create_qp(self._cq, 1, access)
        psn = secrets.randbits(24)
        try:
            dev.connect_qp(
                qp,
                remote,
                local_psn=psn,
                mtu=mtu,
                max_rd_atomic=1,
                max_dest_rd_atomic=dev.max_dest_rd_atomic,
            )
        except BaseException:
            close_quietly(qp)
            raise
        return qp, psn

    def __call__(self, host: RingHost, peer: PeerInfo, join: dict[str, Any]) -> dict[str, Any]:
        """Create and connect the host's queue pair for ``peer``; the WELCOME extras."""
        try:
            with self._lock:
                return self._join(host.region, peer, join)
        except VerbsError:
            raise
        except Exception as exc:  # the host refuses VerbsErrors cleanly; anything else too
            raise VerbsError(f"rdma setup for peer {peer.name} failed on the host: {exc}") from exc

    def _join(self, region: Region, peer: PeerInfo, join: dict[str, Any]) -> dict[str, Any]:
        dev = self._device()
        reg = self._register(region)
        try:
            remote = QpPeer.parse(join, f"peer {peer.name}")
            mtu = min(int(join["mtu"]), dev.mtu)
            link = join["link_layer"]
        except (KeyError, TypeError, ValueError) as exc:
            raise VerbsError(f"malformed rdma join from peer {peer.name}: {exc}") from exc
        if link != dev.link_layer:
            raise VerbsError(
                f"peer {peer.name}'s RDMA port is on {link} but the host's {dev.where} is on "
                f"{dev.link_layer}; connect with transport 'tcp'"
            )
        qp, psn = self._responder_qp(remote, mtu, read_only=peer.role == "inspect")
        reg.qps[peer.peer_id] = qp
        peer.revoke_hook = functools.partial(self._revoke, id(region), peer.peer_id)
        peer.extra["rdma_qp_num"] = int(qp.qp_num)
        return {
            **dev.info(qp, psn),
            "mtu": mtu,
            "max_dest_rd_atomic": dev.max_dest_rd_atomic,
            "addr": reg.target.addr,
            "rkey": reg.target.rkey,
            "write_rkey": reg.target.write_rkey,
        }

    def _revoke(self, region_key: int, peer_id: int) -> None:
        with self._lock:
            reg = self._regions.get(region_key)
            qp = reg.qps.pop(peer_id, None) if reg is not None else None
            if qp is not None:
                destroy_qp(self._pv, qp)

    def loopback(self, host: RingHost, verb_timeout: float = 30.0) -> RdmaVerbs:
        """Verbs of the host on its own region through its NIC, atomic with the peers' verbs.

        ``RingHost.start`` installs them as ``host.local`` (see the module docstring);
        :meth:`release` closes them.
        """
        with self._lock:
            dev = self._device()
            reg = self._register(host.region)
            ep = Endpoint(dev)
            try:
                remote = QpPeer.parse(ep.info(), "loopback")
                qp, psn = self._responder_qp(remote, dev.mtu, read_only=False)
                try:
                    ep.connect(
                        QpPeer(int(qp.qp_num), dev.lid, dev.gid, psn),
                        mtu=dev.mtu,
                        max_rd_atomic=min(dev.max_rd_atomic, dev.max_dest_rd_atomic),
                    )
                except BaseException:
                    close_quietly(qp)
                    raise
            except BaseException:
                ep.close()
                raise
            verbs = RdmaVerbs(
                ep,
                reg.target,
                host.layout,
                HOLDER_LOCAL,
                read_only=False,
                where=f"loopback of ring {host.layout.name!r} on {dev.where}",
                sock=None,
                verb_timeout=verb_timeout,
                owns_device=False,
            )
            reg.loopbacks.append((qp, verbs))
            return verbs

    def release(self, region: Region) -> None:
        """Destroy every queue pair onto ``region`` and deregister it (host shutdown)."""
        self._teardown(id(region))

    def close(self) -> None:
        """Release every region, then the device."""
        with self._lock:
            for key in list(self._regions):
                self._teardown(key)
            close_quietly(self._cq)
            self._cq = None
            if self._dev is not None:
                self._dev.close()
                self._dev = None

    def _teardown(self, key: int) -> None:
        with self._lock:
            reg = self._regions.pop(key, None)
            if reg is None:
                return
            for qp in reg.qps.values():
                try:
                    destroy_qp(self._pv, qp)
                except VerbsError:
                    log.warning("rdma: destroying a peer queue pair failed", exc_info=True)
            reg.qps.clear()
            for qp, verbs in reg.loopbacks:
                verbs.close()
                close_quietly(qp)
            reg.loopbacks.clear()
            # Deregister before dropping the ctypes view that keeps the bytearray pinned.
            for mr in (reg.write_mr, reg.read_mr):
                close_quietly(mr)
            reg.export = None


def make_rdma_join(
    device_name: str | None = None,
    ib_port: int = 1,
    gid_index: int = 0,
    *,
    self_test: bool = True,
) -> RdmaJoin | None:
    """The host's rdma hook, or None when this machine has no pyverbs or no RDMA device.

    A named device that does not exist (while others do) is a configuration error and raises
    TransportUnavailable instead of silently serving tcp only.
    """
    try:
        # Through the module, not a name imported from it: tests substitute a fake pyverbs there.
        pv = _pyverbs.load_pyverbs()
        names = device_names(pv)
    except TransportUnavailable as exc:
        log.info("ring host: rdma joins disabled: %s", exc)
        return None
    if device_name is not None and device_name not in names:
        raise TransportUnavailable(
            f"RDMA device {device_name!r} not found; this machine has {', '.join(names)}"
        )
    return RdmaJoin(pv, device_name, ib_port, gid_index, self_test=self_test)
