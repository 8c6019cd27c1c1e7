"""The ``rdma`` verbs transport: a pyverbs RC queue pair onto the ring host's region.

Peer side (:func:`connect`). The peer opens its device (context, protection domain, one
completion queue, one RC queue pair, one small registered local buffer), then runs the
ordinary ring handshake (:func:`rings.tcp.handshake`) on the ring's port with
``transport="rdma"``. Its JOIN carries the queue-pair details, the WELCOME the host's:

    JOIN    + {qp_num, lid, gid, psn, mtu, link_layer}
    WELCOME + {qp_num, lid, gid, psn, mtu, max_dest_rd_atomic, link_layer,
               addr, rkey, write_rkey}          (region_size is in every WELCOME)

``addr`` is the virtual address of region offset 0 on the host. ``rkey`` covers the whole
region for RDMA READ; ``write_rkey`` covers only ``[WRITABLE_FROM, region_size)`` for WRITE
and atomics, so the NIC itself refuses a write to the immutable header. Both queue pairs then
go INIT -> RTR -> RTS. The TCP connection stays open and idle: it is the peer's liveness.
When it drops, the host revokes the peer; when the host revokes a peer it destroys the host
side of that queue pair, so a late verb of a revoked peer cannot land.

One batch = one chained list of work requests, posted with one ``ibv_post_send``:

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
* A batch that fails after posting (error completion, or no completion within
  ``verb_timeout``) raises :class:`~rings.errors.ConnectionLost` naming the verb and the
  work completion status. The queue pair is then in the error state, so the verbs object
  closes itself. As with a TCP connection that drops mid-batch, earlier verbs of that batch
  may have taken effect. Invalid verbs (out of range, misaligned atomic, a write from an
  ``inspect`` peer) are refused before anything is posted, with the same errors as tcp.

Byte order of atomics (assumed, then checked). The ring region is little-endian. We assume
the NIC executes 8-byte atomics on responder memory in host byte order and writes the old
value into the requester's buffer in host byte order. That is what mlx5 (ConnectX-4 and
later) does: the mlx5 core driver sets ``atomic_req_8B_endianness_mode`` to host endianness.
Older HCAs (mlx4) and the IB wire format use big-endian. So we do not trust the assumption:
before first use of a device, a loopback self-test runs ``fetch_and_add(+1)`` on a known
little-endian word and checks both the returned value and the memory. A device that fails
the test refuses with :class:`~rings.errors.TransportUnavailable` instead of corrupting
rings. A big-endian host is refused outright.

Host side (:func:`make_rdma_join`). Returns None when pyverbs or a device is missing, so the
host refuses rdma joins with its own message that names tcp. Otherwise it returns a
:class:`RdmaJoin`, the ``rdma_join`` hook of :class:`rings.host.RingHost`. On first use it
opens the device. It registers the region's existing ``bytearray`` in place: pyverbs 44's
``MR(pd, length, access, address=...)`` registers caller memory and does not free it on
close. The address comes from a ctypes view, which also pins the bytearray against resizing
while it is registered, so ``rings.verbs.Region`` needs no change. For each joining peer it
creates one RC queue pair. Remote access on that queue pair is READ only for ``inspect``
peers and READ|WRITE|ATOMIC for the others. It moves the queue pair to RTS and sets
``peer.revoke_hook`` to move it to ERR and destroy it.

CAVEAT: CPU and NIC atomics do not mix. The host's own verbs on the region (``RingHost.local``,
a Python lock around bytearray updates) and the verbs the host executes for tcp peers are
not atomic with respect to the NIC's atomics. A CAS by a peer's NIC can interleave with
the host's read-compare-write under its lock. Once rdma peers can reach a region, every
CPU-side verb on it must go through the NIC as well. :meth:`RdmaJoin.loopback` returns an
:class:`RdmaVerbs` that reaches the region over a loopback queue pair on the host's own
device. The host has to use it as ``RingHost.local``, and for the verbs it serves to tcp
peers, instead of ``Region.execute``. This wiring belongs to ``rings/host.py``. Even
``IBV_ATOMIC_GLOB`` devices only promise atomicity against CPU *atomic instructions*, which
Python's bytearray updates are not.

Fork caveat: registered memory is pinned. On Linux < 5.13 a process that registers the
region and then forks (fork + exec included) can lose the pinned pages to copy-on-write.
Use a recent kernel, or register only in processes that do not fork.

Not exercised on any machine of this project (none has an RDMA device): everything past
device discovery runs only against the fake pyverbs in ``tests/test_rdma.py``. The fake
checks the attribute masks of the state transitions, the access flags, the keys, the bounds
and the order. The attribute, work-request and address-handle classes are also built with
the real pyverbs 44 where it imports.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import importlib.util
import logging
import secrets
import socket
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rings.errors import (
    ConnectionLost,
    DiffringError,
    HandshakeError,
    TransportUnavailable,
    VerbRangeError,
    VerbsError,
)
from rings.layout import HOLDER_LOCAL, WRITABLE_FROM, RingLayout
from rings.tcp import handshake, open_socket
from rings.verbs import CAS, FAA, READ, U64, WRITE, Op, Verbs, check_op

if TYPE_CHECKING:
    from rings.host import PeerInfo, RingHost
    from rings.verbs import Region

log = logging.getLogger("diffring.rings.rdma")

TCP_HINT = (
    "set disagg_config.ring_transport to 'tcp' (or 'auto', which picks tcp where there is "
    "no RDMA device)"
)

# Where Debian/Ubuntu's python3-pyverbs lives. Only the ``pyverbs`` package is imported from
# there (by file location): putting the whole folder on sys.path would shadow this
# environment's own packages with the system's.
DEBIAN_PYVERBS_PARENTS: tuple[str, ...] = ("/usr/lib/python3/dist-packages",)
_PYVERBS_MODULES = ("device", "pd", "cq", "qp", "mr", "wr", "addr", "enums", "pyverbs_error")

MAX_BATCH_WR = 64
"""Send queue depth; a longer batch is posted as several chunks, in order."""
_LOCAL_BUF_MIN = 64 << 10
# Queue pair timing: 4.096 us * 2**14 = 67 ms per attempt, 7 retries: a host that is gone
# (or destroyed our queue pair) surfaces as IBV_WC_RETRY_EXC_ERR after about half a second.
_QP_TIMEOUT = 14
_QP_RETRY_CNT = 7
_QP_RNR_RETRY = 7
_MIN_RNR_TIMER = 12
_MAX_RD_ATOMIC = 16
_HOP_LIMIT = 64
# Busy-poll this many empty polls before sleeping between polls (a verb takes microseconds).
_SPIN_POLLS = 2000
_PROBE = 0x0102030405060708


# -- pyverbs, imported lazily --------------------------------------------------------------
@dataclass(frozen=True)
class _Pyverbs:
    """The pyverbs modules this transport uses (tests substitute a fake)."""

    device: Any
    pd: Any
    cq: Any
    qp: Any
    mr: Any
    wr: Any
    addr: Any
    enums: Any
    origin: str


_PV: _Pyverbs | None = None
_PV_LOCK = threading.Lock()
# (device, port) pairs whose atomics passed the byte-order self-test in this process.
_ATOMICS_CHECKED: set[tuple[str, int]] = set()


def _pyverbs_modules(origin: str) -> _Pyverbs:
    m = {name: importlib.import_module(f"pyverbs.{name}") for name in _PYVERBS_MODULES}
    return _Pyverbs(
        m["device"], m["pd"], m["cq"], m["qp"], m["mr"], m["wr"], m["addr"], m["enums"], origin
    )


def _forget_pyverbs() -> None:
    for name in [n for n in sys.modules if n == "pyverbs" or n.startswith("pyverbs.")]:
        del sys.modules[name]


def _import_pyverbs() -> _Pyverbs:
    reasons: list[str] = []
    try:
        return _pyverbs_modules("sys.path")
    except Exception as exc:  # ImportError, or a pyverbs built for another libibverbs
        reasons.append(f"import pyverbs: {exc}")
    for parent in DEBIAN_PYVERBS_PARENTS:
        pkg = Path(parent) / "pyverbs"
        init = pkg / "__init__.py"
        if not init.is_file():
            reasons.append(f"{pkg}: not installed")
            continue
        spec = importlib.util.spec_from_file_location(
            "pyverbs", init, submodule_search_locations=[str(pkg)]
        )
        if spec is None or spec.loader is None:
            continue
        saved = {n: m for n, m in sys.modules.items() if n == "pyverbs" or n.startswith("pyverbs.")}
        _forget_pyverbs()
        module = importlib.util.module_from_spec(spec)
        sys.modules["pyverbs"] = module
        try:
            spec.loader.exec_module(module)
            return _pyverbs_modules(str(pkg))
        except Exception as exc:  # e.g. built for another Python version
            _forget_pyverbs()
            sys.modules.update(saved)
            reasons.append(f"{pkg}: {exc}")
    raise TransportUnavailable(
        "the rdma ring transport needs pyverbs, which cannot be imported here ("
        + "; ".join(reasons)
        + "); install rdma-core's Python bindings for this Python (Debian/Ubuntu: apt-get "
        "install python3-pyverbs) or " + TCP_HINT
    )


def _load_pyverbs() -> _Pyverbs:
    """pyverbs (imported once); raises TransportUnavailable saying why it cannot be used."""
    global _PV
    with _PV_LOCK:
        if _PV is None:
            _PV = _import_pyverbs()
        return _PV


def _device_names(pv: _Pyverbs) -> list[str]:
    try:
        devices = pv.device.get_device_list()
    except Exception as exc:  # PyverbsRDMAError "Failed to get devices list": no device/driver
        raise TransportUnavailable(
            f"no RDMA device on this machine (pyverbs: {exc}); {TCP_HINT}"
        ) from exc
    names = [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices]
    if not names:
        raise TransportUnavailable(f"no RDMA device on this machine; {TCP_HINT}")
    return names


def rdma_available() -> bool:
    """True when pyverbs imports and lists at least one RDMA device. Never raises."""
    try:
        return bool(_device_names(_load_pyverbs()))
    except Exception:
        return False


@contextlib.contextmanager
def _translated(what: str, error: type[VerbsError] = VerbsError) -> Iterator[None]:
    """Turn anything pyverbs raises inside the block into ``error`` saying what failed."""
    try:
        yield
    except DiffringError:
        raise
    except Exception as exc:  # PyverbsError and friends, or TypeError/OverflowError on values
        hint = ""
        text = str(exc)
        if "Cannot allocate memory" in text or "Errno: 12" in text:
            hint = " (is the locked-memory limit, ulimit -l, too low?)"
        raise error(f"rdma: {what} failed: {text or type(exc).__name__}{hint}") from exc


def _wc_status_name(pv: _Pyverbs, status: int) -> str:
    for name in dir(pv.enums):
        if (
            name.startswith("IBV_WC_")
            and (name.endswith("_ERR") or name == "IBV_WC_SUCCESS")
            and getattr(pv.enums, name) == status
        ):
            return name
    return f"status {status}"


def _wc_status_text(pv: _Pyverbs, status: int) -> str:
    to_str = getattr(pv.cq, "cqe_status_to_str", None)
    if to_str is not None:
        with contextlib.suppress(Exception):
            return f"{_wc_status_name(pv, status)}: {to_str(status)}"
    return _wc_status_name(pv, status)


_VERB_NAMES = {READ: "read", WRITE: "write", CAS: "compare_and_swap", FAA: "fetch_and_add"}
_STATUS_HINTS = {
    "IBV_WC_RETRY_EXC_ERR": "the ring host did not answer: it revoked this peer (destroying "
    "its queue pair) or it is unreachable",
    "IBV_WC_REM_ACCESS_ERR": "the ring host refused access: this peer was revoked, joined "
    "read-only, or touched the read-only header",
    "IBV_WC_REM_INV_REQ_ERR": "the ring host rejected the request as invalid",
    "IBV_WC_WR_FLUSH_ERR": "the queue pair was already in the error state",
}


# -- queue pair plumbing ---------------------------------------------------------------------
@dataclass(frozen=True)
class _QpPeer:
    """The other end of a queue pair, as exchanged at handshake."""

    qp_num: int
    lid: int
    gid: str
    psn: int

    @classmethod
    def parse(cls, d: dict[str, Any], who: str) -> _QpPeer:
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
class _Target:
    """Where a region lives in the host's memory, and the keys that open it."""

    addr: int
    rkey: int
    """Whole region, REMOTE_READ."""
    write_rkey: int
    """``[WRITABLE_FROM, size)``, REMOTE_WRITE | REMOTE_ATOMIC."""
    size: int


def _qp_init_attr(pv: _Pyverbs, cq: Any, max_send_wr: int) -> Any:
    e = pv.enums
    cap = pv.qp.QPCap(max_send_wr=max_send_wr, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
    # sq_sig_all=0: whether a work request completes visibly is its own IBV_SEND_SIGNALED.
    return pv.qp.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=0)


def _init_attr(pv: _Pyverbs, port: int, access: int) -> tuple[Any, int]:
    e = pv.enums
    attr = pv.qp.QPAttr()
    attr.qp_state = e.IBV_QPS_INIT
    attr.pkey_index = 0
    attr.port_num = port
    attr.qp_access_flags = access
    mask = e.IBV_QP_STATE | e.IBV_QP_PKEY_INDEX | e.IBV_QP_PORT | e.IBV_QP_ACCESS_FLAGS
    return attr, mask


def _rtr_attr(
    pv: _Pyverbs,
    remote: _QpPeer,
    *,
    port: int,
    gid_index: int,
    use_grh: bool,
    mtu: int,
    max_dest_rd_atomic: int,
) -> tuple[Any, int]:
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


def _rts_attr(pv: _Pyverbs, *, local_psn: int, max_rd_atomic: int) -> tuple[Any, int]:
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


def _build_wr(
    pv: _Pyverbs,
    wr_id: int,
    op: Op,
    local_addr: int,
    nbytes: int,
    lkey: int,
    target: _Target,
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


class _Device:
    """One port of one opened RDMA device: context, protection domain and port facts."""

    def __init__(self, pv: _Pyverbs, device_name: str | None, ib_port: int, gid_index: int):
        names = _device_names(pv)
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
        with _translated(f"opening RDMA device {name}", TransportUnavailable):
            self.ctx = pv.device.Context(name=name)
        try:
            with _translated(f"querying {self.where}", TransportUnavailable):
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
            with _translated(f"allocating a protection domain on {name}", TransportUnavailable):
                self.pd = pv.pd.PD(self.ctx)
        except BaseException:
            self.close()
            raise

    def create_cq(self, depth: int) -> Any:
        with _translated(f"creating a completion queue on {self.name}", TransportUnavailable):
            return self.pv.cq.CQ(self.ctx, depth, None, None, 0)

    def create_qp(self, cq: Any, max_send_wr: int, access: int) -> Any:
        """An RC queue pair in INIT accepting ``access`` (IBV_ACCESS_REMOTE_*) from its peer."""
        pv = self.pv
        with _translated(f"creating a queue pair on {self.where}", TransportUnavailable):
            qp = pv.qp.QP(self.pd, _qp_init_attr(pv, cq, max_send_wr))
        try:
            with _translated(f"moving a queue pair on {self.where} to INIT"):
                qp.modify(*_init_attr(pv, self.port, access))
        except BaseException:
            _close_quietly(qp)
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
        remote: _QpPeer,
        *,
        local_psn: int,
        mtu: int,
        max_rd_atomic: int,
        max_dest_rd_atomic: int,
    ) -> None:
        """INIT -> RTR -> RTS towards ``remote``."""
        pv = self.pv
        use_grh = self.ethernet or remote.lid == 0
        with _translated(f"connecting queue pair {qp.qp_num} on {self.where} (RTR)"):
            qp.modify(
                *_rtr_attr(
                    pv,
                    remote,
                    port=self.port,
                    gid_index=self.gid_index,
                    use_grh=use_grh,
                    mtu=mtu,
                    max_dest_rd_atomic=max_dest_rd_atomic,
                )
            )
        with _translated(f"connecting queue pair {qp.qp_num} on {self.where} (RTS)"):
            qp.modify(*_rts_attr(pv, local_psn=local_psn, max_rd_atomic=max_rd_atomic))

    def register(self, length: int, access: int, address: int | None = None) -> Any:
        """Register ``length`` bytes at ``address`` (or a fresh pyverbs-owned buffer)."""
        what = f"registering {length} bytes of memory on {self.name}"
        with _translated(what):
            if address is None:
                return self.pv.mr.MR(self.pd, length, access)
            return self.pv.mr.MR(self.pd, length, access, address=address)

    def close(self) -> None:
        for obj in (self.pd, self.ctx):
            _close_quietly(obj)
        self.pd = self.ctx = None


def _close_quietly(obj: Any) -> None:
    if obj is not None:
        try:
            obj.close()
        except Exception:  # closing on an error path: report, do not mask the cause
            log.warning("rdma: closing %s failed", type(obj).__name__, exc_info=True)


def _destroy_qp(pv: _Pyverbs, qp: Any) -> None:
    """ERR first (the NIC stops executing requests for it at once), then destroy."""
    attr = pv.qp.QPAttr()
    attr.qp_state = pv.enums.IBV_QPS_ERR
    try:
        with _translated(f"moving queue pair {qp.qp_num} to ERR"):
            qp.modify(attr, pv.enums.IBV_QP_STATE)
    finally:
        with _translated(f"destroying queue pair {qp.qp_num}"):
            qp.close()


class _Endpoint:
    """The requesting side: a CQ, an RC queue pair, and a registered local buffer."""

    def __init__(self, dev: _Device) -> None:
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

    def connect(self, remote: _QpPeer, *, mtu: int, max_rd_atomic: int) -> None:
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
        _close_quietly(old)

    def execute(self, ops: Sequence[Op], target: _Target, deadline: float, where: str) -> list[Any]:
        """Run already-validated ops in order; ConnectionLost when the fabric fails them."""
        out: list[Any] = []
        for start in range(0, len(ops), MAX_BATCH_WR):
            out.extend(self._chunk(ops[start : start + MAX_BATCH_WR], target, deadline, where))
        return out

    def _chunk(self, ops: Sequence[Op], target: _Target, deadline: float, where: str) -> list[Any]:
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
        with _translated(f"building work requests for {where}"):
            for i, (op, (off, n)) in enumerate(zip(ops, places, strict=True)):
                if n == 0:  # a zero-length READ/WRITE has no effect: nothing to post
                    continue
                if op[0] == WRITE:
                    mr.write(bytes(op[2]), n, off)
                wr = _build_wr(pv, i, op, base + off, n, mr.lkey, target, ordered)
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
                    name = _wc_status_name(pv, wc.status)
                    hint = _STATUS_HINTS.get(name)
                    raise ConnectionLost(
                        f"rdma {_VERB_NAMES[op[0]]} at offset {op[1]} on ring host {where} "
                        f"failed: {_wc_status_text(pv, wc.status)} (vendor error "
                        f"{getattr(wc, 'vendor_err', 0):#x})" + (f"; {hint}" if hint else ""),
                        offset=op[1],
                    )

    def close(self) -> None:
        for obj in (self.qp, self.mr, self.cq):
            _close_quietly(obj)
        self.qp = self.mr = self.cq = None


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
        endpoint: _Endpoint,
        target: _Target,
        layout: RingLayout,
        peer_id: int,
        *,
        read_only: bool,
        where: str,
        sock: socket.socket | None,
        verb_timeout: float,
        owns_device: bool,
    ) -> None:
        self._ep: _Endpoint | None = endpoint
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
                    f"{_VERB_NAMES[code]} of {n} bytes exceeds the port's largest RDMA message "
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


def _check_atomics(dev: _Device, timeout: float = 5.0) -> None:
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
    ep: _Endpoint | None = None
    cq = qp = scratch = None
    try:
        ep = _Endpoint(dev)
        cq = dev.create_cq(4)
        qp = dev.create_qp(cq, 1, access)
        scratch = dev.register(16, access)
        psn = secrets.randbits(24)
        dev.connect_qp(
            qp,
            _QpPeer.parse(ep.info(), "self-test"),
            local_psn=psn,
            mtu=dev.mtu,
            max_rd_atomic=1,
            max_dest_rd_atomic=dev.max_dest_rd_atomic,
        )
        ep.connect(_QpPeer(int(qp.qp_num), dev.lid, dev.gid, psn), mtu=dev.mtu, max_rd_atomic=1)
        with _translated("writing the self-test word"):
            scratch.write(_PROBE.to_bytes(8, "little"), 8, 0)
        target = _Target(int(scratch.buf), scratch.rkey, scratch.rkey, 16)
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
            _close_quietly(obj)
        if ep is not None:
            ep.close()
    if old != _PROBE or after != (_PROBE + 1).to_bytes(8, "little"):
        raise TransportUnavailable(
            f"{dev.where} does not run RDMA atomics in little-endian byte order: "
            f"fetch_and_add(+1) on {_PROBE:#018x} returned {old:#018x} and left "
            f"{after.hex()} in memory; ring regions are little-endian; {TCP_HINT}"
        )
    _ATOMICS_CHECKED.add(key)


# -- peer side -------------------------------------------------------------------------------
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
    **_: Any,
) -> RdmaVerbs:
    """Connect to ring ``ring`` at host:port with a queue pair onto its region.

    Raises TransportUnavailable (naming the tcp alternative) when pyverbs or a usable device
    is missing, HandshakeError when the host refuses, ConnectionLost when it is unreachable.
    """
    pv = _load_pyverbs()
    dev = _Device(pv, device_name, ib_port, gid_index)
    where = f"{host}:{port}"
    ep: _Endpoint | None = None
    sock: socket.socket | None = None
    try:
        if self_test:
            _check_atomics(dev)
        ep = _Endpoint(dev)
        sock = open_socket(host, port, timeout)
        try:
            welcome = handshake(
                sock,
                ring=ring,
                layout=layout,
                token=token,
                transport="rdma",
                role=role,
                peer_name=peer_name,
                extras=ep.info(),
            )
        except OSError as exc:
            raise HandshakeError(f"handshake with {where} failed: {exc}") from exc
        try:
            agreed = RingLayout(**welcome["layout"])
            remote = _QpPeer.parse(welcome, f"ring host {where}")
            target = _Target(
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


# -- host side -------------------------------------------------------------------------------
@dataclass
class _Registered:
    """One region registered with the host's device, and the queue pairs that reach it."""

    export: Any  # ctypes view of the region's bytearray: pins it (no resize) while registered
    read_mr: Any
    write_mr: Any
    target: _Target
    qps: dict[int, Any] = field(default_factory=dict)
    loopbacks: list[tuple[Any, RdmaVerbs]] = field(default_factory=list)


class RdmaJoin:
    """``RingHost.rdma_join`` hook: serves rdma JOINs of one or more rings' regions.

    Opens the device on first use. Thread-safe; the host calls it from its event loop.
    """

    def __init__(
        self,
        pv: _Pyverbs,
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
        self._dev: _Device | None = None
        self._cq: Any = None
        self._regions: dict[int, _Registered] = {}
        self._lock = threading.RLock()

    def _device(self) -> _Device:
        if self._dev is None:
            dev = _Device(self._pv, self._device_name, self._ib_port, self._gid_index)
            try:
                if self._self_test:
                    _check_atomics(dev)
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
            _close_quietly(read_mr)
            raise
        target = _Target(addr, int(read_mr.rkey), int(write_mr.rkey), size)
        reg = self._regions[id(region)] = _Registered(export, read_mr, write_mr, target)
        return reg

    def _responder_qp(self, remote: _QpPeer, mtu: int, read_only: bool) -> tuple[Any, int]:
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
            _close_quietly(qp)
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
            remote = _QpPeer.parse(join, f"peer {peer.name}")
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
                _destroy_qp(self._pv, qp)

    def loopback(self, host: RingHost, verb_timeout: float = 30.0) -> RdmaVerbs:
        """Verbs of the host on its own region through its NIC, atomic with the peers' verbs.

        Use it as ``host.local`` (and for the verbs served to tcp peers) once rdma peers can
        reach the region: see the module docstring.
        """
        with self._lock:
            dev = self._device()
            reg = self._register(host.region)
            ep = _Endpoint(dev)
            try:
                remote = _QpPeer.parse(ep.info(), "loopback")
                qp, psn = self._responder_qp(remote, dev.mtu, read_only=False)
                try:
                    ep.connect(
                        _QpPeer(int(qp.qp_num), dev.lid, dev.gid, psn),
                        mtu=dev.mtu,
                        max_rd_atomic=min(dev.max_rd_atomic, dev.max_dest_rd_atomic),
                    )
                except BaseException:
                    _close_quietly(qp)
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
            _close_quietly(self._cq)
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
                    _destroy_qp(self._pv, qp)
                except VerbsError:
                    log.warning("rdma: destroying a peer queue pair failed", exc_info=True)
            reg.qps.clear()
            for qp, verbs in reg.loopbacks:
                verbs.close()
                _close_quietly(qp)
            reg.loopbacks.clear()
            # Deregister before dropping the ctypes view that keeps the bytearray pinned.
            for mr in (reg.write_mr, reg.read_mr):
                _close_quietly(mr)
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
        pv = _load_pyverbs()
        names = _device_names(pv)
    except TransportUnavailable as exc:
        log.info("ring host: rdma joins disabled: %s", exc)
        return None
    if device_name is not None and device_name not in names:
        raise TransportUnavailable(
            f"RDMA device {device_name!r} not found; this machine has {', '.join(names)}"
        )
    return RdmaJoin(pv, device_name, ib_port, gid_index, self_test=self_test)
