"""What this transport says to pyverbs about a queue pair: attributes, work requests, results.

Pure builders, no resources: the attributes and masks of each RC state transition
(RESET -> INIT -> RTR -> RTS, and -> ERR on revoke), one work request per verb, and the
names of work completion statuses. :mod:`rings.rdma.device` applies them to real queue pairs.

The masks are the ones ``ibv_modify_qp`` requires of an RC queue pair for each transition;
the fake NIC in ``tests/integration/test_rdma.py`` refuses a transition missing any of them,
and the same builders also run against the real pyverbs 44 classes where pyverbs imports.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from rings.rdma._pyverbs import Pyverbs, translated
from rings.verbs import CAS, FAA, READ, U64, WRITE, Op

# Queue pair timing: 4.096 us * 2**14 = 67 ms per attempt, 7 retries: a host that is gone
# (or destroyed our queue pair) surfaces as IBV_WC_RETRY_EXC_ERR after about half a second.
_QP_TIMEOUT = 14
_QP_RETRY_CNT = 7
_QP_RNR_RETRY = 7
_MIN_RNR_TIMER = 12
_HOP_LIMIT = 64


@dataclass(frozen=True)
class QpPeer:
    """The other end of a queue pair, as exchanged at handshake."""

    qp_num: int
    lid: int
    gid: str
    psn: int

    @classmethod
    def parse(cls, d: dict[str, Any], who: str) -> QpPeer:
        qp_num, lid, gid, psn = d["qp_num"], d["lid"], d["gid"], d["psn"]
        if not isinstance(qp_num, int) or not 0 < qp_num < 1 << 24:
            raise ValueError(f"{who} sent qp_num {qp_num!r}, not a queue pair number")
        if not isinstance(lid, int) or not 0 <= lid < 1 << 16:
            raise ValueError(f"{who} sent lid {lid!r}, not a 16-bit LID")
        if not isinstance(gid, str) or len(gid) != 39:
            raise ValueError(f"{who} sent gid {gid!r}, not a GID")
        if not isinstance(psn, int) or not 0 <= psn < 1 << 24:
            raise ValueError(f"{who} sent psn {psn!r}, not a 24-bit packet sequence number")
        return cls(qp_num, lid, gid, psn)


@dataclass(frozen=True)
class Target:
    """Where a region lives in the host's memory, and the keys that open it."""

    addr: int
    rkey: int
    """Whole region, REMOTE_READ."""
    write_rkey: int
    """``[WRITABLE_FROM, size)``, REMOTE_WRITE | REMOTE_ATOMIC."""
    size: int


def qp_init_attr(pv: Pyverbs, cq: Any, max_send_wr: int) -> Any:
    e = pv.enums
    cap = pv.qp.QPCap(max_send_wr=max_send_wr, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
    # sq_sig_all=0: whether a work request completes visibly is its own IBV_SEND_SIGNALED.
    return pv.qp.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=0)


def init_attr(pv: Pyverbs, port: int, access: int) -> tuple[Any, int]:
    """RESET -> INIT, accepting ``access`` (IBV_ACCESS_REMOTE_*) from the other end."""
    e = pv.enums
    attr = pv.qp.QPAttr()
    attr.qp_state = e.IBV_QPS_INIT
    attr.pkey_index = 0
    attr.port_num = port
    attr.qp_access_flags = access
    mask = e.IBV_QP_STATE | e.IBV_QP_PKEY_INDEX | e.IBV_QP_PORT | e.IBV_QP_ACCESS_FLAGS
    return attr, mask


def rtr_attr(
    pv: Pyverbs,
    remote: QpPeer,
    *,
    port: int,
    gid_index: int,
    use_grh: bool,
    mtu: int,
    max_dest_rd_atomic: int,
) -> tuple[Any, int]:
    """INIT -> RTR (ready to receive) towards ``remote``."""
    e = pv.enums
    if use_grh:  # RoCE (or a LID-less fabric): route by GID
        gr = pv.addr.GlobalRoute(
            dgid=pv.addr.GID(remote.gid), sgid_index=gid_index, hop_limit=_HOP_LIMIT
        )
        ah = pv.addr.AHAttr(dlid=remote.lid, is_global=1, port_num=port, gr=gr)
    else:
        ah = pv.addr.AHAttr(dlid=remote.lid, is_global=0, port_num=port)
    attr = pv.qp.QPAttr()
    attr.qp_state = e.IBV_QPS_RTR
    attr.path_mtu = mtu
    attr.dest_qp_num = remote.qp_num
    attr.rq_psn = remote.psn
    attr.max_dest_rd_atomic = max_dest_rd_atomic
    attr.min_rnr_timer = _MIN_RNR_TIMER
    attr.ah_attr = ah
    mask = (
        e.IBV_QP_STATE
        | e.IBV_QP_AV
        | e.IBV_QP_PATH_MTU
        | e.IBV_QP_DEST_QPN
        | e.IBV_QP_RQ_PSN
        | e.IBV_QP_MAX_DEST_RD_ATOMIC
        | e.IBV_QP_MIN_RNR_TIMER
    )
    return attr, mask


def rts_attr(pv: Pyverbs, *, local_psn: int, max_rd_atomic: int) -> tuple[Any, int]:
    """RTR -> RTS (ready to send)."""
    e = pv.enums
    attr = pv.qp.QPAttr()
    attr.qp_state = e.IBV_QPS_RTS
    attr.timeout = _QP_TIMEOUT
    attr.retry_cnt = _QP_RETRY_CNT
    attr.rnr_retry = _QP_RNR_RETRY
    attr.sq_psn = local_psn
    attr.max_rd_atomic = max_rd_atomic
    mask = (
        e.IBV_QP_STATE
        | e.IBV_QP_TIMEOUT
        | e.IBV_QP_RETRY_CNT
        | e.IBV_QP_RNR_RETRY
        | e.IBV_QP_SQ_PSN
        | e.IBV_QP_MAX_QP_RD_ATOMIC
    )
    return attr, mask


def destroy_qp(pv: Pyverbs, qp: Any) -> None:
    """ERR first (the NIC stops executing requests for it at once), then destroy."""
    attr = pv.qp.QPAttr()
    attr.qp_state = pv.enums.IBV_QPS_ERR
    try:
        with translated(f"moving queue pair {qp.qp_num} to ERR"):
            qp.modify(attr, pv.enums.IBV_QP_STATE)
    finally:
        with translated(f"destroying queue pair {qp.qp_num}"):
            qp.close()


def build_wr(
    pv: Pyverbs,
    wr_id: int,
    op: Op,
    local_addr: int,
    nbytes: int,
    lkey: int,
    target: Target,
    fenced: bool,
) -> Any:
    """One signaled work request for ``op``; its local buffer is ``local_addr``."""
    e = pv.enums
    code = op[0]
    flags = e.IBV_SEND_SIGNALED | (e.IBV_SEND_FENCE if fenced else 0)
    opcode = {
        READ: e.IBV_WR_RDMA_READ,
        WRITE: e.IBV_WR_RDMA_WRITE,
        CAS: e.IBV_WR_ATOMIC_CMP_AND_SWP,
        FAA: e.IBV_WR_ATOMIC_FETCH_AND_ADD,
    }[code]
    sge = pv.wr.SGE(local_addr, nbytes, lkey)
    wr = pv.wr.SendWR(wr_id=wr_id, opcode=opcode, num_sge=1, sg=[sge], send_flags=flags)
    remote = target.addr + op[1]
    if code == READ:
        wr.set_wr_rdma(target.rkey, remote)
    elif code == WRITE:
        wr.set_wr_rdma(target.write_rkey, remote)
    elif code == CAS:
        wr.set_wr_atomic(target.write_rkey, remote, op[2] & U64, op[3] & U64)
    else:
        wr.set_wr_atomic(target.write_rkey, remote, op[2] & U64)
    return wr


# -- work completions ------------------------------------------------------------------------
VERB_NAMES = {READ: "read", WRITE: "write", CAS: "compare_and_swap", FAA: "fetch_and_add"}
STATUS_HINTS = {
    "IBV_WC_RETRY_EXC_ERR": "the ring host did not answer: it revoked this peer (destroying "
    "its queue pair) or it is unreachable",
    "IBV_WC_REM_ACCESS_ERR": "the ring host refused access: this peer was revoked, joined "
    "read-only, or touched the read-only header",
    "IBV_WC_REM_INV_REQ_ERR": "the ring host rejected the request as invalid",
    "IBV_WC_WR_FLUSH_ERR": "the queue pair was already in the error state",
}


def wc_status_name(pv: Pyverbs, status: int) -> str:
    for name in dir(pv.enums):
        if (
            name.startswith("IBV_WC_")
            and (name.endswith("_ERR") or name == "IBV_WC_SUCCESS")
            and getattr(pv.enums, name) == status
        ):
            return name
    return f"status {status}"


def wc_status_text(pv: Pyverbs, status: int) -> str:
    to_str = getattr(pv.cq, "cqe_status_to_str", None)
    if to_str is not None:
        with contextlib.suppress(Exception):
            return f"{wc_status_name(pv, status)}: {to_str(status)}"
    return wc_status_name(pv, status)
