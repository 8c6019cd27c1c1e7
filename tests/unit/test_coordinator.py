"""Task lifecycle in the coordinator, in-process: claims, handoffs, leases, requeue, journal."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from controller.errors import QueueFull
from controller.metrics import ControllerMetrics
from controller.ownership.coordinator import Coordinator
from controller.tasks.tasks import Stage
from tests.support.coordinators import Clock, complete, queue_coordinator, task, workers


def watch(co: Coordinator) -> tuple[list[str], CollectorRegistry]:
    """The events ``co`` fires from now on, and the registry of its metrics."""
    registry = CollectorRegistry()
    ControllerMetrics(co, registry)
    events: list[str] = []
    co.listeners.append(lambda event, _t: events.append(event))
    return events, registry


def test_full_lifecycle_and_idempotent_completion(tmp_path: Path) -> None:
    co = queue_coordinator(tmp_path)
    enc, dit, dec = workers(co)
    t = task("a")
    co.submit(t)
    assert t.stage == Stage.QUEUED
    assert co.on_claim(enc, "a", 1) == (True, "ok") and t.stage == Stage.ENCODING
    co.on_handoff(enc, "a", 1)
    assert t.stage == Stage.PHASE1
    assert co.on_claim(dit, "a", 1)[0] and t.stage == Stage.DENOISING
    assert co.on_progress(dit, "a", 1, 3, 10) is False and (t.step, t.steps) == (3, 10)
    co.on_handoff(dit, "a", 1)
    assert co.on_claim(dec, "a", 1)[0]
    assert complete(co, dec, "a", 1, b"PNG") is True
    assert complete(co, dec, "a", 1, b"again") is False
    assert t.stage == Stage.COMPLETED and (tmp_path / "a.png").read_bytes() == b"PNG"
    co.close()


def test_next_stage_may_claim_before_the_handoff_message(tmp_path: Path) -> None:
    """The transformer publishes to phase2, then reports the handoff; the decoder can claim
    the ring item in between. That claim must win, and the late handoff be ignored."""
    co = queue_coordinator(tmp_path)
    enc, dit, dec = workers(co)
    t = task("race")
    co.submit(t)
    co.on_claim(enc, "race", 1)
    assert co.on_claim(dit, "race", 1)[0]  # before the encoder's handoff arrived
    assert co.on_claim(dec, "race", 1)[0]  # before the transformer's handoff arrived
    co.on_handoff(dit, "race", 1)
    co.on_handoff(enc, "race", 1)
    assert t.stage == Stage.DECODING and t.worker == "d"
    assert list(t.stage_times) == ["queued", "encoding", "phase1", "denoising", "phase2",
                                   "decoding"]


def test_stale_and_cancelled_claims_are_refused(tmp_path: Path) -> None:
    co = queue_coordinator(tmp_path)
    enc, dit, _dec = workers(co)
    t = task("s")
    co.submit(t)
    co.on_claim(enc, "s", 1)
    co.on_gone(enc, "control connection dropped")  # back in play as attempt 2
    assert t.attempt == 2 and t.stage == Stage.QUEUED
    assert co.on_claim(dit, "s", 1) == (False, "stale attempt 1 (current attempt is 2)")
    assert co.cancel(t) == "success" and t.stage == Stage.CANCELLED
    enc2 = co.on_register("encoder", "e2", 4, "qwen_t2i", "s4")
    ok, why = co.on_claim(enc2, "s", 2)
    assert not ok and "cancelled" in why
    assert co.on_claim(enc2, "nope", 1) == (False, "unknown task")


def test_a_cancelled_task_fires_cancelled_once(tmp_path: Path) -> None:
    """A queued task cancelled by the client is over at once; each later claim of its
    leftover ring item is refused, and says nothing more: one "cancelled" event, counted
    once in ``diffring_task_events_total``."""
    co = queue_coordinator(tmp_path)
    events, registry = watch(co)
    enc, _, _ = workers(co)
    enc2 = co.on_register("encoder", "e2", 4, "qwen_t2i", "s4")
    t = task("q")
    co.submit(t)
    assert co.cancel(t) == "success" and t.stage == Stage.CANCELLED
    for worker in (enc, enc2, enc):  # the item, put back or claimed again
        assert co.on_claim(worker, "q", 1) == (False, "task is cancelled")
    assert events == ["queued", "cancelled"]
    assert registry.get_sample_value("diffring_task_events_total", {"event": "cancelled"}) == 1


def test_a_task_cancelled_between_stages_fires_cancelled_at_the_refused_claim(
        tmp_path: Path) -> None:
    """Cancelled while encoding (a worker held it), it ends when the next stage claims it:
    that refused claim fires "cancelled", and only that one."""
    co = queue_coordinator(tmp_path)
    events, registry = watch(co)
    enc, dit, _ = workers(co)
    dit2 = co.on_register("transformer", "t2", 5, "qwen_t2i", "s5")
    t = task("h")
    co.submit(t)
    co.on_claim(enc, "h", 1)
    assert co.cancel(t) == "success" and t.stage == Stage.ENCODING
    co.on_handoff(enc, "h", 1)
    assert co.on_claim(dit, "h", 1) == (False, "task was cancelled")
    assert t.stage == Stage.CANCELLED
    assert co.on_claim(dit2, "h", 1) == (False, "task is cancelled")
    assert events == ["queued", "claimed", "handoff", "cancelled"]
    assert registry.get_sample_value("diffring_task_events_total", {"event": "cancelled"}) == 1


def test_running_task_cancel_reaches_the_worker(tmp_path: Path) -> None:
    co = queue_coordinator(tmp_path)
    enc, dit, _ = workers(co)
    t = task("c")
    co.submit(t)
    co.on_claim(enc, "c", 1)
    co.on_handoff(enc, "c", 1)
    co.on_claim(dit, "c", 1)
    assert co.cancel(t) == "success" and t.stage == Stage.DENOISING  # stops at a step
    assert co.on_progress(dit, "c", 1, 4, 10) is True
    assert co.on_heartbeat(dit, ["c"], []) == (["c"], [])
    co.on_fail(dit, "c", 1, "stopped", "cancelled", False)
    assert t.stage == Stage.CANCELLED


def test_expired_leases_in_a_row_quarantine_the_task_as_poison(tmp_path: Path) -> None:
    clock = Clock()
    co = queue_coordinator(tmp_path, lease=10.0, clock=clock)
    enc, _, _ = workers(co)
    t = task("l")
    co.submit(t)
    for attempt in range(1, 4):
        assert co.on_claim(enc, "l", attempt)[0]
        co.sweep(clock.advance(9.9))
        assert t.attempt == attempt  # within the lease
        co.sweep(clock.advance(0.2))
    assert t.stage == Stage.FAILED and t.error_type == "poison", t.error
    assert "quarantined as poison: its last 3 attempts each lost the worker" in (t.error or "")
    assert "lease of worker e expired while encoding" in (t.error or "")
    assert t.failures == 0


def test_heartbeat_frees_outputs_nobody_will_pull(tmp_path: Path) -> None:
    co = queue_coordinator(tmp_path)
    enc, _, _ = workers(co)
    t = task("h")
    co.submit(t)
    co.on_claim(enc, "h", 1)
    co.on_handoff(enc, "h", 1)
    assert co.on_heartbeat(enc, [], [("h", 1)]) == ([], [])  # still wanted
    co.cancel(t)
    assert co.on_heartbeat(enc, [], [("h", 1), ("gone", 1)]) == ([], [("h", 1), ("gone", 1)])


def test_heartbeat_frees_a_superseded_attempt_but_not_the_current_one(tmp_path: Path) -> None:
    """An encoder holds attempt 1's outputs (their DiT died before pulling them) beside
    attempt 2's, which the next DiT is about to read: only attempt 1's are to be freed."""
    co = queue_coordinator(tmp_path)
    enc, dit, _ = workers(co)
    t = task("s")
    co.submit(t)
    co.on_claim(enc, "s", 1)
    co.on_handoff(enc, "s", 1)
    assert co.on_claim(dit, "s", 1)[0]
    co.on_gone(dit, "control connection dropped")  # died before its pull: nothing released
    assert t.attempt == 2
    co.on_claim(enc, "s", 2)
    co.on_handoff(enc, "s", 2)
    assert co.on_heartbeat(enc, [], [("s", 1), ("s", 2)]) == ([], [("s", 1)])


def test_full_ring_refuses_without_keeping_anything(tmp_path: Path) -> None:
    co = queue_coordinator(tmp_path, slots=2)
    co.submit(task("1"))
    co.submit(task("2"))
    with pytest.raises(QueueFull):
        co.submit(task("3"))
    assert [t.task_id for t in co.table] == ["1", "2"]
    co.close()
    # ... and the journal does not resurrect it after a restart.
    again = queue_coordinator(tmp_path, slots=8)
    assert again.restore() == 2 and sorted(t.task_id for t in again.table) == ["1", "2"]
    again.close()


def test_journal_restores_finished_and_requeues_unfinished(tmp_path: Path) -> None:
    co = queue_coordinator(tmp_path)
    enc, dit, dec = workers(co)
    done, running = task("done"), task("running")
    co.submit(done)
    co.submit(running)
    for w in (enc, dit, dec):
        co.on_claim(w, "done", 1)
        if w is not dec:
            co.on_handoff(w, "done", 1)
    complete(co, dec, "done", 1, b"x")
    co.on_claim(enc, "running", 1)
    # The controller dies here. A new one reads the journal:
    co.close()
    co2 = queue_coordinator(tmp_path)
    assert co2.restore() == 1
    r = co2.table.get("running")
    assert r is not None and r.stage == Stage.QUEUED and r.attempt == 2
    # A finished task stays in the store (not in memory) and is still found there.
    assert co2.table.get("done") is None
    d = co2.table.lookup("done")
    assert d is not None and d.stage == Stage.COMPLETED and d.result_path
    assert co2.table.counts()["completed"] == 1
    co2.close()
    # Restarting twice still loses nothing, and keeps one row per task.
    co3 = queue_coordinator(tmp_path)
    assert co3.restore() == 1
    assert co3.table.page(None, 0, 10)[0] == 2
    r3 = co3.table.get("running")
    assert r3 is not None and r3.attempt == 3
    co3.close()


def test_work_is_announced_and_only_live_tasks_are_scanned(tmp_path: Path) -> None:
    """Every push the controller makes or hears of is announced (the doorbell rings on it);
    heartbeats and the in-flight count look at unfinished tasks only."""
    co = queue_coordinator(tmp_path)
    rung: list[str] = []
    co.on_work = rung.append
    enc, dit, dec = workers(co)
    for i in range(3):
        tid = f"w{i}"
        co.submit(task(tid))
        co.on_claim(enc, tid, 1)
        co.on_handoff(enc, tid, 1)
        co.on_claim(dit, tid, 1)
        co.on_handoff(dit, tid, 1)
        co.on_claim(dec, tid, 1)
        if i < 2:
            complete(co, dec, tid, 1, b"PNG")
    assert rung == ["request", "phase1", "phase2"] * 3
    assert co.table.in_flight() == 1 and [t.task_id for t in co.leases.held_by(dec.worker_id)] \
        == ["w2"]
    co.on_heartbeat(dec, ["w2"], [])
    assert co.table.get("w2").lease_expires is not None  # type: ignore[union-attr]
    co.on_fail(dec, "w2", 1, "boom", "StageError", retryable=True)  # back in play: pushed
    assert rung[-1] == "request" and co.table.in_flight() == 1
