"""Ownership without gaps and the retry budget, in-process: reconciliation against a real ring,
dropped items, late results, which lost attempts count (controller.ownership.coordinator,
controller.ownership.recovery, controller.ownership.budget, controller.ownership.reconcile).

Time is the test's: every coordinator here runs on a
:class:`~tests.support.coordinators.Clock` that the test moves on, so a lease or a grace
period expires exactly when the test says, never by sleeping (nor by chance on a slow
machine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from contracts.errors import PayloadCorrupt
from contracts.messages import Fault
from controller.ownership.coordinator import Coordinator
from controller.ownership.reconcile import census, ring_items
from controller.ownership.registry import WorkerInfo
from controller.tasks.tasks import Stage
from tests.support.coordinators import (
    PIPE,
    Clock,
    Rings,
    complete,
    ring_coordinator,
    task,
    workers,
)


def through(co: Coordinator, ws: tuple[WorkerInfo, ...], tid: str, attempt: int) -> None:
    """Run one attempt of ``tid`` through encoder and transformer (handoffs included)."""
    for w in ws[:2]:
        assert co.on_claim(w, tid, attempt)[0]
        co.on_handoff(w, tid, attempt)


def test_item_popped_and_never_claimed_is_put_back_after_the_grace(tmp_path: Path) -> None:
    """Window 2: the encoder pops the request and dies before its claim reaches us."""
    rings = Rings()
    clock = Clock()
    co = ring_coordinator(tmp_path, rings, lease=10.0, clock=clock)
    t = task("gap")
    co.submit(t)
    assert ("gap", 1) in ring_items(rings.local["request"])[0]
    now = clock()
    assert co.reconcile(co.census(), now) == 0  # type: ignore[misc]
    popped = rings.peer("request").try_pop()
    assert popped is not None and popped["task_id"] == "gap"  # ... and the popper dies
    assert co.reconcile(census(rings.local), now + 1) == 0  # missing, within the grace
    assert co.reconcile(census(rings.local), now + 10.5) == 0  # grace counts from first miss
    assert co.reconcile(census(rings.local), now + 11.5) == 1
    assert t.stage == Stage.QUEUED and t.attempt == 2 and t.failures == 0
    assert ("gap", 2) in ring_items(rings.local["request"])[0]  # back in its ring
    enc, _, _ = workers(co)
    assert co.on_claim(enc, "gap", 1)[0] is False  # a late claim of the old pop is refused
    assert co.recovery.counts["reconciled"] == 1


def test_claim_inside_the_grace_keeps_the_task(tmp_path: Path) -> None:
    rings = Rings()
    co = ring_coordinator(tmp_path, rings)
    enc, _, _ = workers(co)
    co.submit(task("slow"))
    now = 1000.0
    rings.peer("request").try_pop()
    co.reconcile(census(rings.local), now)
    assert co.on_claim(enc, "slow", 1)[0]  # the claim arrives: a lease owns it now
    assert co.reconcile(census(rings.local), now + 60) == 0


def test_phase_item_lost_is_put_back(tmp_path: Path) -> None:
    """The transformer pops the encoder's phase1 item and dies before claiming."""
    rings = Rings()
    co = ring_coordinator(tmp_path, rings, lease=1.0)
    enc, _, _ = workers(co)
    t = task("p1")
    co.submit(t)
    rings.peer("request").try_pop()
    assert co.on_claim(enc, "p1", 1)[0]
    producer = rings.peer("phase1", 8)
    assert producer.try_push({"kind": "phase1", "task_id": "p1", "attempt": 1}) is None
    co.on_handoff(enc, "p1", 1)
    now = 1000.0
    assert co.reconcile(census(rings.local), now + 5) == 0  # in the ring: owned by the slot
    rings.peer("phase1", 9).try_pop()
    co.reconcile(census(rings.local), now + 5)
    assert co.reconcile(census(rings.local), now + 6.5) == 1
    assert t.attempt == 2 and t.stage == Stage.QUEUED and t.failures == 0


def test_corrupt_slot_is_reported_and_reconciled(tmp_path: Path) -> None:
    """A peer holding the token overwrites a published request item: it names no task."""
    rings = Rings()
    co = ring_coordinator(tmp_path, rings, lease=1.0)
    enc, _, _ = workers(co)
    t = task("bad")
    co.submit(t)
    lay = rings.local["request"].layout
    rings.peer("request", 5).verbs.write(lay.payload_offset(0) + 24, b"\xff" * 16)
    items, unnamed = ring_items(rings.local["request"])
    assert items == set() and unnamed == 1
    with pytest.raises(PayloadCorrupt):
        rings.peer("request").try_pop()
    co.on_dropped(enc, "request", "corrupt payload", None, None)  # names nothing
    assert t.stage == Stage.QUEUED and t.attempt == 1
    now = 1000.0
    co.reconcile(census(rings.local), now)
    assert co.reconcile(census(rings.local), now + 1.5) == 1
    assert t.attempt == 2 and rings.peer("request").try_pop()["task_id"] == "bad"  # type: ignore[index]
    assert co.recovery.counts["dropped_items"] == 1


def test_dropped_item_that_names_its_task_is_retried_at_once(tmp_path: Path) -> None:
    co = ring_coordinator(tmp_path)
    enc, dit, _ = workers(co)
    t = task("kind")
    co.submit(t)
    assert co.on_claim(enc, "kind", 1)[0]
    co.on_handoff(enc, "kind", 1)
    co.on_dropped(dit, "phase1", "unexpected 'task' item", "other", 1)  # not this task
    co.on_dropped(dit, "phase1", "unexpected 'task' item", "kind", 9)  # not its attempt
    assert t.attempt == 1
    co.on_dropped(dit, "phase1", "malformed tensor descriptor", "kind", 1)
    assert t.attempt == 2 and t.stage == Stage.QUEUED and t.failures == 0
    assert "dropped its phase1 item: malformed tensor descriptor" in (t.error or "")


def test_system_faults_never_use_up_a_task(tmp_path: Path) -> None:
    """The reported failure mode: attempts lost to controller restarts, killed workers, lost
    items, dead producers and dropped items; the task still completes, charged nothing."""
    rings = Rings()
    clock = Clock()
    co = ring_coordinator(tmp_path, rings, clock=clock)
    ws = workers(co)
    enc, dit, dec = ws
    t = task("unlucky")
    co.submit(t)
    assert co.on_claim(enc, "unlucky", 1)[0]
    # 1: the controller restarts (SIGKILL): a new one replays the journal (the store's lock
    # dies with a killed process; here the old coordinator lets go of it).
    co.close()
    rings = Rings()
    co = ring_coordinator(tmp_path, rings, clock=clock)
    assert co.restore() == 1
    ws = enc, dit, dec = workers(co)
    t = co.table.get("unlucky")  # type: ignore[assignment]
    assert t.attempt == 2 and t.stage == Stage.QUEUED
    # 2: the transformer is killed (its connection drops).
    through(co, (enc,), "unlucky", 2)
    assert co.on_claim(dit, "unlucky", 2)[0]
    co.on_gone(dit, "control connection dropped")
    dit = co.on_register("transformer", "t2", 4, PIPE, "s4")
    # 3: the encoder stops heartbeating (SIGSTOP): its lease expires.
    assert co.on_claim(enc, "unlucky", 3)[0]
    co.sweep(clock.advance(10.5))
    assert t.attempt == 4
    # 4: the transformer's pull fails because its producer (the encoder) is gone.
    through(co, (enc,), "unlucky", 4)
    co.on_gone(enc, "control connection dropped")
    enc = co.on_register("encoder", "e2", 5, PIPE, "s5")
    assert co.on_claim(dit, "unlucky", 4)[0]
    co.on_fail(dit, "unlucky", 4, "mooncake read failed", "TransferFailed", True,
               Fault.TRANSFER)
    # 5: a worker reports a system failure (ring claim revoked, injected fault).
    assert co.on_claim(enc, "unlucky", 5)[0]
    co.on_fail(enc, "unlucky", 5, "claim revoked", "ConnectionLost", True, Fault.SYSTEM)
    # 6: another controller restart, then the item is popped and never claimed.
    co.close()
    rings = Rings()
    co = ring_coordinator(tmp_path, rings, clock=clock)
    co.restore()
    enc, dit, dec = workers(co)
    t = co.table.get("unlucky")  # type: ignore[assignment]
    rings.peer("request").try_pop()
    co.sweep(clock())  # missing from its ring from now on ...
    co.sweep(clock.advance(10.0))  # ... for the grace (lease_timeout_s): back in play
    n = t.attempt
    through(co, (enc, dit), "unlucky", n)
    assert co.on_claim(dec, "unlucky", n)[0]
    assert complete(co, dec, "unlucky", n, b"PNG")
    assert t.stage == Stage.COMPLETED and t.failures == 0, t.error
    assert n >= 4


def test_task_failures_count_and_are_bounded(tmp_path: Path) -> None:
    co = ring_coordinator(tmp_path, max_task_failures=3)
    enc, dit, _ = workers(co)
    t = task("raises")
    co.submit(t)
    for attempt in (1, 2, 3):
        through(co, (enc,), "raises", attempt)
        assert co.on_claim(dit, "raises", attempt)[0]
        co.on_fail(dit, "raises", attempt, "boom", "StageError", True, Fault.TASK)
    assert t.stage == Stage.FAILED and t.error_type == "retries_exhausted"
    assert "the task failed 3 times (max_task_failures=3)" in (t.error or "")
    assert "boom" in (t.error or "")
    bad = task("invalid")
    co.submit(bad)
    assert co.on_claim(enc, "invalid", 1)[0]
    co.on_fail(enc, "invalid", 1, "height must be a multiple of 16", "InvalidRequestError",
               False, Fault.INPUT)
    assert bad.stage == Stage.FAILED and bad.attempt == 1  # no point trying again


def test_transfer_failure_counts_while_the_producer_lives_and_is_refunded_when_it_dies(
        tmp_path: Path) -> None:
    co = ring_coordinator(tmp_path)
    enc, dit, _ = workers(co)
    t = task("xfer")
    co.submit(t)
    through(co, (enc,), "xfer", 1)
    assert co.on_claim(dit, "xfer", 1)[0]
    co.on_fail(dit, "xfer", 1, "read failed", "TransferFailed", True, Fault.TRANSFER)
    assert t.failures == 1 and t.attempt == 2  # the producer looked alive: counted
    co.on_gone(enc, "control connection dropped")  # ... it was dying
    assert t.failures == 0


def test_worker_that_comes_back_was_not_killed(tmp_path: Path) -> None:
    """A dropped control connection looks like a death until the same worker registers
    again: then it is taken off the task's killers, so drops never make poison."""
    co = ring_coordinator(tmp_path, poison_worker_deaths=2)
    t = task("flaky")
    co.submit(t)
    for attempt in (1, 2, 3):
        enc = co.on_register("encoder", "enc-host-42", 42, PIPE, "s")
        assert co.on_claim(enc, "flaky", attempt)[0]
        co.on_gone(enc, "control connection dropped")
        assert t.killers == ["enc-host-42"]
    assert t.stage == Stage.QUEUED and t.attempt == 4


def test_a_slow_worker_that_heartbeats_again_was_not_killed(tmp_path: Path) -> None:
    """A starved machine: the worker's heartbeats come late, its leases expire, but it is
    alive; that never makes the task poison."""
    clock = Clock()
    co = ring_coordinator(tmp_path, clock=clock, poison_worker_deaths=2)
    enc, _, _ = workers(co)
    t = task("starved")
    co.submit(t)
    for attempt in (1, 2, 3):
        assert co.on_claim(enc, "starved", attempt)[0]
        co.sweep(clock.advance(10.5))  # lease expired
        assert t.killers == ["e"]
        co.on_heartbeat(enc, [], [])  # ... and there it is again
        assert t.killers == []
    assert t.stage == Stage.QUEUED and t.attempt == 4


def test_poison_needs_deaths_in_a_row(tmp_path: Path) -> None:
    co = ring_coordinator(tmp_path, poison_worker_deaths=3)
    t = task("p")
    co.submit(t)
    names = iter(f"dit-{i}" for i in range(10))
    for attempt, system_in_between in ((1, False), (2, True), (3, False), (4, False),
                                       (5, False)):
        enc = co.on_register("encoder", next(names), 1, PIPE, "s")
        assert co.on_claim(enc, "p", attempt)[0]
        if system_in_between:
            co.on_fail(enc, "p", attempt, "claim revoked", "ConnectionLost", True, Fault.SYSTEM)
        else:
            co.on_gone(enc, "control connection dropped")
    assert t.stage == Stage.FAILED and t.error_type == "poison" and t.attempt == 5
    assert len(t.killers) == 3


def test_late_result_of_an_expired_lease_is_refused(tmp_path: Path) -> None:
    """A decoder SIGSTOPped past its lease wakes and sends its result: refused; the new
    attempt's result is the one completion."""
    clock = Clock()
    co = ring_coordinator(tmp_path, clock=clock)
    enc, dit, dec = workers(co)
    t = task("zombie")
    co.submit(t)
    through(co, (enc, dit), "zombie", 1)
    assert co.on_claim(dec, "zombie", 1)[0]
    co.sweep(clock.advance(9.5))
    assert t.attempt == 1  # the lease holds ...
    co.sweep(clock.advance(1.0))  # ... until it expires
    assert t.attempt == 2
    assert co.on_heartbeat(dec, ["zombie"], []) == (["zombie"], [])  # wakes: told to stop
    assert complete(co, dec, "zombie", 1, b"late") is False
    co.on_fail(dec, "zombie", 1, "late", "StageError", True, Fault.TASK)  # ignored too
    assert t.failures == 0 and t.stage == Stage.QUEUED
    dec2 = co.on_register("decoder", "d2", 9, PIPE, "s9")
    through(co, (enc, dit), "zombie", 2)
    assert co.on_claim(dec2, "zombie", 2)[0]
    assert complete(co, dec2, "zombie", 2, b"PNG")
    assert complete(co, dec2, "zombie", 2, b"again") is False
    assert t.stage == Stage.COMPLETED and (tmp_path / "zombie.png").read_bytes() == b"PNG"
