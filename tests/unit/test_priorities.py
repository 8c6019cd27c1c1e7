"""Priorities, in this process (controller.ownership.requeue, .priorities): queued work is
released highest class first and the rings stay shallow; a DiT's claim of a lower task is
deferred while a higher one waits encoded in the same ring; a task waiting too long behind
lower-priority work gets one DiT to yield at its next step boundary, uncharged, at most
``max_preemptions`` times. Time is the test's clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from contracts.config import ServiceConfig
from contracts.errors import ConfigError, InvalidRequestError
from contracts.messages import Fault
from contracts.priority import check_priority
from controller.ownership.coordinator import Coordinator
from controller.ownership.priorities import DEFERRED, MAX_DEFERRALS
from controller.ownership.registry import WorkerInfo
from controller.tasks.tasks import Stage, Task
from tests.support.coordinators import PIPE, Clock, Rings, ring_coordinator, task


def popped(rings: Rings, ring: str = "request") -> list[str]:
    out = []
    while (item := rings.peer(ring).try_pop()) is not None:
        out.append(item["task_id"])
    return out


def encoded(co: Coordinator, enc: WorkerInfo, tid: str) -> None:
    assert co.on_claim(enc, tid, 1)[0]
    co.on_handoff(enc, tid, 1)


def test_released_by_class_then_age_and_kept_shallow(tmp_path: Path) -> None:
    rings, clock = Rings(), Clock()
    # No worker yet: 1 ahead per class.
    co = ring_coordinator(tmp_path, rings, clock=clock, release_ahead=1)
    for tid, prio in (("l1", "low"), ("l2", "low"), ("n1", "normal"), ("h1", "high"),
                      ("h2", "high"), ("n2", "normal")):
        co.submit(task(tid, prio))
    # One of each class and up may be ahead: l1, then n1 (none of normal+ ahead), then h1.
    assert popped(rings) == ["l1", "n1", "h1"]
    assert [t.stage for t in co.table] == [Stage.QUEUED, Stage.ACCEPTED, Stage.QUEUED,
                                          Stage.QUEUED, Stage.ACCEPTED, Stage.ACCEPTED]
    enc = co.on_register("encoder", "e", 1, PIPE, "s1")  # the bound grows by one
    assert popped(rings) == ["h2"]  # the highest waiting first
    dit = co.on_register("transformer", "t", 2, PIPE, "s2")
    assert popped(rings) == []  # bound 3: n1, h1, h2 are ahead of a normal task already
    for tid in ("h1", "h2", "n1"):
        encoded(co, enc, tid)
    assert co.on_claim(dit, "h1", 1)[0]  # a DiT's claim makes room: the next class goes
    assert popped(rings) == ["n2"]
    assert co.on_claim(dit, "h2", 1)[0]
    assert popped(rings) == []  # l1, n1, n2 ahead of a low task
    assert co.on_claim(dit, "n1", 1)[0]
    assert popped(rings) == ["l2"]


def test_without_release_ahead_every_task_goes_at_once(tmp_path: Path) -> None:
    rings, clock = Rings(slots=2), Clock()
    co = ring_coordinator(tmp_path, rings, clock=clock)
    co.submit(task("a", "low"))
    co.submit(task("b", "high"))
    assert popped(rings) == ["a", "b"]


def test_a_dit_claim_is_deferred_while_a_higher_task_waits_encoded(tmp_path: Path) -> None:
    rings, clock = Rings(), Clock()
    co = ring_coordinator(tmp_path, rings, clock=clock)
    enc = co.on_register("encoder", "e", 1, PIPE, "s1")
    dit = co.on_register("transformer", "t", 2, PIPE, "s2")
    for tid, prio in (("low", "low"), ("high", "high")):
        co.submit(task(tid, prio))
        encoded(co, enc, tid)
    ok, why = co.on_claim(dit, "low", 1)
    assert not ok and why.startswith(DEFERRED) and "high task high" in why
    low = co.table.get("low")
    assert low is not None and low.stage == Stage.PHASE1 and low.worker_id is None
    assert co.on_claim(dit, "high", 1)[0]
    assert co.on_claim(dit, "low", 1)[0]  # nothing more urgent waits now


def test_an_old_attempts_item_is_refused_at_once_not_deferred(tmp_path: Path) -> None:
    """The claim of an item whose attempt has ended is refused (the worker frees what it
    pulled) even while a more urgent task waits: never put back in the ring for later."""
    rings, clock = Rings(), Clock()
    co = ring_coordinator(tmp_path, rings, clock=clock)
    enc = co.on_register("encoder", "e", 1, PIPE, "s1")
    dit = co.on_register("transformer", "t", 2, PIPE, "s2")
    for tid, prio in (("low", "low"), ("high", "high")):
        co.submit(task(tid, prio))
        encoded(co, enc, tid)
    ok, why = co.on_claim(dit, "low", 0)  # an attempt before the current one (1)
    assert not ok and not why.startswith(DEFERRED), why
    assert co.priorities.counts["deferred"] == 0


def test_deferrals_are_bounded(tmp_path: Path) -> None:
    """An urgent task whose item is lost (reconciliation puts it back later) cannot keep a
    DiT turning its ring: the claim goes through after MAX_DEFERRALS."""
    rings, clock = Rings(), Clock()
    co = ring_coordinator(tmp_path, rings, clock=clock)
    enc = co.on_register("encoder", "e", 1, PIPE, "s1")
    dit = co.on_register("transformer", "t", 2, PIPE, "s2")
    for tid, prio in (("low", "low"), ("lost", "high")):
        co.submit(task(tid, prio))
        encoded(co, enc, tid)
    answers = [co.on_claim(dit, "low", 1)[0] for _ in range(MAX_DEFERRALS + 1)]
    assert answers == [False] * MAX_DEFERRALS + [True]


def checkpointing(w: WorkerInfo) -> WorkerInfo:
    """A DiT that checkpoints, to a controller that keeps checkpoints (the store itself is
    tests/integration/test_checkpoint_store.py's: none here)."""
    w.checkpoints = True
    return w


def running(co: Coordinator, enc: WorkerInfo, dit: WorkerInfo, tid: str, prio: str,
            step: int = 2) -> Task:
    co.submit(task(tid, prio))
    encoded(co, enc, tid)
    assert co.on_claim(dit, tid, 1)[0]
    co.on_progress(dit, tid, 1, step, 10)
    t = co.table.get(tid)
    assert t is not None
    return t


def test_preemption_yields_the_lowest_uncharged_and_bounded(tmp_path: Path) -> None:
    rings, clock = Rings(), Clock()
    co = ring_coordinator(tmp_path, rings, clock=clock, preempt_after_s=5.0, max_preemptions=1)
    events: list[tuple[str, str]] = []
    co.listeners.append(lambda e, t: events.append((e, t.task_id)))
    enc = co.on_register("encoder", "e", 1, PIPE, "s1")
    d1 = checkpointing(co.on_register("transformer", "t1", 2, PIPE, "s2"))
    d2 = checkpointing(co.on_register("transformer", "t2", 3, PIPE, "s3"))
    low = running(co, enc, d1, "low", "low", step=2)
    normal = running(co, enc, d2, "normal", "normal", step=2)
    co.submit(task("high", "high"))
    encoded(co, enc, "high")
    co.sweep(clock.advance(4.9))
    assert not low.yield_requested  # not waited long enough yet
    co.sweep(clock.advance(0.2))
    assert low.yield_requested and not normal.yield_requested  # the lowest class goes
    assert co.priorities.asked(["low", "normal"]) == ["low"]
    co.sweep(clock.advance(1.0))
    assert not normal.yield_requested  # one yield outstanding per urgent task
    co.on_fail(d1, "low", 1, "handed back after step 3 of 10 (preempted)", "yielded", True,
               Fault.YIELDED)
    assert (low.attempt, low.failures, low.preemptions, low.killers) == (2, 0, 1, [])
    assert ("preempting", "low") in events and ("preempted", "low") in events
    assert co.on_claim(d1, "high", 1)[0]
    # low runs again (from its checkpoint, in the real thing); it may not be preempted twice.
    co.on_claim(enc, "low", 2)
    co.on_handoff(enc, "low", 2)
    co.on_handoff(d2, "normal", 1)
    assert co.on_claim(d2, "low", 2)[0]
    co.submit(task("high2", "high"))
    encoded(co, enc, "high2")
    co.sweep(clock.advance(10.0))
    assert not low.yield_requested and low.preemptions == 1


def test_no_preemption_with_a_free_dit_an_equal_class_or_no_checkpoints(
        tmp_path: Path) -> None:
    rings, clock = Rings(), Clock()
    co = ring_coordinator(tmp_path, rings, clock=clock, preempt_after_s=1.0)
    enc = co.on_register("encoder", "e", 1, PIPE, "s1")
    plain = co.on_register("transformer", "t1", 2, PIPE, "s2")  # does not checkpoint
    low = running(co, enc, plain, "low", "low")
    co.submit(task("high", "high"))
    encoded(co, enc, "high")
    co.sweep(clock.advance(5.0))
    assert not low.yield_requested  # it cannot yield
    idle = checkpointing(co.on_register("transformer", "t2", 3, PIPE, "s3"))
    co.sweep(clock.advance(5.0))
    assert not low.yield_requested  # a free DiT takes the urgent task instead
    assert co.on_claim(idle, "high", 1)[0]
    co.submit(task("high2", "high"))
    encoded(co, enc, "high2")
    co.sweep(clock.advance(5.0))
    high = co.table.get("high")
    assert high is not None and not high.yield_requested  # the same class is not preempted


def test_priority_values_and_settings_are_checked() -> None:
    assert check_priority(None) == "normal" and check_priority("high") == "high"
    with pytest.raises(InvalidRequestError, match="low, normal, high"):
        check_priority("urgent")
    for bad in ({"release_ahead": 0}, {"preempt_after_s": -1}, {"max_preemptions": -1}):
        with pytest.raises(ConfigError):
            ServiceConfig.from_dict(bad)


def test_split_preempts_only_a_dit_that_can_run_the_waiting_task(tmp_path: Path) -> None:
    """``split``: a task waiting in the Phase1 ring needs a high-noise DiT. An idle
    low-noise DiT is no free DiT for it (the busy high-noise one yields), and a task on a
    low-noise DiT is never asked to yield for it (it could not take the urgent one)."""
    rings, clock = Rings(), Clock()
    co = ring_coordinator(tmp_path, rings, clock=clock, preempt_after_s=1.0)
    enc = co.on_register("encoder", "e", 1, PIPE, "s1")
    high = checkpointing(co.on_register("transformer", "th", 2, PIPE, "s2", experts="high"))
    low_dit = checkpointing(co.on_register("transformer", "tl", 3, PIPE, "s3",
                                           experts="low"))
    on_high = running(co, enc, high, "on-high", "low")
    co.submit(task("urgent", "high"))
    encoded(co, enc, "urgent")
    co.sweep(clock.advance(5.0))
    assert on_high.yield_requested  # the idle low-noise DiT could not take "urgent"
    co.on_fail(high, "on-high", 1, "handed back (preempted)", "yielded", True, Fault.YIELDED)
    assert co.on_claim(high, "urgent", 1)[0]
    on_low = running(co, enc, low_dit, "on-low", "low")
    co.submit(task("urgent2", "high"))
    encoded(co, enc, "urgent2")
    co.sweep(clock.advance(5.0))
    assert not on_low.yield_requested  # its DiT could not run the urgent task
