"""The doorbell: idle workers wait on the control port instead of polling their ring.

In-process tests of :class:`controller.doorbell.Doorbell`; a real controller process for the
wait channel (:class:`workers.control.DoorbellClient`); a real worker for the drain path.
Every process started here is stopped here, by pid.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from contracts.errors import ControlRefused
from controller.doorbell import Doorbell, published
from launcher import LocalGroup, group_config
from rings.layout import HOLDER_LOCAL, RingLayout
from rings.ring import Ring
from rings.soak import stop_process as stop
from rings.verbs import LocalVerbs, Region
from tests.support.controller import (
    TOKEN,
    Controller,
    controller_config,
    ring_of,
    start_controller,
)
from workers.control import DoorbellClient
from workers.models.families.synthetic import write_config

pytestmark = pytest.mark.integration  # starts processes or servers


def local_ring(name: str) -> Ring:
    return Ring(LocalVerbs(Region(RingLayout(name, 4, 256)), HOLDER_LOCAL))


def test_doorbell_wakes_the_holder_of_the_published_position() -> None:
    """Idle consumers keep the pop ticket they took on an empty ring, so a pushed item is
    claimable only by the holder of its position: that waiter is woken, not the oldest (with
    many idle workers, waking the oldest cost seconds: the host had to give the ticket up)."""
    region = Region(RingLayout("request", 4, 256))
    producer = Ring(LocalVerbs(region, HOLDER_LOCAL))
    a, b = (Ring(LocalVerbs(region, peer)) for peer in (11, 12))
    assert a.try_pop() is None and b.try_pop() is None  # each now holds a ticket
    assert a.pop_ticket is not None and b.pop_ticket == a.pop_ticket + 1
    bell = Doorbell({"request": region_verbs(region)})

    async def scenario() -> None:
        told: list[str] = []
        # b waits first (the oldest), a holds the position the next push lands at.
        wb = asyncio.create_task(bell.wait("request", 5, lambda: told.append("b"), b.pop_ticket))
        await until(lambda: bell.waiting("request") == 1)
        wa = asyncio.create_task(bell.wait("request", 5, lambda: told.append("a"), a.pop_ticket))
        await until(lambda: bell.waiting("request") == 2)
        producer.push({"id": 1})
        assert bell.ring("request") == 1 and told == ["a"]
        await until(wa.done)
        assert not wb.done()
        assert a.try_pop() == {"id": 1}  # the woken worker claims it at once
        # A wait that arrives with the position already published returns at once; one
        # holding another position keeps waiting.
        producer.push({"id": 2})
        # (a wait that had to run into its timeout would answer False)
        assert await bell.wait("request", 60, None, b.pop_ticket) is True
        assert await bell.wait("request", 0.05, None, (b.pop_ticket or 0) + 7) is False
        wb.cancel()

    asyncio.run(scenario())


async def until(cond: Callable[[], bool], timeout: float = 60) -> None:
    """Let the loop run until ``cond`` holds: the event a step waits for, not a guess."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition never reached"
        await asyncio.sleep(0)


def region_verbs(region: Region) -> LocalVerbs:
    return LocalVerbs(region, HOLDER_LOCAL)


def test_doorbell_wakes_one_waiter_per_item_oldest_first() -> None:
    rings = {n: local_ring(n) for n in ("request", "phase1")}
    bell = Doorbell({n: r.verbs for n, r in rings.items()})

    async def scenario() -> None:
        # Nothing published: a wait runs into its timeout and leaves no waiter behind.
        t0 = time.monotonic()
        assert await bell.wait("request", 0.1) is False
        assert time.monotonic() - t0 >= 0.09 and bell.waiting("request") == 0
        # Three waiters. A ring for an item already gone wakes nobody; one item announced
        # wakes only the oldest, and its on_ring runs inside ring() itself (the control
        # server sends the wake-up from there).
        told: list[int] = []
        waits = [asyncio.create_task(bell.wait("request", 5, lambda i=i: told.append(i)))
                 for i in range(3)]
        await until(lambda: bell.waiting("request") == 3)
        assert bell.ring("request") == 0 and told == []
        rings["request"].push({"id": 1})
        assert bell.ring("request") == 1 and told == [0]
        await until(waits[0].done)
        assert [w.done() for w in waits] == [True, False, False] and waits[0].result()
        assert bell.ring("phase1", 5) == 0  # nobody waits there: nothing happens
        # A published item answers a wait at once, without any ring.
        assert published(rings["request"].verbs) == 1
        assert await bell.wait("request", 60) is True
        # The sweep rings for items nobody announced, one waiter per item.
        bell.sweep()
        await until(waits[1].done)
        assert [w.done() for w in waits] == [True, True, False] and told == [0, 1]
        rings["request"].pop()
        bell.sweep()  # nothing published any more: the last waiter keeps waiting
        assert bell.waiting("request") == 1 and told == [0, 1]
        await asyncio.sleep(0)  # a wake-up sent would be delivered by now
        assert not waits[2].done()
        waits[2].cancel()
        with pytest.raises(asyncio.CancelledError):
            await waits[2]
        assert bell.waiting("request") == 0
        with pytest.raises(ValueError, match="no ring 'nope'"):
            await bell.wait("nope", 1)

    asyncio.run(scenario())


def test_a_wait_that_crosses_its_wake_up_is_served() -> None:
    """A worker sends its next wait the instant it reads a wake-up. When those bytes are in
    before the controller has resumed from the wait it answered (a busy controller), they
    are that next wait, not the connection ending: the controller used to drop the doorbell
    there (seen on a loaded machine: the worker's wait got "ring host closed the
    connection"). Made to happen here by holding the controller's loop until the next wait
    was sent."""
    from contracts.messages import Op
    from controller.control import ControlServer
    from rings import wire
    from rings.handshake import recv_frame
    from tests.support.coordinators import make_coordinator

    rings = {n: local_ring(n) for n in ("request", "phase1", "phase2")}
    bell = Doorbell({n: r.verbs for n, r in rings.items()})
    sent = threading.Event()
    replies: list[dict[str, object]] = []

    def worker(port: int) -> None:
        client = DoorbellClient("127.0.0.1", port, TOKEN)
        client.connect("encoder")
        try:
            assert client.wait("request", 30) is True
            sock = client._sock
            assert sock is not None
            sock.sendall(wire.pack_msg({"op": Op.WAIT.value, "seq": 99, "ring": "request",
                                        "timeout_s": 30, "ticket": None}))
            sent.set()
            replies.append(wire.unpack_msg(recv_frame(sock)))
        finally:
            sent.set()
            client.close()

    async def scenario() -> None:
        server = ControlServer(make_coordinator(None, rings["request"]), "127.0.0.1", 0,
                               TOKEN, bell)
        await server.start()
        try:
            thread = threading.Thread(target=worker, args=(server.port,))
            thread.start()
            await until(lambda: bell.waiting("request") == 1)
            rings["request"].push({"id": 1})
            assert bell.ring("request") == 1  # the answer leaves from inside ring()
            # The loop stays here, on purpose, until the worker's next wait is in.
            assert sent.wait(60)
            await asyncio.to_thread(thread.join, 60)
        finally:
            await server.close()

    asyncio.run(scenario())
    # Answered at once: the item is still published.
    assert replies == [{"seq": 99, "ok": True, "wake": True}]


@pytest.fixture
def big_controller(tmp_path: Path) -> Iterator[Controller]:
    # 4 KiB slots: room for a whole task descriptor posted through the front door.
    cfg = controller_config(tmp_path, slots=4, slot_size=4096)
    cfg["output_dir"] = str(tmp_path / "results")  # its own journal: nothing restored
    ctl = start_controller(tmp_path, cfg)
    try:
        yield ctl
    finally:
        stop(ctl.proc)


def _client(ctl: Controller) -> DoorbellClient:
    bell = DoorbellClient("127.0.0.1", ctl.config["disagg_config"]["control_port"], TOKEN)
    bell.connect("encoder")
    return bell


def _timed(fn: object, *args: object) -> tuple[object, float]:
    t0 = time.monotonic()
    out = fn(*args)  # type: ignore[operator]
    return out, time.monotonic() - t0


WAIT_S = 120.0
"""Waits that must end early: one that ran into this timeout would answer False."""


@pytest.mark.timeout(600)
def test_wait_channel_of_a_controller(big_controller: Controller) -> None:
    ctl = big_controller
    url = f"http://127.0.0.1:{ctl.config['server']['port']}"
    bell = _client(ctl)
    try:
        woke, took = _timed(bell.wait, "request", 0.3)
        assert woke is False and took >= 0.25

        # A task posted while the worker waits wakes it (the controller's own push).
        body = {"prompt": "wake", "height": 32, "width": 32, "target_video_length": 5,
                "infer_steps": 1}
        poster = threading.Timer(0.3, lambda: httpx.post(f"{url}/v1/tasks/video/", json=body,
                                                         timeout=30).raise_for_status())
        poster.start()
        # (A wait that ran into its timeout answers False: what it says is what happened, no
        # clock needed.)
        woke, took = _timed(bell.wait, "request", WAIT_S)
        poster.join()
        assert woke is True
        # The item is still there: a new wait returns at once.
        woke, took = _timed(bell.wait, "request", WAIT_S)
        assert woke is True
        req = ring_of(ctl, "request")
        assert req.pop(timeout=2)["kind"] == "task"

        # An item pushed by a peer that never reports it (no handoff): the sweep rings.
        phase1 = ring_of(ctl, "phase1")
        threading.Timer(0.3, lambda: phase1.push({"kind": "phase1"}, timeout=2)).start()
        woke, took = _timed(bell.wait, "phase1", WAIT_S)
        assert woke is True

        # interrupt() ends a wait at once (a draining worker does not sit out its timeout).
        threading.Timer(0.2, bell.interrupt).start()
        woke, took = _timed(bell.wait, "phase2", WAIT_S)
        assert woke is None and took < WAIT_S
        bell.connect("encoder")
        with pytest.raises(ControlRefused, match="no ring 'nope'"):
            bell.wait("nope", 1)
    finally:
        bell.close()


@pytest.mark.timeout(180)
def test_idle_worker_drains_on_sigterm(tmp_path: Path) -> None:
    """SIGTERM reaches a worker waiting on its doorbell: it exits cleanly (that the wait
    ends at once is test_drain_ends_a_doorbell_wait_at_once, without a clock)."""
    model = tmp_path / "synthetic"
    write_config(model, encoder_s=0, step_s=0, decoder_s=0)
    cfg = group_config("synthetic", str(model), tmp_path, staging_pool_mb=4)
    with LocalGroup(cfg, tmp_path) as group:
        group.start("controller")
        group.wait_http()
        worker = group.start("transformer")
        group.wait_workers({"transformer": 1})
        worker.proc.send_signal(signal.SIGTERM)
        assert worker.proc.wait(timeout=60) == 0
        assert "draining" in worker.log()


def test_drain_ends_a_doorbell_wait_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """An idle worker inside a doorbell wait of 5 minutes: drain() (what SIGTERM calls)
    ends it at once. A worker that sat the wait out would still be in it when the join
    below gives up."""
    import socket

    import workers.idle as idle_mod
    from contracts.config import ServiceConfig
    from contracts.roles import Role
    from rings import wire
    from rings.handshake import recv_frame
    from workers.worker import StageWorker, State

    class Idle(StageWorker):
        role = Role.TRANSFORMER

    monkeypatch.setattr(idle_mod, "IDLE_WAIT_S", 300.0)
    w = Idle(ServiceConfig(), TOKEN, {})
    ours, controller = socket.socketpair()
    w.link.doorbell._sock = ours  # as connect() leaves it, minus the handshake
    w.state = State.RUNNING
    waiting = threading.Thread(target=w.idle.wait, args=(local_ring("phase1"), w.running))
    waiting.start()
    try:
        asked = wire.unpack_msg(recv_frame(controller))  # the wait has been sent
        assert asked["op"] == "wait" and asked["timeout_s"] == 300.0
        w.drain()
        waiting.join(60)
        assert not waiting.is_alive(), "drain() did not end the doorbell wait"
    finally:
        w.idle.interrupt()
        waiting.join(60)
        controller.close()


def test_a_slow_controller_is_waited_for_not_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """An answer later than the wait's timeout (a starved controller) is not a lost
    controller: the worker polls its ring once and goes on waiting for that answer, without
    asking again."""
    import socket

    import workers.control as control
    from rings import wire
    from rings.handshake import recv_frame

    monkeypatch.setattr(control, "REPLY_SLACK_S", 0.1)
    bell = DoorbellClient("127.0.0.1", 9, TOKEN)
    ours, controller = socket.socketpair()
    bell._sock = ours  # as connect() leaves it, minus the handshake
    try:
        woke, took = _timed(bell.wait, "phase1", 0.1)
        assert woke is False and took >= 0.15
        asked = wire.unpack_msg(recv_frame(controller))
        assert asked["op"] == "wait" and asked["ring"] == "phase1"
        controller.sendall(wire.pack_msg({"seq": asked["seq"], "ok": True, "wake": True}))
        assert bell.wait("phase1", 0.1) is True
        controller.setblocking(False)
        with pytest.raises(BlockingIOError):
            controller.recv(1)  # the second call asked nothing new
    finally:
        bell.close()
        controller.close()
