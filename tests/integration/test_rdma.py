"""The ``rdma`` transport: its refusals on this machine, and its logic over a fake pyverbs.

No machine of this project has an RDMA device, so there are three layers:

1. What runs here for real: no device -> clean refusals naming tcp, ``auto`` -> tcp, the host
   refuses rdma joins, ``make_rdma_join()`` is None.
2. ``rings.rdma`` over :class:`FakeFabric`, an in-process stand-in for pyverbs + NIC with the
   same call signatures. It executes work requests on real memory (the host's region
   bytearray, through the registered address), and enforces what a NIC would: queue-pair
   transitions with their required attribute masks, PSNs that match across the pair,
   access flags of queue pairs and memory regions, key/PD/bounds checks, atomic alignment,
   error + flush completions, and host byte order for atomics (switchable to big-endian).
3. Where Debian's pyverbs 44 imports, the attribute / work-request / address classes that
   ``rings.rdma`` builds are built with the real classes too (constructor keywords, setters).
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any, Literal

import pytest

from rings import rdma
from rings.errors import (
    ConfigError,
    ConnectionLost,
    HandshakeError,
    TransportUnavailable,
    VerbAlignmentError,
    VerbRangeError,
    VerbsError,
)
from rings.handshake import handshake, open_socket
from rings.host import RingHost
from rings.layout import OFF_TAIL, STAMPS_OFFSET, RingLayout, SlotState, stamp
from rings.rdma import _pyverbs, device, qp, selftest
from rings.ring import Ring
from rings.soak import start_ring_host, stop_process
from rings.tcp import TcpVerbs
from rings.tcp import connect as tcp_connect
from rings.transports import connect as transports_connect
from rings.verbs import CAS, FAA, RDMA_ONLY_OPTIONS, READ, WRITE, transport_options
from tests.support.controller import TOKEN

pytestmark = pytest.mark.integration  # starts processes or servers

RING = "rdmatest"
SLOTS = 3
SLOT_SIZE = 32768  # region ~96 KiB: a whole-region READ outgrows the 64 KiB local buffer


# ==========================================================================================
# 1. This machine: no RDMA device
# ==========================================================================================
NO_DEVICE = not rdma.rdma_available()
no_device_only = pytest.mark.skipif(not NO_DEVICE, reason="this machine has an RDMA device")


@pytest.fixture(scope="module")
def tcp_ring_host() -> Iterator[int]:
    proc, port = start_ring_host(SLOTS, 512, token=TOKEN, name=RING)
    try:
        yield port
    finally:
        stop_process(proc)


def test_rdma_available_is_a_bool_and_never_raises() -> None:
    assert rdma.rdma_available() in (True, False)


@no_device_only
def test_rdma_available_is_false_here() -> None:
    assert rdma.rdma_available() is False


@no_device_only
@pytest.mark.parametrize("via", ["rdma.connect", "transports.connect"])
def test_connect_refuses_without_device_and_names_tcp(via: str) -> None:
    layout = RingLayout(RING, SLOTS, 512)
    with pytest.raises(TransportUnavailable) as info:
        if via == "rdma.connect":
            rdma.connect("127.0.0.1", 1, layout=layout, ring=RING, token=TOKEN)
        else:
            transports_connect("rdma", "127.0.0.1", 1, layout=layout, ring=RING, token=TOKEN)
    msg = str(info.value)
    assert "ring_transport to 'tcp'" in msg
    assert "no RDMA device" in msg or "pyverbs" in msg


def test_missing_pyverbs_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_pyverbs, "_PV", None)
    monkeypatch.setattr(_pyverbs, "DEBIAN_PYVERBS_PARENTS", ("/nonexistent/dist-packages",))
    for name in ["pyverbs", *(f"pyverbs.{m}" for m in _pyverbs._PYVERBS_MODULES)]:
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules blocks an import
    with pytest.raises(TransportUnavailable) as info:
        rdma.connect("127.0.0.1", 1, layout=None, ring=RING, token=TOKEN)
    msg = str(info.value)
    assert "pyverbs" in msg and "python3-pyverbs" in msg and "'tcp'" in msg
    assert rdma.rdma_available() is False
    assert rdma.make_rdma_join() is None


@pytest.mark.parametrize("via", ["rdma.connect", "transports.connect"])
def test_misspelt_option_refused_before_looking_for_a_device(
    via: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_pyverbs() -> Any:
        raise AssertionError("looked for pyverbs before checking the options")

    monkeypatch.setattr(_pyverbs, "load_pyverbs", no_pyverbs)
    with pytest.raises(ConfigError) as info:
        if via == "rdma.connect":
            rdma.connect("127.0.0.1", 1, layout=None, ring=RING, token=TOKEN, gid_idx=1)
        else:
            transports_connect("rdma", "127.0.0.1", 1, layout=None, ring=RING, token=TOKEN,
                               gid_idx=1)
    msg = str(info.value)
    assert "unknown rdma transport option 'gid_idx'" in msg
    for name in transport_options(rdma.connect):
        assert name in msg


def test_tcp_ignores_exactly_the_options_only_rdma_takes() -> None:
    rdma_only = set(transport_options(rdma.connect)) - set(transport_options(tcp_connect))
    assert set(RDMA_ONLY_OPTIONS) == rdma_only


@no_device_only
def test_make_rdma_join_is_none_here() -> None:
    assert rdma.make_rdma_join() is None


@no_device_only
def test_auto_picks_tcp(tcp_ring_host: int) -> None:
    verbs = transports_connect(
        "auto",
        "127.0.0.1",
        tcp_ring_host,
        layout=RingLayout(RING, SLOTS, 512),
        ring=RING,
        token=TOKEN,
    )
    with verbs:
        assert isinstance(verbs, TcpVerbs)
        ring = Ring(verbs)
        ring.push({"id": 7, "data": b"auto"}, timeout=5)
        assert ring.pop(timeout=5) == {"id": 7, "data": b"auto"}


def test_host_without_device_refuses_rdma_join_naming_tcp(tcp_ring_host: int) -> None:
    sock = open_socket("127.0.0.1", tcp_ring_host, 5.0)
    try:
        with pytest.raises(HandshakeError) as info:
            handshake(
                sock,
                ring=RING,
                layout=RingLayout(RING, SLOTS, 512),
                token=TOKEN,
                transport="rdma",
                extras={"qp_num": 0x99, "lid": 1, "gid": "0" * 39, "psn": 1, "mtu": 3},
            )
    finally:
        sock.close()
    assert "'tcp'" in str(info.value)


# ==========================================================================================
# 2. A fake pyverbs + NIC
# ==========================================================================================
E = SimpleNamespace(
    IBV_QPT_RC=2,
    IBV_QPS_RESET=0,
    IBV_QPS_INIT=1,
    IBV_QPS_RTR=2,
    IBV_QPS_RTS=3,
    IBV_QPS_ERR=6,
    IBV_QP_STATE=1 << 0,
    IBV_QP_ACCESS_FLAGS=1 << 3,
    IBV_QP_PKEY_INDEX=1 << 4,
    IBV_QP_PORT=1 << 5,
    IBV_QP_AV=1 << 7,
    IBV_QP_PATH_MTU=1 << 8,
    IBV_QP_TIMEOUT=1 << 9,
    IBV_QP_RETRY_CNT=1 << 10,
    IBV_QP_RNR_RETRY=1 << 11,
    IBV_QP_RQ_PSN=1 << 12,
    IBV_QP_MAX_QP_RD_ATOMIC=1 << 13,
    IBV_QP_MIN_RNR_TIMER=1 << 15,
    IBV_QP_SQ_PSN=1 << 16,
    IBV_QP_MAX_DEST_RD_ATOMIC=1 << 17,
    IBV_QP_DEST_QPN=1 << 20,
    IBV_ACCESS_LOCAL_WRITE=1,
    IBV_ACCESS_REMOTE_WRITE=2,
    IBV_ACCESS_REMOTE_READ=4,
    IBV_ACCESS_REMOTE_ATOMIC=8,
    IBV_WR_RDMA_WRITE=0,
    IBV_WR_RDMA_READ=4,
    IBV_WR_ATOMIC_CMP_AND_SWP=5,
    IBV_WR_ATOMIC_FETCH_AND_ADD=6,
    IBV_SEND_FENCE=1,
    IBV_SEND_SIGNALED=2,
    IBV_WC_SUCCESS=0,
    IBV_WC_LOC_LEN_ERR=1,
    IBV_WC_LOC_PROT_ERR=4,
    IBV_WC_WR_FLUSH_ERR=5,
    IBV_WC_REM_INV_REQ_ERR=9,
    IBV_WC_REM_ACCESS_ERR=10,
    IBV_WC_RETRY_EXC_ERR=12,
    IBV_MTU_1024=3,
    IBV_MTU_4096=5,
    IBV_PORT_DOWN=1,
    IBV_PORT_ACTIVE=4,
    IBV_LINK_LAYER_INFINIBAND=1,
    IBV_LINK_LAYER_ETHERNET=2,
    IBV_ATOMIC_NONE=0,
    IBV_ATOMIC_HCA=1,
)
REQUIRED = {  # (from, to) -> attribute mask bits ibv_modify_qp requires for an RC QP
    (E.IBV_QPS_RESET, E.IBV_QPS_INIT): E.IBV_QP_STATE
    | E.IBV_QP_PKEY_INDEX
    | E.IBV_QP_PORT
    | E.IBV_QP_ACCESS_FLAGS,
    (E.IBV_QPS_INIT, E.IBV_QPS_RTR): E.IBV_QP_STATE
    | E.IBV_QP_AV
    | E.IBV_QP_PATH_MTU
    | E.IBV_QP_DEST_QPN
    | E.IBV_QP_RQ_PSN
    | E.IBV_QP_MAX_DEST_RD_ATOMIC
    | E.IBV_QP_MIN_RNR_TIMER,
    (E.IBV_QPS_RTR, E.IBV_QPS_RTS): E.IBV_QP_STATE
    | E.IBV_QP_SQ_PSN
    | E.IBV_QP_MAX_QP_RD_ATOMIC
    | E.IBV_QP_RETRY_CNT
    | E.IBV_QP_RNR_RETRY
    | E.IBV_QP_TIMEOUT,
}
NEEDS = {
    E.IBV_WR_RDMA_READ: E.IBV_ACCESS_REMOTE_READ,
    E.IBV_WR_RDMA_WRITE: E.IBV_ACCESS_REMOTE_WRITE,
    E.IBV_WR_ATOMIC_CMP_AND_SWP: E.IBV_ACCESS_REMOTE_ATOMIC,
    E.IBV_WR_ATOMIC_FETCH_AND_ADD: E.IBV_ACCESS_REMOTE_ATOMIC,
}
LID = 7
GID = "fe80:0000:0000:0000:0002:c903:0000:0007"


class FakeRDMAError(Exception):
    pass


class FakeFabric:
    """Every queue pair, memory region and completion of the fake NIC, in one process."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.qps: dict[int, FakeQP] = {}
        self.mrs: dict[int, FakeMR] = {}
        self.posted: list[tuple[int, int, int]] = []  # (qp_num, opcode, send_flags)
        self.post_calls = 0
        self.next_qpn = 0x100
        self.next_key = 0x1000
        self.big_endian = False
        self.hang: set[int] = set()  # queue pairs whose work requests never complete
        self.no_devices = False
        self.port_state = E.IBV_PORT_ACTIVE
        self.pv = self._pyverbs()

    def key(self) -> int:
        self.next_key += 1
        return self.next_key

    def _pyverbs(self) -> _pyverbs.Pyverbs:
        fab = self

        def get_device_list() -> list[Any]:
            if fab.no_devices:
                raise FakeRDMAError("Failed to get devices list")
            return [SimpleNamespace(name=b"fake_mlx5_0")]

        class Context:
            def __init__(self, *, name: str) -> None:
                assert name == "fake_mlx5_0"

            def query_device(self) -> Any:
                return SimpleNamespace(
                    atomic_caps=E.IBV_ATOMIC_HCA, max_qp_rd_atom=16, max_qp_init_rd_atom=16
                )

            def query_port(self, port: int) -> Any:
                assert port == 1
                return SimpleNamespace(
                    state=fab.port_state,
                    lid=LID,
                    active_mtu=E.IBV_MTU_4096,
                    link_layer=E.IBV_LINK_LAYER_INFINIBAND,
                    max_msg_sz=1 << 31,
                )

            def query_gid(self, port: int, index: int) -> Any:
                return SimpleNamespace(gid=GID)

            def close(self) -> None:
                pass

        class PD:
            def __init__(self, ctx: Any) -> None:
                self.ctx = ctx

            def close(self) -> None:
                pass

        return _pyverbs.Pyverbs(
            device=SimpleNamespace(get_device_list=get_device_list, Context=Context),
            pd=SimpleNamespace(PD=PD),
            cq=SimpleNamespace(CQ=FakeCQ),
            qp=SimpleNamespace(
                QP=lambda pd, init: FakeQP(fab, pd, init),
                QPInitAttr=FakeStruct,
                QPCap=FakeStruct,
                QPAttr=FakeStruct,
            ),
            mr=SimpleNamespace(
                MR=lambda pd, length, access, address=None: FakeMR(fab, pd, length, access, address)
            ),
            wr=SimpleNamespace(SGE=FakeSGE, SendWR=FakeSendWR),
            addr=SimpleNamespace(
                GID=lambda val: SimpleNamespace(gid=val),
                GlobalRoute=lambda dgid, sgid_index=0, hop_limit=1: SimpleNamespace(
                    dgid=dgid, sgid_index=sgid_index
                ),
                AHAttr=lambda dlid=0, is_global=0, port_num=1, gr=None, sl=0: SimpleNamespace(
                    dlid=dlid, is_global=is_global, port_num=port_num, gr=gr
                ),
            ),
            enums=E,
            origin="fake",
        )

    def posted_by(self, qp_num: int) -> list[tuple[int, int]]:
        return [(op, flags) for qpn, op, flags in self.posted if qpn == qp_num]


class FakeStruct:
    """QPAttr / QPCap / QPInitAttr: plain attribute bags with pyverbs' keyword names."""

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)

    def __getattr__(self, name: str) -> Any:  # unset fields: as if never given
        raise AttributeError(name)


class FakeCQ:
    def __init__(self, ctx: Any, cqe: int, cq_context: Any, channel: Any, vector: int) -> None:
        self.cqe = cqe
        self.entries: deque[Any] = deque()

    def poll(self, num_entries: int = 1) -> tuple[int, list[Any]]:
        out = [self.entries.popleft() for _ in range(min(num_entries, len(self.entries)))]
        return len(out), out

    def close(self) -> None:
        pass


class FakeSGE:
    def __init__(self, addr: int, length: int, lkey: int) -> None:
        self.addr, self.length, self.lkey = addr, length, lkey


class FakeSendWR:
    def __init__(
        self,
        wr_id: int = 0,
        opcode: int = 0,
        num_sge: int = 0,
        imm_data: int = 0,
        sg: list[FakeSGE] | None = None,
        send_flags: int = E.IBV_SEND_SIGNALED,
    ) -> None:
        assert num_sge == 1 and sg is not None and len(sg) == 1
        self.wr_id, self.opcode, self.sg, self.send_flags = wr_id, opcode, sg[0], send_flags
        self.next_wr: FakeSendWR | None = None
        self.rkey = self.remote_addr = self.compare_add = self.swap = -1

    def set_wr_rdma(self, rkey: int, addr: int) -> None:
        self.rkey, self.remote_addr = rkey, addr

    def set_wr_atomic(self, rkey: int, addr: int, compare_add: int, swap: int = 0) -> None:
        if not (0 <= compare_add < 1 << 64 and 0 <= swap < 1 << 64):
            raise OverflowError("can't convert negative value to uint64_t")  # as Cython does
        self.rkey, self.remote_addr, self.compare_add, self.swap = rkey, addr, compare_add, swap


class FakeMR:
    def __init__(
        self, fab: FakeFabric, pd: Any, length: int, access: int, address: int | None
    ) -> None:
        if access & (E.IBV_ACCESS_REMOTE_WRITE | E.IBV_ACCESS_REMOTE_ATOMIC):
            # ibv_reg_mr: remote write/atomic access requires local write
            if not access & E.IBV_ACCESS_LOCAL_WRITE:
                raise FakeRDMAError("Failed to register a MR. Errno: 22, Invalid argument")
        self._own = None
        if address is None:
            self._own = ctypes.create_string_buffer(length)
            address = ctypes.addressof(self._own)
        self.fab, self.pd, self.length, self.access, self.buf = fab, pd, length, access, address
        self.lkey = self.rkey = fab.key()
        fab.mrs[self.lkey] = self

    def covers(self, addr: int, n: int) -> bool:
        return self.buf <= addr and addr + n <= self.buf + self.length

    def read(self, length: int, offset: int) -> bytes:
        return ctypes.string_at(self.buf + offset, length)

    def write(self, data: bytes, length: int, offset: int = 0) -> None:
        ctypes.memmove(self.buf + offset, data, length)

    def close(self) -> None:
        self.fab.mrs.pop(self.lkey, None)


class FakeQP:
    def __init__(self, fab: FakeFabric, pd: Any, init: FakeStruct) -> None:
        assert init.qp_type == E.IBV_QPT_RC and init.sq_sig_all == 0
        self.fab, self.pd, self.cq = fab, pd, init.scq
        self.max_send_wr = init.cap.max_send_wr
        self.qp_num = fab.next_qpn
        fab.next_qpn += 1
        self.state = E.IBV_QPS_RESET
        self.access = 0
        self.dest_qp_num = -1
        self.sq_psn = self.rq_psn = -1
        self.max_rd_atomic = self.max_dest_rd_atomic = 0
        fab.qps[self.qp_num] = self

    def modify(self, attr: FakeStruct, mask: int) -> None:
        with self.fab.lock:
            to = attr.qp_state
            if to == E.IBV_QPS_ERR:
                assert mask == E.IBV_QP_STATE
                self.state = to
                return
            need = REQUIRED.get((self.state, to))
            if need is None or mask & need != need:
                raise FakeRDMAError(
                    f"Failed to modify QP {self.state}->{to} with mask {mask:#x}. Errno: 22"
                )
            if to == E.IBV_QPS_INIT:
                assert attr.port_num == 1 and attr.pkey_index == 0
                self.access = attr.qp_access_flags
            elif to == E.IBV_QPS_RTR:
                ah = attr.ah_attr
                assert ah.port_num == 1 and (ah.dlid == LID or ah.gr.dgid.gid == GID)
                assert attr.path_mtu in (E.IBV_MTU_1024, E.IBV_MTU_4096)
                assert 0 <= attr.rq_psn < 1 << 24
                self.dest_qp_num, self.rq_psn = attr.dest_qp_num, attr.rq_psn
                self.max_dest_rd_atomic = attr.max_dest_rd_atomic
            else:
                assert attr.timeout > 0 and attr.retry_cnt > 0
                self.sq_psn, self.max_rd_atomic = attr.sq_psn, attr.max_rd_atomic
            self.state = to

    def post_send(self, wr: FakeSendWR) -> None:
        fab = self.fab
        with fab.lock:
            fab.post_calls += 1
            if self.state != E.IBV_QPS_RTS:
                raise FakeRDMAError("Failed to post send. Errno: 22, Invalid argument")
            chain = []
            w: FakeSendWR | None = wr
            while w is not None:
                chain.append(w)
                w = w.next_wr
            if len(chain) > self.max_send_wr:
                raise FakeRDMAError("Failed to post send. Errno: 12, Cannot allocate memory")
            if self.qp_num in fab.hang:
                return
            failed = False
            for w in chain:
                fab.posted.append((self.qp_num, w.opcode, w.send_flags))
                status = E.IBV_WC_WR_FLUSH_ERR if failed else self._execute(w)
                if status != E.IBV_WC_SUCCESS:
                    failed = True
                    self.state = E.IBV_QPS_ERR
                if status != E.IBV_WC_SUCCESS or w.send_flags & E.IBV_SEND_SIGNALED:
                    self.cq.entries.append(
                        SimpleNamespace(wr_id=w.wr_id, status=status, vendor_err=0)
                    )

    def _execute(self, w: FakeSendWR) -> int:
        fab = self.fab
        dst = fab.qps.get(self.dest_qp_num)
        if (
            dst is None
            or dst.state not in (E.IBV_QPS_RTR, E.IBV_QPS_RTS)
            or dst.dest_qp_num != self.qp_num
            or dst.rq_psn != self.sq_psn  # out of sequence: dropped, then retried to death
        ):
            return E.IBV_WC_RETRY_EXC_ERR
        assert self.max_rd_atomic <= dst.max_dest_rd_atomic
        sge = w.sg
        local = fab.mrs.get(sge.lkey)
        if local is None or local.pd is not self.pd or not local.covers(sge.addr, sge.length):
            return E.IBV_WC_LOC_PROT_ERR
        if w.opcode != E.IBV_WR_RDMA_WRITE and not local.access & E.IBV_ACCESS_LOCAL_WRITE:
            return E.IBV_WC_LOC_PROT_ERR
        need = NEEDS[w.opcode]
        remote = fab.mrs.get(w.rkey)
        if (
            remote is None
            or remote.pd is not dst.pd
            or not remote.access & need
            or not dst.access & need
            or not remote.covers(w.remote_addr, sge.length)
        ):
            return E.IBV_WC_REM_ACCESS_ERR
        n = sge.length
        if w.opcode == E.IBV_WR_RDMA_READ:
            ctypes.memmove(sge.addr, w.remote_addr, n)
        elif w.opcode == E.IBV_WR_RDMA_WRITE:
            ctypes.memmove(w.remote_addr, sge.addr, n)
        else:
            if n != 8:
                return E.IBV_WC_LOC_LEN_ERR
            if w.remote_addr % 8:
                return E.IBV_WC_REM_INV_REQ_ERR
            order: Literal["little", "big"] = "big" if fab.big_endian else "little"
            old = int.from_bytes(ctypes.string_at(w.remote_addr, 8), order)
            if w.opcode == E.IBV_WR_ATOMIC_CMP_AND_SWP:
                new = w.swap if old == w.compare_add else old
            else:
                new = (old + w.compare_add) % (1 << 64)
            ctypes.memmove(w.remote_addr, new.to_bytes(8, order), 8)
            ctypes.memmove(sge.addr, old.to_bytes(8, order), 8)
        self.sq_psn = (self.sq_psn + 1) % (1 << 24)
        dst.rq_psn = (dst.rq_psn + 1) % (1 << 24)
        return E.IBV_WC_SUCCESS

    def close(self) -> None:
        with self.fab.lock:
            self.fab.qps.pop(self.qp_num, None)
            self.state = -1


class HostThread:
    """A RingHost served by an event loop in a thread of this process."""

    def __init__(self, host: RingHost) -> None:
        self.host = host
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        try:
            self.run(host.start())
        except BaseException:
            self._stop_loop()
            raise

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        async def go() -> Any:
            return fn(*args)

        return self.run(go())

    def settle(self) -> None:
        """Let callbacks the loop scheduled (a closed connection's teardown) run."""
        for _ in range(3):
            self.call(lambda: None)

    def stop(self) -> None:
        try:
            self.run(self.host.close())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def fabric(monkeypatch: pytest.MonkeyPatch) -> FakeFabric:
    fab = FakeFabric()
    monkeypatch.setattr(_pyverbs, "load_pyverbs", lambda: fab.pv)
    monkeypatch.setattr(selftest, "_ATOMICS_CHECKED", set())
    return fab


LAYOUT = RingLayout(RING, SLOTS, SLOT_SIZE)


@pytest.fixture
def rdma_host(fabric: FakeFabric) -> Iterator[HostThread]:
    join = rdma.make_rdma_join()
    assert join is not None
    host = RingHost(
        LAYOUT, host="127.0.0.1", port=0, token=TOKEN, rdma_join=join, scan_interval_s=0.05
    )
    ht = HostThread(host)  # its start() installs join.loopback(host) as host.local
    try:
        yield ht
    finally:
        ht.stop()
        join.close()


def peer(ht: HostThread, **kw: Any) -> rdma.RdmaVerbs:
    kw.setdefault("layout", LAYOUT)
    return rdma.connect("127.0.0.1", ht.host.port, ring=RING, token=TOKEN, verb_timeout=5, **kw)


def test_push_pop_over_rdma(fabric: FakeFabric, rdma_host: HostThread) -> None:
    with peer(rdma_host) as a, peer(rdma_host) as b:
        assert isinstance(a, rdma.RdmaVerbs) and a.peer_id != b.peer_id
        before = len(fabric.posted)
        producer, consumer = Ring(a), Ring(b)
        for i in range(5):  # more than the capacity: the ring wraps
            producer.push({"id": i, "data": bytes([i]) * 100}, timeout=5)
            assert consumer.pop(timeout=5) == {"id": i, "data": bytes([i]) * 100}
        posted = fabric.posted[before:]
        assert posted and all(flags & E.IBV_SEND_SIGNALED for _q, _o, flags in posted)
        peers = rdma_host.host.peers
        assert {p.transport for p in peers.values()} == {"rdma"}
        assert a.layout == LAYOUT
    assert bytes(rdma_host.host.region.buf[:64]) == LAYOUT.header_bytes()


def test_batch_results_order_and_fences(fabric: FakeFabric, rdma_host: HostThread) -> None:
    off = LAYOUT.payload_offset(1)
    with peer(rdma_host) as v:
        assert v._ep is not None
        qpn = v._ep.qp.qp_num
        calls = fabric.post_calls
        res = v.batch(
            [
                (WRITE, off, (5).to_bytes(8, "little") + (10).to_bytes(8, "little")),
                (CAS, off, 5, 6),
                (FAA, off + 8, -3),
                (READ, off, 16),
                (CAS, off, 5, 7),  # fails: the value is 6 now
            ]
        )
        assert fabric.post_calls == calls + 1  # one chained post
        assert res == [None, 5, 10, (6).to_bytes(8, "little") + (7).to_bytes(8, "little"), 6]
        flags = [f for _op, f in fabric.posted_by(qpn)[-5:]]
        fence, sig = E.IBV_SEND_FENCE, E.IBV_SEND_SIGNALED
        # The WRITE and the first CAS follow no READ/atomic; everything after them is fenced.
        assert flags == [sig, sig, sig | fence, sig | fence, sig | fence]
        assert v.batch([(READ, off, 0), (WRITE, off, b"")]) == [b"", None]
        assert fabric.post_calls == calls + 1  # zero-length verbs post nothing


def test_long_batch_and_large_read(fabric: FakeFabric, rdma_host: HostThread) -> None:
    size = LAYOUT.region_size
    assert size > 64 << 10
    with peer(rdma_host) as v:
        calls = fabric.post_calls
        offs = list(range(0, 150 * 8, 8))
        res = v.batch([(READ, o, 8) for o in offs])
        assert fabric.post_calls == calls + 3  # 64 + 64 + 22, in order
        region = bytes(rdma_host.host.region.buf)
        assert res == [region[o : o + 8] for o in offs]
        assert v.read(0, size) == region  # grows the registered local buffer


def test_invalid_verbs_are_refused_before_posting(
    fabric: FakeFabric, rdma_host: HostThread
) -> None:
    with peer(rdma_host) as v:
        n = len(fabric.posted)
        with pytest.raises(VerbAlignmentError):
            v.batch([(READ, 64, 8), (CAS, STAMPS_OFFSET + 4, 0, 1)])
        with pytest.raises(VerbRangeError):
            v.read(LAYOUT.region_size - 4, 8)
        with pytest.raises(VerbRangeError):
            v.write(0, b"DIFFRONG")  # the immutable header
        with pytest.raises(VerbsError):
            v.fetch_and_add(OFF_TAIL, 1 << 64)
        assert len(fabric.posted) == n
        assert v.read(0, 8) == b"DIFFRING"  # still usable


def test_nic_enforces_header_and_inspect_access(fabric: FakeFabric, rdma_host: HostThread) -> None:
    with peer(rdma_host) as v:
        ep, target = v._ep, v._target
        assert ep is not None
        with pytest.raises(ConnectionLost, match="IBV_WC_REM_ACCESS_ERR"):
            # bypass check_op: the write key's region starts at WRITABLE_FROM
            ep.execute([(WRITE, 0, b"DIFFRONG")], target, time.monotonic() + 5, "test")
    assert bytes(rdma_host.host.region.buf[:8]) == b"DIFFRING"
    with peer(rdma_host, layout=None, role="inspect") as ro:
        assert ro.read_only and ro.layout == LAYOUT
        assert ro.read(0, 8) == b"DIFFRING"
        with pytest.raises(VerbsError, match="may only read"):
            ro.compare_and_swap(OFF_TAIL, 0, 1)
        ep, target = ro._ep, ro._target
        assert ep is not None
        with pytest.raises(ConnectionLost, match="IBV_WC_REM_ACCESS_ERR"):
            ep.execute([(FAA, OFF_TAIL, 1)], target, time.monotonic() + 5, "test")
    assert int.from_bytes(rdma_host.host.region.buf[OFF_TAIL : OFF_TAIL + 8], "little") == 0


def test_revoked_peer_cannot_land_verbs(fabric: FakeFabric, rdma_host: HostThread) -> None:
    v = peer(rdma_host)
    qpns = set(fabric.qps)
    rdma_host.call(rdma_host.host.revoke, v.peer_id, "test")
    rdma_host.settle()
    assert len(fabric.qps) == len(qpns) - 1  # the host side of its queue pair is gone
    with pytest.raises(ConnectionLost) as info:
        v.fetch_and_add(OFF_TAIL, 1)
    assert "IBV_WC_RETRY_EXC_ERR" in str(info.value) and "revoked" in str(info.value)
    with pytest.raises(ConnectionLost, match="after close"):
        v.read(0, 8)
    assert int.from_bytes(rdma_host.host.region.buf[OFF_TAIL : OFF_TAIL + 8], "little") == 0


def test_dead_peer_is_repaired_through_the_loopback(
    fabric: FakeFabric, rdma_host: HostThread
) -> None:
    host = rdma_host.host
    loop_qpn = host.local._ep.qp.qp_num  # type: ignore[attr-defined]
    v = peer(rdma_host)
    free0, mine = stamp(0, SlotState.FREE), stamp(0, SlotState.CLAIMED_PUSH, v.peer_id)
    assert v.compare_and_swap(STAMPS_OFFSET, free0, mine) == free0  # claim, then die
    v.close()
    deadline = time.monotonic() + 60
    while rdma_host.call(host.repair_counts).tombstones != 1:
        assert time.monotonic() < deadline, "slot of the dead peer was not repaired"
        time.sleep(0.02)
    # The repair (CAS on the stamp, FAA on the counter) went through the host's NIC.
    ops = {op for op, _f in fabric.posted_by(loop_qpn)}
    assert {E.IBV_WR_ATOMIC_CMP_AND_SWP, E.IBV_WR_ATOMIC_FETCH_AND_ADD} <= ops
    with peer(rdma_host) as a, peer(rdma_host) as b:
        Ring(a).push({"id": 1}, timeout=5)
        assert Ring(b).pop(timeout=5) == {"id": 1}  # skips the tombstone


def test_tcp_and_rdma_peers_share_a_host(fabric: FakeFabric, rdma_host: HostThread) -> None:
    loopback = rdma_host.host.local
    assert isinstance(loopback, rdma.RdmaVerbs) and loopback._ep is not None
    loop_qpn = loopback._ep.qp.qp_num
    n = len(fabric.posted_by(loop_qpn))
    t = tcp_connect("127.0.0.1", rdma_host.host.port, layout=LAYOUT, ring=RING, token=TOKEN)
    with t, peer(rdma_host) as r:
        Ring(t).push({"id": 1}, timeout=5)
        assert Ring(r).pop(timeout=5) == {"id": 1}
        Ring(r).push({"id": 2}, timeout=5)
        assert Ring(t).pop(timeout=5) == {"id": 2}
    assert len(fabric.posted_by(loop_qpn)) > n  # the tcp peer's verbs went through the NIC


def test_verb_timeout_is_connection_lost(fabric: FakeFabric, rdma_host: HostThread) -> None:
    v = rdma.connect(
        "127.0.0.1", rdma_host.host.port, layout=LAYOUT, ring=RING, token=TOKEN, verb_timeout=0.2
    )
    assert v._ep is not None
    fabric.hang.add(v._ep.qp.qp_num)
    with pytest.raises(ConnectionLost, match="did not complete in time"):
        v.read(0, 8)
    with pytest.raises(ConnectionLost, match="after close"):
        v.read(0, 8)


def test_big_endian_atomics_are_refused(fabric: FakeFabric, rdma_host: HostThread) -> None:
    fabric.big_endian = True
    selftest._ATOMICS_CHECKED.clear()
    with pytest.raises(TransportUnavailable) as info:
        peer(rdma_host)
    assert "little-endian" in str(info.value) and "'tcp'" in str(info.value)
    # A host whose device fails the test does not serve rdma: RingHost.start builds its
    # loopback, which runs the test, so the host does not start at all.
    join = rdma.RdmaJoin(fabric.pv)
    host = RingHost(LAYOUT, host="127.0.0.1", port=0, token=TOKEN, rdma_join=join)
    try:
        with pytest.raises(TransportUnavailable, match="little-endian"):
            HostThread(host)
    finally:
        join.close()


def test_device_problems_are_transport_unavailable(fabric: FakeFabric) -> None:
    fabric.port_state = E.IBV_PORT_DOWN
    with pytest.raises(TransportUnavailable, match="not active"):
        rdma.connect("127.0.0.1", 1, layout=LAYOUT, ring=RING, token=TOKEN)
    with pytest.raises(TransportUnavailable, match="not found"):
        rdma.make_rdma_join(device_name="mlx5_9")
    fabric.no_devices = True
    assert rdma.rdma_available() is False
    assert rdma.make_rdma_join() is None
    with pytest.raises(TransportUnavailable, match=r"no RDMA device.*'tcp'"):
        rdma.connect("127.0.0.1", 1, layout=LAYOUT, ring=RING, token=TOKEN)


def test_unreachable_host_is_connection_lost(fabric: FakeFabric) -> None:
    with pytest.raises(ConnectionLost, match="cannot reach"):
        rdma.connect("127.0.0.1", 1, layout=LAYOUT, ring=RING, token=TOKEN, timeout=1)
    assert not fabric.qps and not fabric.mrs  # everything opened was released


# ==========================================================================================
# 3. The real pyverbs 44 classes accept what rings.rdma builds
# ==========================================================================================
def _real_pyverbs() -> _pyverbs.Pyverbs:
    try:
        return _pyverbs.load_pyverbs()
    except TransportUnavailable as exc:
        pytest.skip(f"pyverbs is not importable here: {exc}")


def test_real_pyverbs_accepts_our_attributes_and_work_requests() -> None:
    pv = _real_pyverbs()
    e = pv.enums
    remote = qp.QpPeer(0x1234, 9, "fe80:0000:0000:0000:0002:c903:0000:0009", 77)
    qp.qp_init_attr(pv, None, device.MAX_BATCH_WR)
    attr, mask = qp.init_attr(pv, 1, e.IBV_ACCESS_REMOTE_READ)
    assert attr.qp_access_flags == e.IBV_ACCESS_REMOTE_READ and mask & e.IBV_QP_PORT
    for grh in (True, False):
        attr, mask = qp.rtr_attr(
            pv, remote, port=1, gid_index=3, use_grh=grh, mtu=e.IBV_MTU_4096, max_dest_rd_atomic=8
        )
        assert (attr.dest_qp_num, attr.rq_psn, attr.path_mtu) == (0x1234, 77, e.IBV_MTU_4096)
        assert attr.ah_attr.is_global == int(grh) and attr.ah_attr.dlid == 9
        if grh:
            assert attr.ah_attr.dgid == remote.gid and attr.ah_attr.sgid_index == 3
        assert mask & e.IBV_QP_DEST_QPN and mask & e.IBV_QP_AV
    attr, mask = qp.rts_attr(pv, local_psn=5, max_rd_atomic=4)
    assert (attr.sq_psn, attr.max_rd_atomic) == (5, 4) and mask & e.IBV_QP_SQ_PSN
    target = qp.Target(0x10000, 11, 12, 4096)
    ops = [(READ, 128, 64), (WRITE, 192, b"x" * 8), (CAS, 64, 1, (1 << 64) - 1), (FAA, 72, -1)]
    wrs = [qp.build_wr(pv, i, op, 0x2000, 8, 5, target, i > 0) for i, op in enumerate(ops)]
    for a, b in itertools.pairwise(wrs):
        a.next_wr = b
    assert [w.opcode for w in wrs] == [
        e.IBV_WR_RDMA_READ,
        e.IBV_WR_RDMA_WRITE,
        e.IBV_WR_ATOMIC_CMP_AND_SWP,
        e.IBV_WR_ATOMIC_FETCH_AND_ADD,
    ]
    assert wrs[0].send_flags == e.IBV_SEND_SIGNALED
    assert wrs[1].send_flags == e.IBV_SEND_SIGNALED | e.IBV_SEND_FENCE
    assert qp.wc_status_name(pv, e.IBV_WC_RETRY_EXC_ERR) == "IBV_WC_RETRY_EXC_ERR"
    assert "retry" in qp.wc_status_text(pv, e.IBV_WC_RETRY_EXC_ERR)
