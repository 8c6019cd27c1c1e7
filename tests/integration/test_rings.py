"""Ring algorithm tests, run identically over the ``local`` and ``tcp`` transports."""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from rings import payload as pl
from rings.errors import (
    ConfigError,
    LayoutMismatch,
    PayloadCorrupt,
    PayloadTooLarge,
    RingEmpty,
    RingFull,
    VerbAlignmentError,
    VerbRangeError,
    VerbsError,
)
from rings.host import PeerInfo, RepairCounts, RingHost
from rings.layout import (
    HOLDER_LOCAL,
    OFF_HEAD,
    OFF_TAIL,
    PUSH,
    SEATS,
    STAMPS_OFFSET,
    RingLayout,
    SeatKind,
    SlotState,
    seat,
    stamp,
    unpack_stamp,
)
from rings.ring import Ring
from rings.soak import RING, start_ring_host, stop_process
from rings.transports import connect
from rings.verbs import CAS, FAA, WRITE, LocalVerbs, Verbs
from tests.support.controller import TOKEN

pytestmark = pytest.mark.integration  # starts processes or servers

SLOTS = 3
SLOT_SIZE = 256


@dataclass
class Backend:
    name: str
    new_peer: Callable[[], Verbs]
    layout: RingLayout


@pytest.fixture(params=["local", "tcp"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    layout = RingLayout(RING, SLOTS, SLOT_SIZE)
    if request.param == "local":
        host = RingHost(layout, host="127.0.0.1", port=0, token=TOKEN)
        ids = iter(range(2, 1000))
        yield Backend("local", lambda: LocalVerbs(host.region, next(ids)), layout)
        return
    proc, port = start_ring_host(SLOTS, SLOT_SIZE, token=TOKEN)
    peers: list[Verbs] = []

    def new_peer() -> Verbs:
        v = connect("tcp", "127.0.0.1", port, layout=layout, ring=RING, token=TOKEN)
        peers.append(v)
        return v

    try:
        yield Backend("tcp", new_peer, layout)
    finally:
        for v in peers:
            v.close()
        stop_process(proc)


def test_layout_is_checked_at_construction() -> None:
    with pytest.raises(ConfigError, match="multiple of 8"):
        RingLayout("r", 4, 100)
    with pytest.raises(ConfigError, match="slot count"):
        RingLayout("r", 1, 64)
    lay = RingLayout("r", 5, 64)
    assert lay.payloads_offset % 64 == 0
    assert lay.stamp_offset(7) == STAMPS_OFFSET + 16
    buf = lay.initial_region()
    assert RingLayout.from_header(bytes(buf)) == lay
    with pytest.raises(LayoutMismatch, match="magic"):
        RingLayout.from_header(bytes(64))


def test_stamp_round_trip() -> None:
    word = stamp(123456789, SlotState.CLAIMED_POP, 4242)
    assert unpack_stamp(word) == (123456789, SlotState.CLAIMED_POP, 4242)


def test_fifo_full_and_empty(backend: Backend) -> None:
    ring = Ring(backend.new_peer())
    assert ring.try_pop() is None
    for i in range(SLOTS):
        assert ring.try_push({"i": i}) is None
    extra = {"i": 99}
    assert ring.try_push(extra) is extra  # full: handed back
    assert [ring.try_pop() for _ in range(SLOTS)] == [{"i": i} for i in range(SLOTS)]
    assert ring.try_pop() is None


def test_wraps_many_laps_between_peers(backend: Backend) -> None:
    prod, cons = Ring(backend.new_peer()), Ring(backend.new_peer())
    got = []
    for i in range(10 * SLOTS):
        prod.push({"i": i}, timeout=5)
        if i >= SLOTS - 1:  # keep the ring full-ish so every slot is reused each lap
            got.append(cons.pop(timeout=5)["i"])
    while (item := cons.try_pop()) is not None:
        got.append(item["i"])
    assert got == list(range(10 * SLOTS))


def test_blocking_layer_times_out(backend: Backend) -> None:
    ring = Ring(backend.new_peer())
    with pytest.raises(RingEmpty):
        ring.pop(timeout=0.05)
    for i in range(SLOTS):
        ring.push({"i": i}, timeout=1)
    with pytest.raises(RingFull):
        ring.push({"i": 9}, timeout=0.05)


def test_oversize_payload_refused_before_claim(backend: Backend) -> None:
    verbs = backend.new_peer()
    ring = Ring(verbs)
    limit = pl.max_body(SLOT_SIZE)
    with pytest.raises(PayloadTooLarge) as err:
        ring.try_push({"blob": b"x" * SLOT_SIZE})
    assert err.value.limit == limit
    assert str(limit) in str(err.value) and str(err.value.size) in str(err.value)
    tail = struct.unpack("<Q", verbs.read(OFF_TAIL, 8))[0]
    assert tail == 0
    assert ring.try_pop() is None


def test_corrupt_payload_detected_and_ring_keeps_flowing(backend: Backend) -> None:
    verbs = backend.new_peer()
    ring = Ring(verbs)
    ring.push({"i": 0}, timeout=1)
    ring.push({"i": 1}, timeout=1)
    # Flip a byte of position 0's msgpack body: its crc no longer matches.
    off = backend.layout.payload_offset(0) + pl.HEADER_SIZE + 1
    verbs.write(off, bytes([verbs.read(off, 1)[0] ^ 0xFF]))
    with pytest.raises(PayloadCorrupt, match="checksum"):
        ring.try_pop()
    assert ring.try_pop() == {"i": 1}


def test_payload_for_another_lap_is_detected() -> None:
    data = pl.frame(pl.encode_body({"a": 1}, 128), position=5)
    with pytest.raises(PayloadCorrupt, match="position 5"):
        pl.unframe(data, 8)
    assert pl.unframe(data, 5) == {"a": 1}


def test_verbs_refuse_bad_addresses(backend: Backend) -> None:
    verbs = backend.new_peer()
    size = backend.layout.region_size
    with pytest.raises(VerbAlignmentError):
        verbs.compare_and_swap(OFF_HEAD + 4, 0, 1)
    with pytest.raises(VerbAlignmentError):
        verbs.fetch_and_add(STAMPS_OFFSET + 3, 1)
    with pytest.raises(VerbRangeError):
        verbs.read(size - 4, 8)
    with pytest.raises(VerbRangeError):
        verbs.fetch_and_add(size, 1)
    with pytest.raises(VerbRangeError):
        verbs.write(-1, b"x")
    # Nothing of a refused batch ran, and the peer can go on.
    assert verbs.fetch_and_add(OFF_HEAD, 0) == 0


def test_tombstone_is_skipped(backend: Backend) -> None:
    """A claimed-but-never-published slot, once repaired, is skipped by consumers."""
    a, b = backend.new_peer(), backend.new_peer()
    lay = backend.layout
    # Peer a claims position 0 by hand and never publishes.
    assert a.batch(
        [
            (
                CAS,
                lay.stamp_offset(0),
                stamp(0, SlotState.FREE),
                stamp(0, SlotState.CLAIMED_PUSH, a.peer_id),
            )
        ]
    ) == [stamp(0, SlotState.FREE)]
    prod, cons = Ring(b), Ring(backend.new_peer())
    prod.push({"i": 1}, timeout=1)
    assert cons.try_pop() is None  # stuck behind position 0
    # The host's repair (what it does when a dies) turns position 0 into a tombstone.
    a.compare_and_swap(
        lay.stamp_offset(0),
        stamp(0, SlotState.CLAIMED_PUSH, a.peer_id),
        stamp(0, SlotState.TOMBSTONE),
    )
    assert cons.pop(timeout=1) == {"i": 1}
    assert cons.stats.tombstones_skipped == 1
    for i in range(2, 2 + 2 * SLOTS):  # and the ring wraps normally afterwards
        prod.push({"i": i}, timeout=1)
        assert cons.pop(timeout=1) == {"i": i}


def test_threads_exactly_once_local() -> None:
    host = RingHost(RingLayout(RING, 2, 128), host="127.0.0.1", port=0, token=TOKEN)
    n_prod, n_cons, per = 4, 4, 500
    got: list[int] = []
    lock = threading.Lock()

    def produce(k: int) -> None:
        ring = Ring(LocalVerbs(host.region, 10 + k))
        for s in range(per):
            ring.push({"id": k * per + s}, timeout=30)

    def consume(k: int) -> None:
        ring = Ring(LocalVerbs(host.region, 100 + k))
        while True:
            item = ring.pop(timeout=30)
            if item.get("stop"):
                return
            with lock:
                got.append(item["id"])

    threads = [threading.Thread(target=consume, args=(k,)) for k in range(n_cons)]
    threads += [threading.Thread(target=produce, args=(k,)) for k in range(n_prod)]
    for t in threads:
        t.start()
    for t in threads[n_cons:]:
        t.join()
    driver = Ring(host.local)
    for _ in range(n_cons):
        driver.push({"stop": True}, timeout=30)
    for t in threads[:n_cons]:
        t.join()
    assert sorted(got) == list(range(n_prod * per))


def test_host_repair_counts(backend: Backend) -> None:
    if backend.name != "local":
        pytest.skip("repair of a live tcp peer is covered by the SIGKILL tests")
    lay = backend.layout
    host = RingHost(lay, host="127.0.0.1", port=0, token=TOKEN)
    dead_p, dead_c, live = (LocalVerbs(host.region, i) for i in (7, 8, 9))
    ring = Ring(live)
    ring.push({"i": 0}, timeout=1)
    # dead_c claims position 0 for popping; dead_p claims position 1 for pushing.
    dead_c.compare_and_swap(
        lay.stamp_offset(0), stamp(0, SlotState.PUBLISHED), stamp(0, SlotState.CLAIMED_POP, 8)
    )
    dead_p.batch(
        [
            (CAS, OFF_TAIL, 0, 1),
            (
                CAS,
                lay.stamp_offset(1),
                stamp(1, SlotState.FREE),
                stamp(1, SlotState.CLAIMED_PUSH, 7),
            ),
        ]
    )
    host.scan_once()  # holders 7 and 8 are not live peers of this host: repaired at once
    counts = host.repair_counts()
    assert (counts.tombstones, counts.freed) == (1, 1)
    states = [
        unpack_stamp(struct.unpack("<Q", live.read(lay.stamp_offset(i), 8))[0])[1] for i in range(2)
    ]
    assert states == [SlotState.FREE, SlotState.TOMBSTONE]
    ring.push({"i": 2}, timeout=1)
    assert ring.pop(timeout=1) == {"i": 2}


def test_rdma_refuses_cleanly_without_device() -> None:
    from rings.errors import TransportUnavailable

    with pytest.raises(TransportUnavailable, match="tcp"):
        connect("rdma", "127.0.0.1", 1, layout=None, ring=RING, token=TOKEN)


# -- tickets: what the host gives up, and when ------------------------------------------------
def _live_host(*ids: int, timeout: float = 1.0) -> tuple[RingHost, list[Ring]]:
    """A host whose scanner we drive by hand, and Rings of peers it counts as connected."""
    host = RingHost(
        RingLayout(RING, SLOTS, SLOT_SIZE),
        host="127.0.0.1",
        port=0,
        token=TOKEN,
        claim_timeout_s=timeout,
    )
    for i in ids:
        host.peers[i] = PeerInfo(i, f"p{i}", "peer", "local", "-", 0.0)
    return host, [Ring(LocalVerbs(host.region, i)) for i in ids]


def _stamp_at(host: RingHost, position: int) -> tuple[int, SlotState, int]:
    raw = host.local.read(host.layout.stamp_offset(position), 8)
    return unpack_stamp(struct.unpack("<Q", raw)[0])


def test_idle_tickets_are_given_up_without_revoking_their_holders() -> None:
    host, (prod, cons, other) = _live_host(11, 12, 13)
    for i in range(SLOTS):
        prod.push({"i": i}, timeout=1)
    assert prod.try_push({"i": 3}) is not None  # full: ticket 3 stays with the producer
    assert cons.try_pop() == {"i": 0}  # slot 0 is FREE(3) now, ready for that ticket
    host.scan_once(now=100.0)
    host.scan_once(now=100.5)
    assert _stamp_at(host, 3)[:2] == (3, SlotState.FREE)  # not idle long enough
    host.scan_once(now=101.6)
    assert _stamp_at(host, 3)[:2] == (3, SlotState.TOMBSTONE)
    assert host.repair_counts() == RepairCounts(1, 0, 0, 0)
    assert 11 in host.peers  # given up, not revoked: its next claim just fails
    assert prod.try_push({"i": 4}) is not None  # new ticket 4: slot 1 still holds item 1
    assert [cons.pop(timeout=1)["i"] for _ in range(2)] == [1, 2]
    assert prod.try_push({"i": 4}) is None
    assert cons.pop(timeout=1) == {"i": 4}  # the tombstone at 3 was skipped
    assert cons.stats.tombstones_skipped == 1

    # An idle consumer's ticket: its item is re-offered to any consumer.
    assert cons.try_pop() is None  # empty: ticket 5 stays with cons
    prod.push({"i": 5}, timeout=1)
    host.scan_once(now=200.0)
    host.scan_once(now=201.1)
    assert _stamp_at(host, 5)[:2] == (5, SlotState.ORPHANED)
    assert host.repair_counts().orphaned == 1
    assert other.try_pop() == {"i": 5}  # took its own ticket 6 (empty), then the orphan
    assert other.stats.orphans_taken == 1
    assert cons.try_pop() is None  # cons finds 5 gone, takes ticket 7
    prod.push({"i": 6}, timeout=1)
    prod.push({"i": 7}, timeout=1)
    assert (other.pop(timeout=1), cons.pop(timeout=1)) == ({"i": 6}, {"i": 7})
    assert host.repair_counts() == RepairCounts(1, 0, 0, 1)


def test_peer_stuck_between_ticket_and_claim_is_revoked_first() -> None:
    host, (stuck, live) = _live_host(21, 22)
    lay = host.layout
    # Peer 21 announces a ticket (TAKING), takes position 0, and never claims it.
    stuck.verbs.batch(
        [
            (WRITE, lay.seat_offset(21, PUSH), struct.pack("<Q", seat(SeatKind.TAKING, 7))),
            (FAA, OFF_TAIL, 1),
        ]
    )
    live.push({"i": 1}, timeout=1)
    assert live.try_pop() is None  # ticket 0: nothing published there
    host.scan_once(now=10.0)
    host.scan_once(now=10.9)
    # A live peer's undeclared ticket is never given up: it may write the slot any moment.
    assert _stamp_at(host, 0)[:2] == (0, SlotState.FREE) and 21 in host.peers
    host.scan_once(now=11.1)
    assert 21 not in host.peers  # revoked first, for holding its ticket too long ...
    assert _stamp_at(host, 0)[:2] == (0, SlotState.TOMBSTONE)  # ... then given up
    assert host.repair_counts() == RepairCounts(1, 0, 1, 0)
    assert live.pop(timeout=1) == {"i": 1}


def test_dead_peers_undeclared_ticket_waits_for_live_takers_to_move_on() -> None:
    host, (dead, busy) = _live_host(31, 32)
    lay = host.layout

    def taking(ring: Ring, seq: int) -> None:
        off = lay.seat_offset(ring.me, PUSH)
        ring.verbs.batch(
            [(WRITE, off, struct.pack("<Q", seat(SeatKind.TAKING, seq))), (FAA, OFF_TAIL, 1)]
        )

    taking(dead, 1)  # position 0
    taking(busy, 1)  # position 1: a live peer between its ticket and its claim
    host.revoke(31, "test")  # 31 dies: position 0 or 1 is its, the host cannot tell which
    assert [_stamp_at(host, p)[:2] for p in (0, 1)] == [(0, SlotState.FREE), (1, SlotState.FREE)]
    # Peer 32 declares its ticket: whatever is still undeclared is the dead peer's.
    busy.verbs.write(lay.seat_offset(32, PUSH), struct.pack("<Q", seat(SeatKind.HOLDS, 1)))
    host.scan_once(now=1.0)
    assert [_stamp_at(host, p)[:2] for p in (0, 1)] == [
        (0, SlotState.TOMBSTONE),
        (1, SlotState.FREE),
    ]
    assert host.repair_counts() == RepairCounts(1, 0, 1, 0)


def test_seats_of_live_peers_are_never_shared() -> None:
    host = RingHost(RingLayout(RING, SLOTS, SLOT_SIZE), host="127.0.0.1", port=0, token=TOKEN)
    seen = set()
    for _ in range(SEATS + 5):
        try:
            pid = host._allocate_id()
        except VerbsError as exc:
            assert "seats" in str(exc)
            break
        assert pid % SEATS not in seen and pid % SEATS != HOLDER_LOCAL
        seen.add(pid % SEATS)
        host.peers[pid] = PeerInfo(pid, "p", "peer", "local", "-", 0.0)
    assert len(seen) == SEATS - 1
