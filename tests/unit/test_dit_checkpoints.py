"""A DiT's side of checkpoints, in this process (workers.checkpoints): when one is due, one
in flight at most (a due one waits for the next boundary), none after the last step, the
yield at a step boundary (kept: the loop ends; refused: it goes on), and a loop whose state
cannot be captured running on without checkpoints."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from contracts.errors import CheckpointError, StageYielded
from contracts.stage_options import StageOptions
from workers.checkpoints import DitCheckpoints, JobHooks, Pending, Policy
from workers.metrics import WorkerMetrics
from workers.models.loop_state import LoopState


class Job:
    task_id = "t"
    attempt = 1
    phase1_kept = False

    def __init__(self) -> None:
        self.yield_asked = threading.Event()


class FakeSender:
    """Stands for the Sender thread: records what it is given; ``busy`` and ``keeps`` say
    how it behaves."""

    def __init__(self) -> None:
        self.submitted: list[Pending] = []
        self.sent: list[Pending] = []
        self.is_busy = False
        self.keeps = True

    def busy(self) -> bool:
        return self.is_busy

    def submit(self, pending: Pending) -> None:
        self.submitted.append(pending)

    def wait_idle(self, timeout: float = 60.0) -> None:
        self.is_busy = False

    def send(self, pending: Pending) -> bool:
        self.sent.append(pending)
        return self.keeps


def hooks(every_steps: int | None = 2, reason: Callable[[], str | None] = lambda: None
          ) -> tuple[JobHooks, FakeSender, Job]:
    owner = DitCheckpoints(StageOptions(checkpoint_every_steps=every_steps),
                           WorkerMetrics("transformer"), "t")
    sender = FakeSender()
    owner.sender = sender  # type: ignore[assignment]
    job = Job()
    return JobHooks(owner, job, {"prompt_embeds": np.zeros(4)}, None, reason), sender, job


def snap(step: int) -> Callable[[], LoopState]:
    return lambda: LoopState(step, 6, {"latents": np.full(4, step)})


def test_policy_by_steps_and_by_time() -> None:
    p = Policy(None, 3)
    p.start(0)
    assert [s for s in range(1, 10) if p.due(s, 9)] == [3, 4, 5, 6, 7, 8]  # until taken
    p.taken(3)
    assert [s for s in range(4, 10) if p.due(s, 9)] == [6, 7, 8]
    now = [0.0]
    t = Policy(2.0, None, clock=lambda: now[0])
    t.start(0)
    assert not t.due(1, 9)
    now[0] = 2.0
    assert t.due(2, 9) and not t.due(9, 9)  # never after the last step


def test_due_checkpoints_one_in_flight_none_after_the_last_step() -> None:
    h, sender, job = hooks(every_steps=2)
    for step in (1, 2):
        h.boundary(step, 6, snap(step))
    assert [p.state.step for p in sender.submitted] == [2]
    assert sender.submitted[0].phase1 is not None  # the first carries the encoder outputs
    job.phase1_kept = True
    sender.is_busy = True  # step 2's is still in flight at step 4: owed
    h.boundary(3, 6, snap(3))
    h.boundary(4, 6, snap(4))
    assert len(sender.submitted) == 1 and h.owed
    sender.is_busy = False
    h.boundary(5, 6, snap(5))  # taken at the first boundary after it went
    h.boundary(6, 6, snap(6))  # the last step: the final latents go instead (send_final)
    assert [p.state.step for p in sender.submitted] == [2, 5]
    assert sender.submitted[1].phase1 is None


def test_yield_ends_the_loop_only_when_the_checkpoint_is_kept() -> None:
    h, sender, job = hooks(every_steps=100, reason=lambda: "preempted"
                           if job.yield_asked.is_set() else None)
    h.boundary(1, 6, snap(1))
    assert not sender.sent
    job.yield_asked.set()
    with pytest.raises(StageYielded) as info:
        h.boundary(2, 6, snap(2))
    assert (info.value.step, info.value.why) == (2, "preempted")
    assert [p.state.step for p in sender.sent] == [2]
    h2, sender2, _ = hooks(every_steps=100, reason=lambda: "drain")
    sender2.keeps = False  # the controller refuses it (its store is full): finish the task
    for step in (1, 2, 3):
        h2.boundary(step, 6, snap(step))
    assert [p.state.step for p in sender2.sent] == [1] and h2.yield_refused


def test_a_state_that_cannot_be_captured_leaves_the_loop_running() -> None:
    h, sender, _ = hooks(every_steps=1, reason=lambda: "drain")

    def fails() -> Any:
        raise CheckpointError("scheduler attribute generator holds a Generator")

    for step in (1, 2, 3):
        h.boundary(step, 6, fails)  # neither a yield nor a checkpoint: no exception either
    assert h.cannot and not sender.sent and not sender.submitted
