"""The worker's pull loop in-process, with a fake control channel and transport
(tests/support/fakes.py): heartbeats while draining, items it cannot run, a lost control
channel, failure triage, staging the same attempt twice."""

from __future__ import annotations

import threading
import time

import pytest

from contracts.config import ServiceConfig
from contracts.errors import ConnectionLost, InvalidRequestError, StageError
from contracts.messages import Fault, Op
from contracts.roles import Role
from rings.layout import RingLayout
from rings.ring import Ring
from rings.verbs import LocalVerbs, Region
from tensorplane.errors import ChecksumMismatch, PoolExhausted, TransferFailed
from tests.support.fakes import FakeControl, FakeTransport
from workers.triage import check_item, describe_failure
from workers.worker import Idle, StageWorker, State

CFG = ServiceConfig(model_cls="qwen_image", task="t2i")


class Worker(StageWorker):
    role = Role.TRANSFORMER


def worker() -> tuple[Worker, FakeControl, Ring]:
    w = Worker(CFG, "token", {})
    fake = FakeControl()
    w.link.control = fake
    region = Region(RingLayout("phase1", 4, 1024))
    w.link.in_ring = Ring(LocalVerbs(region, 3))
    return w, fake, Ring(LocalVerbs(region, 4))


def test_drain_does_not_turn_heartbeats_into_a_busy_loop() -> None:
    """drain() wakes the pull loop; the heartbeat thread must keep its own pace (it used to
    wait on the same event, which drain leaves set: heartbeats back to back)."""
    w, fake, _ = worker()
    interval = 0.2
    w.state = State.RUNNING
    w.link.heartbeats.start(interval, interval)  # holding or not: the same pace
    try:
        wait_heartbeats(fake, 1)
        w.drain()  # a task is still running: heartbeats must go on, at their interval
        before = len(fake.sent(Op.HEARTBEAT))
        t0 = time.monotonic()
        wait_heartbeats(fake, before + 4)  # they go on ...
        took = time.monotonic() - t0
    finally:
        w.close()
    # ... and no faster than their interval (a busy loop sends 4 within microseconds; a
    # loaded machine can only make them slower, which this does not bound).
    assert took >= 3 * interval * 0.9, f"4 heartbeats in {took:.3f} s at a {interval} s interval"


def wait_heartbeats(fake: FakeControl, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while len(fake.sent(Op.HEARTBEAT)) < n:
        assert time.monotonic() < deadline, f"fewer than {n} heartbeats in {timeout} s"
        time.sleep(0.01)


def test_items_it_cannot_run_are_reported_not_run() -> None:
    w, fake, producer = worker()
    good = {"kind": "phase1", "task_id": "t", "attempt": 1, "pipeline": "qwen_t2i",
            "request": {}, "tensors": []}
    producer.push({**good, "kind": "task"})
    producer.push({**good, "task_id": 7})
    producer.push({**good, "tensors": [{"name": "x"}]})
    producer.push(good)
    assert [w.claim() for _ in range(3)] == [Idle.SKIPPED] * 3
    dropped = fake.sent(Op.DROPPED)
    assert [d["task_id"] for d in dropped] == ["t", None, "t"]
    assert "unexpected 'task' item" in dropped[0]["reason"]
    assert "malformed tensor descriptor" in dropped[2]["reason"]
    assert fake.sent(Op.CLAIM) == []
    job = w.claim()
    assert not isinstance(job, Idle) and job.task_id == "t"


def test_corrupt_slot_is_reported_with_its_slot() -> None:
    w, fake, producer = worker()
    producer.push({"kind": "phase1", "task_id": "t", "attempt": 1})
    lay = producer.layout
    producer.verbs.write(lay.payload_offset(0) + 30, b"\x00garbage")
    assert w.claim() is Idle.SKIPPED
    (report,) = fake.sent(Op.DROPPED)
    assert report["task_id"] is None and report["slot"] == 0 and report["ring"] == "phase1"
    assert "corrupt payload" in report["reason"]


def test_nothing_is_popped_while_the_control_channel_is_down() -> None:
    w, _, producer = worker()
    producer.push({"kind": "phase1", "task_id": "t", "attempt": 1, "pipeline": "qwen_t2i",
                   "request": {}, "tensors": []})
    w.link.heartbeats.lost.set()  # what a failed heartbeat does
    with pytest.raises(ConnectionLost):
        w.claim()
    assert producer.try_pop() is not None  # still in its ring


@pytest.mark.parametrize(("exc", "fault"), [
    (TransferFailed("read failed", nbytes=8), Fault.TRANSFER),
    (ChecksumMismatch("bad", expected=1, actual=2), Fault.TASK),
    (PoolExhausted("full", requested=1, free_bytes=0), Fault.SYSTEM),
    (ConnectionLost("ring claim revoked"), Fault.SYSTEM),
    (StageError("boom"), Fault.TASK),
    (RuntimeError("CUDA out of memory"), Fault.TASK),
    (InvalidRequestError("height must be a multiple of 16"), Fault.INPUT),
])
def test_failure_triage(exc: Exception, fault: Fault) -> None:
    assert describe_failure(exc)[2] == fault


def test_check_item_accepts_a_well_formed_item() -> None:
    item = {"kind": "task", "task_id": "a", "attempt": 2, "pipeline": "qwen_t2i",
            "request": {}, "image": None}
    assert check_item(item, Role.ENCODER, "qwen_t2i") is None
    assert "serves qwen_t2i" in (check_item({**item, "pipeline": "wan_t2v"}, Role.ENCODER,
                                            "qwen_t2i") or "")
    assert "attempt" in (check_item({**item, "attempt": True}, Role.ENCODER, "qwen_t2i") or "")


def test_a_handshake_reset_by_a_dying_controller_is_a_lost_connection() -> None:
    """A controller killed (or just starting) resets the worker's control handshake: that is
    ConnectionLost, which the worker waits out and retries, not a start-up failure."""
    import socket
    import struct

    from workers.control import ControlClient

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def reset_one() -> None:
        conn, _ = server.accept()
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        # RST, before any greeting. Whether the worker is already waiting for the greeting
        # or has not asked yet, its read meets the reset: no need to time it.
        conn.close()

    t = threading.Thread(target=reset_one)
    t.start()
    try:
        with pytest.raises(ConnectionLost):
            ControlClient("127.0.0.1", server.getsockname()[1], "token", timeout=10).connect(
                "encoder")
    finally:
        t.join()
        server.close()


def test_the_same_attempt_staged_again_frees_the_first_copy() -> None:
    """A restarted controller numbers attempts from its journal and may hand a producer an
    attempt it already staged outputs for; the first copy must not stay in the pool."""
    import torch

    from tensorplane.pool import StagingPool
    from workers.roles import EncoderWorker
    from workers.worker import Job

    engine = FakeTransport()
    pool = StagingPool(1 << 20)
    pool.start(engine)
    try:
        w = EncoderWorker(CFG, "token", {})
        w.engine, w.pool = engine, pool
        w.link.out_ring = Ring(LocalVerbs(Region(RingLayout("phase1", 4, 1024)), 3))
        job = Job("t", 2, {"pipeline": "qwen_t2i", "request": {}})
        outputs = {"prompt_embeds": torch.ones(8, 256)}
        w.publish(job, outputs)
        once = pool.stats().used_bytes
        w.publish(job, outputs)  # the same (task, attempt), from a new controller
        assert pool.stats().used_bytes == once == 8192
    finally:
        pool.close()
        engine.close()
