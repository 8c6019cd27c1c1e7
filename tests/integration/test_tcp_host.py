"""The tcp transport against real host processes: handshake, refusals, garbage, repair."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from contracts.disagg import DisaggConfig
from rings import wire
from rings.errors import ConfigError, ConnectionLost, HandshakeError, VerbRangeError, VerbsError
from rings.handshake import handshake, open_socket
from rings.inspect import snapshot
from rings.layout import OFF_HEAD, OFF_TAIL, RingLayout, SlotState, stamp
from rings.ring import Ring
from rings.soak import (
    RING,
    _consumer,
    _producer,
    check_delivery,
    open_ring,
    run_soak,
    start_ring_host,
    stop_process,
)
from rings.transports import connect
from rings.verbs import FAA, RDMA_ONLY_OPTIONS, READ, WRITE
from tests.support.controller import TOKEN
from tests.support.paths import ROOT
from tests.support.waits import wait_for

pytestmark = pytest.mark.integration  # starts processes or servers

SLOTS, SLOT_SIZE = 3, 512
LAYOUT = RingLayout(RING, SLOTS, SLOT_SIZE)


@pytest.fixture
def host() -> Iterator[int]:
    proc, port = start_ring_host(SLOTS, SLOT_SIZE, token=TOKEN)
    try:
        yield port
    finally:
        stop_process(proc)


def peer(port: int, **kw: object) -> Ring:
    return Ring(connect("tcp", "127.0.0.1", port, layout=LAYOUT, ring=RING, token=TOKEN, **kw))


def assert_serving(port: int) -> None:
    ring = peer(port)
    ring.push({"alive": 1}, timeout=2)
    assert ring.pop(timeout=2) == {"alive": 1}
    ring.verbs.close()


# -- handshake ------------------------------------------------------------------------------
def test_bad_token_refused(host: int) -> None:
    with pytest.raises(HandshakeError, match="authentication failed"):
        connect("tcp", "127.0.0.1", host, layout=LAYOUT, ring=RING, token="wrong")
    assert_serving(host)


def test_wrong_layout_refused_naming_both_sides(host: int) -> None:
    other = RingLayout(RING, 64, 4096)
    with pytest.raises(HandshakeError) as err:
        connect("tcp", "127.0.0.1", host, layout=other, ring=RING, token=TOKEN)
    msg = str(err.value)
    assert "3 slots x 512 bytes" in msg and "64 slots x 4096 bytes" in msg


def test_wrong_ring_refused(host: int) -> None:
    with pytest.raises(HandshakeError, match="serves ring 'soak', peer asked 'phase1'"):
        connect("tcp", "127.0.0.1", host, layout=None, ring="phase1", token=TOKEN)


# -- transport options ----------------------------------------------------------------------
@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_rdma_options_are_accepted_and_ignored_over_tcp(transport: str, host: int) -> None:
    """Workers pass ``DisaggConfig.rdma_options()`` to whichever transport they get."""
    opts = {**DisaggConfig().rdma_options(), "self_test": False}
    assert set(opts) == set(RDMA_ONLY_OPTIONS)
    verbs = connect(
        transport,
        "127.0.0.1",
        host,
        layout=LAYOUT,
        ring=RING,
        token=TOKEN,
        peer_name="options",
        timeout=5.0,
        verb_timeout=5.0,
        **opts,
    )
    with verbs:
        ring = Ring(verbs)
        ring.push({"id": 1}, timeout=2)
        assert ring.pop(timeout=2) == {"id": 1}


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_misspelt_option_refused_over_tcp_naming_it(transport: str) -> None:
    # Port 1 has no host: the options are refused before anything is connected.
    with pytest.raises(ConfigError) as info:
        connect(
            transport,
            "127.0.0.1",
            1,
            layout=LAYOUT,
            ring=RING,
            token=TOKEN,
            devcie_name="mlx5_0",
            verb_timout=5.0,
        )
    msg = str(info.value)
    assert "'devcie_name'" in msg and "'verb_timout'" in msg
    for name in ("role", "peer_name", "timeout", "verb_timeout", *RDMA_ONLY_OPTIONS):
        assert name in msg


def test_peer_refuses_host_without_token() -> None:
    """A host that cannot prove the token is refused by the peer (mutual authentication)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]

    def fake_host() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.sendall(
                wire.pack_msg(
                    {"proto": wire.PROTO, "version": wire.PROTO_VERSION, "nonce": b"n" * 32}
                )
            )
            n = struct.unpack("<I", conn.recv(4))[0]
            while n > 0:
                n -= len(conn.recv(n))
            conn.sendall(
                wire.pack_msg(
                    {
                        "ok": True,
                        "peer_id": 2,
                        "layout": LAYOUT.describe(),
                        "region_size": LAYOUT.region_size,
                        "mac": b"x" * 32,
                    }
                )
            )
            conn.settimeout(60)
            conn.recv(1)  # until the peer has judged the welcome and hung up

    t = threading.Thread(target=fake_host)
    t.start()
    try:
        with pytest.raises(HandshakeError, match="did not prove"):
            connect("tcp", "127.0.0.1", port, layout=LAYOUT, ring=RING, token=TOKEN)
    finally:
        t.join()
        srv.close()


def test_nothing_served_before_handshake(host: int) -> None:
    sock = open_socket("127.0.0.1", host, 5)
    sock.recv(4096)  # the greeting
    sock.sendall(wire.encode_request([(READ, 0, 64)]))  # verbs instead of a JOIN
    sock.settimeout(5)
    assert sock.recv(4096) == b""  # dropped without an answer
    sock.close()
    assert_serving(host)


# -- garbage and disconnects ----------------------------------------------------------------
def test_random_bytes_and_half_frames_do_not_hurt_others(host: int) -> None:
    live = peer(host)
    live.push({"i": 1}, timeout=2)
    for blob in (os.urandom(3000), b"\xff\xff\xff\xff" + os.urandom(10), b"\x05\x00"):
        s = socket.create_connection(("127.0.0.1", host))
        s.sendall(blob)
        s.close()
    # An authenticated peer that sends garbage after the handshake is dropped too.
    bad = socket.create_connection(("127.0.0.1", host))
    handshake(bad, ring=RING, layout=LAYOUT, token=TOKEN, transport="tcp")
    bad.sendall(struct.pack("<I", 5) + b"\x01\x00\x09zz")
    bad.settimeout(5)
    assert bad.recv(100) == b""
    bad.close()
    # A peer that disconnects in the middle of a request.
    half = socket.create_connection(("127.0.0.1", host))
    handshake(half, ring=RING, layout=LAYOUT, token=TOKEN, transport="tcp")
    req = wire.encode_request([(WRITE, LAYOUT.payloads_offset, b"y" * 400)])
    half.sendall(req[:100])
    half.close()
    assert live.pop(timeout=2) == {"i": 1}
    assert_serving(host)


def test_host_validates_raw_verbs(host: int) -> None:
    """Bad verbs sent on the wire (bypassing the client) get an error; the peer goes on."""
    sock = socket.create_connection(("127.0.0.1", host))
    handshake(sock, ring=RING, layout=LAYOUT, token=TOKEN, transport="tcp")

    def call(ops: list[tuple[int, ...]]) -> list[object]:
        sock.sendall(wire.encode_request(ops))
        n = struct.unpack("<I", sock.recv(4, socket.MSG_WAITALL))[0]
        return wire.decode_response(sock.recv(n, socket.MSG_WAITALL), ops)

    with pytest.raises(VerbsError, match="not 8-byte aligned"):
        call([(FAA, OFF_HEAD + 2, 1)])
    with pytest.raises(VerbRangeError, match="outside the region"):
        call([(READ, LAYOUT.region_size - 1, 2)])
    with pytest.raises(VerbRangeError, match="read-only header"):
        call([(WRITE, 0, b"EVILMAGC")])
    # A refused batch runs none of its verbs.
    with pytest.raises(VerbRangeError):
        call([(FAA, OFF_TAIL, 5), (READ, 1 << 40, 1)])
    assert call([(FAA, OFF_TAIL, 0)]) == [0]
    sock.close()


def test_inspect_peer_may_only_read(host: int) -> None:
    v = connect("tcp", "127.0.0.1", host, layout=None, ring=RING, token=TOKEN, role="inspect")
    assert v.read(0, 8) == b"DIFFRING"
    with pytest.raises(VerbsError, match="may only read"):
        v.compare_and_swap(OFF_TAIL, 0, 1)
    v.close()


def test_host_gone_is_connection_lost() -> None:
    proc, port = start_ring_host(SLOTS, SLOT_SIZE, token=TOKEN)
    ring = peer(port)
    stop_process(proc)
    with pytest.raises(ConnectionLost):
        ring.try_push({"i": 1})


# -- linearizable atomics ---------------------------------------------------------------------
def _faa_worker(port: int, n: int, out: str) -> None:
    v = connect("tcp", "127.0.0.1", port, layout=LAYOUT, ring=RING, token=TOKEN)
    olds = [v.fetch_and_add(OFF_HEAD, 1) for _ in range(n)]
    # CAS-increment a second word in a retry loop: also serialisable.
    cas_olds = []
    for _ in range(n // 4):
        while True:
            cur = int.from_bytes(v.read(OFF_TAIL, 8), "little")
            if v.compare_and_swap(OFF_TAIL, cur, cur + 1) == cur:
                cas_olds.append(cur)
                break
    Path(out).write_text(json.dumps([olds, cas_olds]))
    v.close()


def test_atomics_are_linearizable(host: int, tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    procs, n = 6, 600
    ps = [ctx.Process(target=_faa_worker, args=(host, n, f"{tmp_path}/{i}")) for i in range(procs)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(120)
    assert [p.exitcode for p in ps] == [0] * procs
    faa, cas = [], []
    for i in range(procs):
        a, b = json.loads(Path(f"{tmp_path}/{i}").read_text())
        faa += a
        cas += b
    # A serial order hands out every old value exactly once, and ends at the total.
    assert sorted(faa) == list(range(procs * n))
    assert sorted(cas) == list(range(procs * (n // 4)))
    v = connect("tcp", "127.0.0.1", host, layout=LAYOUT, ring=RING, token=TOKEN)
    assert struct.unpack("<QQ", v.read(OFF_HEAD, 16)) == (procs * n, procs * (n // 4))
    v.close()


# -- exactly once across processes ------------------------------------------------------------
def test_exactly_once_many_processes() -> None:
    items = int(os.environ.get("DIFFRING_SOAK_ITEMS", "20000"))
    res = run_soak(4, 4, items, capacity=3)
    assert res.ok, res.report()
    assert res.delivered == items


# -- stall repair -------------------------------------------------------------------------------
def _stall_peer(port: int, mode: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.stall_peer",
            str(port),
            str(SLOTS),
            str(SLOT_SIZE),
            mode,
            TOKEN,
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("TICKET" if mode.endswith("-ticket") else "CLAIMED"), line
    return proc, line


@pytest.mark.parametrize("victim", ["producer", "consumer"])
def test_sigkilled_peer_is_repaired_and_ring_flows(victim: str, tmp_path: Path) -> None:
    # A long claim timeout: only the dropped connection can trigger this repair.
    host_proc, port = start_ring_host(SLOTS, SLOT_SIZE, token=TOKEN, claim_timeout=300)
    ctx = mp.get_context("spawn")
    procs: list[mp.process.BaseProcess] = []
    stall: subprocess.Popen[str] | None = None
    n_items, n_prod, n_cons = 300, 2, 2
    try:
        inspector = connect(
            "tcp", "127.0.0.1", port, layout=None, ring=RING, token=TOKEN, role="inspect"
        )
        stalled_id: int | None = None
        if victim == "producer":
            stall, _ = _stall_peer(port, "push")
        prods = [
            ctx.Process(
                target=_producer,
                args=(port, SLOTS, SLOT_SIZE, i, n_items, None, 64, f"{tmp_path}/p{i}", TOKEN),
            )
            for i in range(n_prod)
        ]
        for p in prods:
            p.start()
        if victim == "consumer":
            wait_for(lambda: snapshot(inspector)["published"] == SLOTS, "a full ring", 120)
            stall, line = _stall_peer(port, "pop")
            stalled_id = int(line.split()[2])
        cons = [
            ctx.Process(target=_consumer, args=(port, SLOTS, SLOT_SIZE, f"{tmp_path}/c{i}", TOKEN))
            for i in range(n_cons)
        ]
        for p in cons:
            p.start()
        procs = prods + cons
        # The ring is stuck behind the stalled claim: nothing moves while the peer lives.
        # Every other peer passes the stalled position on its own ticket and stops at the
        # stalled slot's next laps: a stalled producer leaves consumers waiting at positions
        # 0 and 3 (4, 5 published, producers waiting at 3 and 6); a stalled consumer leaves
        # everyone else consumed and all four peers waiting at 3 and 6.
        state = "claimed_push" if victim == "producer" else "claimed_pop"
        stuck_published = SLOTS - 1 if victim == "producer" else 0
        stuck_at = (4, 7) if victim == "producer" else (7, 7)

        def stuck() -> bool:
            snap = snapshot(inspector)
            return (
                snap[state] == 1
                and snap["published"] == stuck_published
                and (snap["head"], snap["tail"]) == stuck_at
            )

        wait_for(stuck, "the ring stuck behind the stalled claim", 120)
        before = snapshot(inspector)
        time.sleep(0.5)
        after = snapshot(inspector)
        assert (after["head"], after["tail"]) == (before["head"], before["tail"])
        assert after[state] == 1 and after["published"] == stuck_published
        assert stall is not None
        os.kill(stall.pid, signal.SIGKILL)
        stall.wait()
        for p in prods:
            p.join(60)
        assert [p.exitcode for p in prods] == [0] * n_prod
        driver = open_ring(port, SLOTS, SLOT_SIZE, TOKEN)
        for _ in range(n_cons):
            driver.push({"stop": True}, timeout=30)
        for p in cons:
            p.join(60)
        assert [p.exitcode for p in cons] == [0] * n_cons
        delivered = []
        for i in range(n_cons):
            raw = Path(f"{tmp_path}/c{i}").read_bytes()
            delivered += list(struct.unpack(f"<{len(raw) // 8}Q", raw))
        if stalled_id is not None:
            delivered.append(stalled_id)  # the dead consumer did take that one item
        dup, missing, unexpected = check_delivery({i: n_items for i in range(n_prod)}, delivered)
        assert (dup, missing, unexpected) == (0, 0, 0)
        repairs = snapshot(inspector)["repairs"]
        if victim == "producer":
            assert repairs["tombstoned"] == 1 and repairs["freed"] == 0
        else:
            assert repairs["freed"] == 1 and repairs["tombstoned"] == 0
        assert repairs["peers_revoked"] == 1
        inspector.close()
        driver.verbs.close()
    finally:
        if stall is not None and stall.poll() is None:
            stall.kill()
            stall.wait()
        for p in procs:
            stop_process(p)
        stop_process(host_proc)


def test_claim_timeout_revokes_a_live_but_stuck_peer() -> None:
    host_proc, port = start_ring_host(
        SLOTS, SLOT_SIZE, token=TOKEN, claim_timeout=0.5, scan_interval=0.05
    )
    stall = None
    try:
        stall, _ = _stall_peer(port, "push")  # alive, but holds its claim forever
        ring = peer(port)
        ring.push({"i": 1}, timeout=2)
        assert ring.pop(timeout=10) == {"i": 1}  # flows once the host revoked the claimer
        assert stall.stdout is not None
        inspector = connect(
            "tcp", "127.0.0.1", port, layout=None, ring=RING, token=TOKEN, role="inspect"
        )
        repairs = snapshot(inspector)["repairs"]
        assert repairs == {"tombstoned": 1, "freed": 0, "peers_revoked": 1, "orphaned": 0}
        inspector.close()
    finally:
        if stall is not None:
            stall.kill()
            stall.wait()
        stop_process(host_proc)


@pytest.mark.parametrize("victim", ["producer", "consumer", "consumer-on-empty"])
def test_sigkilled_ticket_holder_is_repaired_and_ring_flows(victim: str, tmp_path: Path) -> None:
    """A peer SIGKILLed after its ticket FAA and before its claim CAS: it holds a position
    that no stamp names. The host learns it from the peer's seat (TAKING) and gives the
    position up: a producer's becomes a tombstone, a consumer's item is re-offered."""
    host_proc, port = start_ring_host(SLOTS, SLOT_SIZE, token=TOKEN, claim_timeout=300)
    ctx = mp.get_context("spawn")
    procs: list[mp.process.BaseProcess] = []
    stall: subprocess.Popen[str] | None = None
    n_items, n_prod, n_cons = 300, 2, 2
    try:
        inspector = connect(
            "tcp", "127.0.0.1", port, layout=None, ring=RING, token=TOKEN, role="inspect"
        )
        if victim == "producer":
            stall, line = _stall_peer(port, "push-ticket")
            assert line.split()[1:] == ["0", str(stamp(0, SlotState.FREE))]
        elif victim == "consumer-on-empty":
            stall, line = _stall_peer(port, "pop-ticket")
            assert line.split()[1:] == ["0", str(stamp(0, SlotState.FREE))]
        prods = [
            ctx.Process(
                target=_producer,
                args=(port, SLOTS, SLOT_SIZE, i, n_items, None, 64, f"{tmp_path}/p{i}", TOKEN),
            )
            for i in range(n_prod)
        ]
        for p in prods:
            p.start()
        if victim == "consumer":
            wait_for(lambda: snapshot(inspector)["published"] == SLOTS, "a full ring", 120)
            stall, line = _stall_peer(port, "pop-ticket")
            assert line.split()[1:] == ["0", str(stamp(0, SlotState.PUBLISHED))]
        cons = [
            ctx.Process(target=_consumer, args=(port, SLOTS, SLOT_SIZE, f"{tmp_path}/c{i}", TOKEN))
            for i in range(n_cons)
        ]
        for p in cons:
            p.start()
        procs = prods + cons
        # Everyone else passes position 0 and stops a lap later at its slot: a dead
        # producer's position stays FREE(0) (4 and 5 published, nobody can use slot 0 again);
        # a dead consumer's item stays PUBLISHED(0) with all else consumed.
        stuck_at, stuck_published = ((4, 7), 2) if victim == "producer" else ((7, 7), 1)

        def stuck() -> bool:
            snap = snapshot(inspector)
            return (
                (snap["head"], snap["tail"]) == stuck_at
                and snap["published"] == stuck_published
                and snap["claimed"] == 0
            )

        wait_for(stuck, "the ring stuck behind the stalled claim", 120)
        time.sleep(0.5)
        assert stuck(), snapshot(inspector)
        assert stall is not None
        os.kill(stall.pid, signal.SIGKILL)
        stall.wait()
        for p in prods:
            p.join(60)
        assert [p.exitcode for p in prods] == [0] * n_prod
        driver = open_ring(port, SLOTS, SLOT_SIZE, TOKEN)
        for _ in range(n_cons):
            driver.push({"stop": True}, timeout=30)
        for p in cons:
            p.join(60)
        assert [p.exitcode for p in cons] == [0] * n_cons
        delivered = []
        for i in range(n_cons):
            raw = Path(f"{tmp_path}/c{i}").read_bytes()
            delivered += list(struct.unpack(f"<{len(raw) // 8}Q", raw))
        dup, missing, unexpected = check_delivery({i: n_items for i in range(n_prod)}, delivered)
        assert (dup, missing, unexpected) == (0, 0, 0)
        assert len(delivered) == n_prod * n_items
        repairs = snapshot(inspector)["repairs"]
        if victim == "producer":
            assert repairs == {"tombstoned": 1, "freed": 0, "peers_revoked": 1, "orphaned": 0}
        else:
            assert repairs == {"tombstoned": 0, "freed": 0, "peers_revoked": 1, "orphaned": 1}
        inspector.close()
        driver.verbs.close()
    finally:
        if stall is not None and stall.poll() is None:
            stall.kill()
            stall.wait()
        for p in procs:
            stop_process(p)
        stop_process(host_proc)
