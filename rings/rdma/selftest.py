"""The byte-order self-test a device passes before it touches a ring (:func:`check_atomics`).

The ring region is little-endian. We assume the NIC executes 8-byte atomics on responder
memory in host byte order and writes the old value into the requester's buffer in host byte
order. That is what mlx5 (ConnectX-4 and later) does: the mlx5 core driver sets
``atomic_req_8B_endianness_mode`` to host endianness. Older HCAs (mlx4) and the IB wire
format use big-endian. So we do not trust the assumption: before first use of a device, a
loopback self-test runs ``fetch_and_add(+1)`` on a known little-endian word and checks both
the returned value and the memory. A device that fails the test refuses with
:class:`~rings.errors.TransportUnavailable` instead of corrupting rings. A big-endian host
is refused outright.
"""

from __future__ import annotations

import secrets
import sys
import time

from rings.errors import TransportUnavailable, VerbsError
from rings.rdma._pyverbs import TCP_HINT, close_quietly, translated
from rings.rdma.device import Device, Endpoint
from rings.rdma.qp import QpPeer, Target
from rings.verbs import FAA, READ

_PROBE = 0x0102030405060708
# (device, port) pairs whose atomics passed the byte-order self-test in this process.
_ATOMICS_CHECKED: set[tuple[str, int]] = set()


def check_atomics(dev: Device, timeout: float = 5.0) -> None:
    """Loopback self-test: does this device do 8-byte atomics in little-endian order?"""
    key = (dev.name, dev.port)
    if key in _ATOMICS_CHECKED:
        return
    if sys.byteorder != "little":
        raise TransportUnavailable(
            f"this host is {sys.byteorder}-endian; ring regions are little-endian and RDMA "
            f"atomics run in host byte order; {TCP_HINT}"
        )
    e = dev.pv.enums
    access = (
        e.IBV_ACCESS_LOCAL_WRITE
        | e.IBV_ACCESS_REMOTE_READ
        | e.IBV_ACCESS_REMOTE_WRITE
        | e.IBV_ACCESS_REMOTE_ATOMIC
    )
    ep: Endpoint | None = None
    cq = qp = scratch = None
    try:
        ep = Endpoint(dev)
        cq = dev.create_cq(4)
        qp = dev.create_qp(cq, 1, access)
        scratch = dev.register(16, access)
        psn = secrets.randbits(24)
        dev.connect_qp(
            qp,
            QpPeer.parse(ep.info(), "self-test"),
            local_psn=psn,
            mtu=dev.mtu,
            max_rd_atomic=1,
            max_dest_rd_atomic=dev.max_dest_rd_atomic,
        )
        ep.connect(QpPeer(int(qp.qp_num), dev.lid, dev.gid, psn), mtu=dev.mtu, max_rd_atomic=1)
        with translated("writing the self-test word"):
            scratch.write(_PROBE.to_bytes(8, "little"), 8, 0)
        target = Target(int(scratch.buf), scratch.rkey, scratch.rkey, 16)
        old, after = ep.execute(
            [(FAA, 0, 1), (READ, 0, 8)],
            target,
            time.monotonic() + timeout,
            f"{dev.where} (loopback self-test)",
        )
    except VerbsError as exc:
        raise TransportUnavailable(
            f"RDMA loopback self-test on {dev.where} failed: {exc}; {TCP_HINT}"
        ) from exc
    finally:
        for obj in (qp, scratch, cq):
            close_quietly(obj)
        if ep is not None:
            ep.close()
    if old != _PROBE or after != (_PROBE + 1).to_bytes(8, "little"):
        raise TransportUnavailable(
            f"{dev.where} does not run RDMA atomics in little-endian byte order: "
            f"fetch_and_add(+1) on {_PROBE:#018x} returned {old:#018x} and left "
            f"{after.hex()} in memory; ring regions are little-endian; {TCP_HINT}"
        )
    _ATOMICS_CHECKED.add(key)

