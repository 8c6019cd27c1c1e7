"""An opened RDMA device port (:class:`Device`) and a requesting :class:`Endpoint` on it.

:class:`Device` holds the context, the protection domain and the port facts, creates
completion queues and RC queue pairs, moves queue pairs through their states (with the
builders of :mod:`rings.rdma.qp`) and registers memory. Any failure to open or query it is a
:class:`~rings.errors.TransportUnavailable` naming the tcp alternative.

:class:`Endpoint` is the requesting side of one connection: a completion queue, an RC queue
pair and a registered local buffer. It executes one batch of verbs as one chained list of
work requests, posted with one ``ibv_post_send``:

* Every work request is signaled. A completion per verb costs a few CQEs, and it buys exact
  accounting: the batch is done when all ``len(ops)`` completions are in, and an error
  completion's ``wr_id`` names the verb that failed (with only the last one signaled, a
  failure of an earlier verb shows up as a flushed last verb).
* The batch contract says verbs take effect in the order given. InfiniBand only orders a
  request after an earlier RDMA READ or atomic of the same queue pair when it carries
  ``IBV_SEND_FENCE`` (IBTA vol. 1, 10.8.3.3), so every work request that follows a READ or
  an atomic in the batch is fenced. This is conservative: a fenced request waits one network
  round trip for the earlier responses, so a claim of the ring (two or three atomics) costs
  two or three RDMA round trips, a few microseconds on a fabric, still far below one TCP
  round trip. WRITEs before the first READ/atomic are not fenced.
* Batches longer than the send queue (:data:`MAX_BATCH_WR`) are posted in order, one chunk
  after another.
* A batch that fails after posting (error completion, or no completion within the deadline)
  raises :class:`~rings.errors.ConnectionLost` naming the verb and the work completion
  status. The queue pair is then in the error state; :class:`rings.rdma.peer.RdmaVerbs`
  closes itself.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from typing import Any

from rings.errors import ConnectionLost, TransportUnavailable
from rings.rdma._pyverbs import TCP_HINT, Pyverbs, close_quietly, device_names, translated
from rings.rdma.qp import (
    STATUS_HINTS,
    VERB_NAMES,
    QpPeer,
    Target,
    build_wr,
    init_attr,
    qp_init_attr,
    rtr_attr,
    rts_attr,
    wc_status_name,
    wc_status_text,
)
from rings.verbs import READ, WRITE, Op

MAX_BATCH_WR = 64
"""Send queue depth; a longer batch is posted as several chunks, in order."""
_LOCAL_BUF_MIN = 64 << 10
_MAX_RD_ATOMIC = 16
# Busy-poll this many empty polls before sleeping between polls (a verb takes microseconds).
_SPIN_POLLS = 2000


class Device:
    """One port of one opened RDMA device: context, protection domain and port facts."""

    def __init__(self, pv: Pyverbs, device_name: str | None, ib_port: int, gid_index: int):
        names = device_names(pv)
        name = device_name or names[0]
        if name not in names:
            raise TransportUnavailable(
                f"RDMA device {name!r} not found; this machine has {', '.join(names)}: fix the "
                f"device name, or {TCP_HINT}"
            )
        self.pv = pv
        self.name = name
        self.port = ib_port
        self.gid_index = gid_index
        self.where = f"{name} port {ib_port}"
        self.ctx: Any = None
        self.pd: Any = None
        e = pv.enums
        with translated(f"opening RDMA device {name}", TransportUnavailable):
            self.ctx = pv.device.Context(name=name)
        try:
            with translated(f"querying {self.where}", TransportUnavailable):
                dev_attr = self.ctx.query_device()
                port_attr = self.ctx.query_port(ib_port)
                gid = self.ctx.query_gid(ib_port, gid_index)
            if port_attr.state != e.IBV_PORT_ACTIVE:
                raise TransportUnavailable(
                    f"{self.where} is not active (port state {port_attr.state}); check the "
                    f"link (ibstat), pick another device/port, or {TCP_HINT}"
                )
            if dev_attr.atomic_caps == e.IBV_ATOMIC_NONE:
                raise TransportUnavailable(
                    f"RDMA device {name} does not support atomics, which rings need; {TCP_HINT}"
                )
            self.ethernet = port_attr.link_layer == e.IBV_LINK_LAYER_ETHERNET
            self.link_layer = "ethernet" if self.ethernet else "infiniband"
            self.lid = int(port_attr.lid)
            self.mtu = int(port_attr.active_mtu)
            self.max_msg = int(port_attr.max_msg_sz)
            self.gid = str(gid.gid)
            if self.ethernet and not self.gid.replace(":", "").strip("0"):
                raise TransportUnavailable(
                    f"GID index {gid_index} of {self.where} is empty; RoCE needs a GID: list "
                    f"them (show_gids) and set gid_index, or {TCP_HINT}"
                )
            self.max_rd_atomic = max(1, min(_MAX_RD_ATOMIC, int(dev_attr.max_qp_init_rd_atom)))
            self.max_dest_rd_atomic = max(1, min(_MAX_RD_ATOMIC, int(dev_attr.max_qp_rd_atom)))
            with translated(f"allocating a protection domain on {name}", TransportUnavailable):
                self.pd = pv.pd.PD(self.ctx)
        except BaseException:
            self.close()
            raise

    def create_cq(self, depth: int) -> Any:
        with translated(f"creating a completion queue on {self.name}", TransportUnavailable):
            return self.pv.cq.CQ(self.ctx, depth, None, None, 0)

    def create_qp(self, cq: Any, max_send_wr: int, access: int) -> Any:
        """An RC queue pair in INIT accepting ``access`` (IBV_ACCESS_REMOTE_*) from its peer."""
        pv = self.pv
        with translated(f"creating a queue pair on {self.where}", TransportUnavailable):
            qp = pv.qp.QP(self.pd, qp_init_attr(pv, cq, max_send_wr))
        try:
            with translated(f"moving a queue pair on {self.where} to INIT"):
                qp.modify(*init_attr(pv, self.port, access))
        except BaseException:
            close_quietly(qp)
            raise
        return qp

    def info(self, qp: Any, psn: int) -> dict[str, Any]:
        """This end of ``qp``, as the other side needs it."""
        return {
            "qp_num": int(qp.qp_num),
            "lid": self.lid,
            "gid": self.gid,
            "psn": psn,
            "mtu": self.mtu,
            "link_layer": self.link_layer,
        }

    def connect_qp(
        self,
        qp: Any,
        remote: QpPeer,
        *,
        local_psn: int,
        mtu: int,
        max_rd_atomic: int,
        max_dest_rd_atomic: int,
    ) -> None:
        """INIT -> RTR -> RTS towards ``remote``."""
        pv = self.pv
        use_grh = self.ethernet or remote.lid == 0
        with translated(f"connecting queue pair {qp.qp_num} on {self.where} (RTR)"):
            qp.modify(
                *rtr_attr(
                    pv,
                    remote,
                    port=self.port,
                    gid_index=self.gid_index,
                    use_grh=use_grh,
                    mtu=mtu,
                    max_dest_rd_atomic=max_dest_rd_atomic,
                )
            )
        with translated(f"connecting queue pair {qp.qp_num} on {self.where} (RTS)"):
            qp.modify(*rts_attr(pv, local_psn=local_psn, max_rd_atomic=max_rd_atomic))

    def register(self, length: int, access: int, address: int | None = None) -> Any:
        """Register ``length`` bytes at ``address`` (or a fresh pyverbs-owned buffer)."""
        what = f"registering {length} bytes of memory on {self.name}"
        with translated(what):
            if address is None:
                return self.pv.mr.MR(self.pd, length, access)
            return self.pv.mr.MR(self.pd, length, access, address=address)

    def close(self) -> None:
        for obj in (self.pd, self.ctx):
            close_quietly(obj)
        self.pd = self.ctx = None


class Endpoint:
    """The requesting side: a CQ, an RC queue pair, and a registered local buffer."""

    def __init__(self, dev: Device) -> None:
        self.dev = dev
        self.psn = secrets.randbits(24)
        self.cq: Any = None
        self.qp: Any = None
        self.mr: Any = None
        self._mr_size = 0
        try:
            self.cq = dev.create_cq(2 * MAX_BATCH_WR)
            # Our queue pair accepts nothing remote: results land via its own local buffer.
            self.qp = dev.create_qp(self.cq, MAX_BATCH_WR, 0)
            self._ensure_buffer(_LOCAL_BUF_MIN)
        except BaseException:
            self.close()
            raise

    def info(self) -> dict[str, Any]:
        return self.dev.info(self.qp, self.psn)

    def connect(self, remote: QpPeer, *, mtu: int, max_rd_atomic: int) -> None:
        self.dev.connect_qp(
            self.qp,
            remote,
            local_psn=self.psn,
            mtu=mtu,
            max_rd_atomic=max_rd_atomic,
            max_dest_rd_atomic=1,
        )

    def _ensure_buffer(self, nbytes: int) -> None:
        if nbytes <= self._mr_size:
            return
        size = max(_LOCAL_BUF_MIN, 1 << (nbytes - 1).bit_length())
        mr = self.dev.register(size, self.dev.pv.enums.IBV_ACCESS_LOCAL_WRITE)
        old, self.mr, self._mr_size = self.mr, mr, size
        close_quietly(old)

    def execute(self, ops: Sequence[Op], target: Target, deadline: float, where: str) -> list[Any]:
        """Run already-validated ops in order; ConnectionLost when the fabric fails them."""
        out: list[Any] = []
        for start in range(0, len(ops), MAX_BATCH_WR):
            out.extend(self._chunk(ops[start : start + MAX_BATCH_WR], target, deadline, where))
        return out

    def _chunk(self, ops: Sequence[Op], target: Target, deadline: float, where: str) -> list[Any]:
        pv = self.dev.pv
        places: list[tuple[int, int]] = []
        pos = 0
        for op in ops:
            code = op[0]
            n = op[2] if code == READ else len(op[2]) if code == WRITE else 8
            pos = (pos + 7) & ~7  # atomics write their old value to an 8-byte aligned place
            places.append((pos, n))
            pos += n
        self._ensure_buffer(pos)
        mr = self.mr
        base = int(mr.buf)
        wrs: list[Any] = []  # a chain holds raw pointers into these: keep them alive
        ordered = False
        with translated(f"building work requests for {where}"):
            for i, (op, (off, n)) in enumerate(zip(ops, places, strict=True)):
                if n == 0:  # a zero-length READ/WRITE has no effect: nothing to post
                    continue
                if op[0] == WRITE:
                    mr.write(bytes(op[2]), n, off)
                wr = build_wr(pv, i, op, base + off, n, mr.lkey, target, ordered)
                ordered = ordered or op[0] != WRITE
                if wrs:
                    wrs[-1].next_wr = wr
                wrs.append(wr)
        if wrs:
            try:
                self.qp.post_send(wrs[0])
            except Exception as exc:
                raise ConnectionLost(
                    f"posting {len(wrs)} rdma verbs to ring host {where} failed: {exc}"
                ) from exc
            self._wait(len(wrs), ops, deadline, where)
        out: list[Any] = []
        for op, (off, n) in zip(ops, places, strict=True):
            code = op[0]
            if code == READ:
                out.append(bytes(mr.read(n, off)) if n else b"")
            elif code == WRITE:
                out.append(None)
            else:  # host byte order, checked to be little-endian by the self-test
                out.append(int.from_bytes(mr.read(8, off), "little"))
        return out

    def _wait(self, expected: int, ops: Sequence[Op], deadline: float, where: str) -> None:
        pv = self.dev.pv
        success = pv.enums.IBV_WC_SUCCESS
        done = 0
        idle = 0
        while done < expected:
            try:
                n, wcs = self.cq.poll(min(expected - done, 16))
            except Exception as exc:
                raise ConnectionLost(f"polling completions from {where} failed: {exc}") from exc
            if not n:
                idle += 1
                if idle > _SPIN_POLLS:
                    if time.monotonic() > deadline:
                        raise ConnectionLost(
                            f"{expected - done} of {expected} rdma verbs to ring host {where} "
                            "did not complete in time"
                        )
                    time.sleep(20e-6)
                continue
            idle = 0
            for wc in wcs:
                done += 1
                if wc.status != success:
                    # Completions of one send queue arrive in posting order, so the first
                    # failed one is the cause; the rest would be flushed behind it.
                    op = ops[wc.wr_id]
                    name = wc_status_name(pv, wc.status)
                    hint = STATUS_HINTS.get(name)
                    raise ConnectionLost(
                        f"rdma {VERB_NAMES[op[0]]} at offset {op[1]} on ring host {where} "
                        f"failed: {wc_status_text(pv, wc.status)} (vendor error "
                        f"{getattr(wc, 'vendor_err', 0):#x})" + (f"; {hint}" if hint else ""),
                        offset=op[1],
                    )

    def close(self) -> None:
        for obj in (self.qp, self.mr, self.cq):
            close_quietly(obj)
        self.qp = self.mr = self.cq = None
