"""What every rank runs for one command, and how rank 0 judges the outcome.

All ranks run the same denoising loop in lockstep; three things must be decided once for
all of them or they fall out of step (and then wait in a collective until its timeout):

* whether to go on before each step: :class:`StepGate` makes rank 0's word everyone's, with
  one small broadcast per step. A cancel reaches rank 0 only; so does a reason to hand the
  task back (a drain, a preemption), which rank 0 acts on at a step boundary exactly as a
  one-process DiT does (:mod:`workers.checkpoints`: it checkpoints the loop, sends the
  checkpoint, and yields once the controller kept it) and which :class:`LeaderHooks` holds
  back until that broadcast, so every rank leaves the loop before the same step;
* where the loop starts: a resumed attempt's state, fetched by rank 0 and broadcast with the
  inputs (:func:`~workers.group.dist.broadcast_state`), or the seed's noise on every rank;
* whether a command succeeded: each rank reports its outcome to rank 0 over its channel and
  :func:`settle` decides. Every rank done: success. Every rank failed with the same project
  error (an invalid request, a cancel, a hand-back, an out-of-memory on all of them): that
  is the task's outcome and the group, which left no collective half-done, goes on.
  Anything else (one rank failed, a collective broke or timed out, a rank did not answer):
  the ranks are no longer in step, so the group is broken (:class:`GroupBroken`) and is
  restarted as a whole.

Only rank 0 checkpoints: every rank steps its own scheduler on the same numbers, so rank 0's
loop state is every rank's (the tests check the latents bit for bit).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from contracts import faults
from contracts.errors import ConnectionLost, DiffringError, StageYielded
from workers.group.dist import Channel
from workers.models.loop_state import LoopHooks, LoopState

log = logging.getLogger("diffring.group")

T = TypeVar("T")


class GroupBroken(BaseException):
    """The ranks of a group are out of step; only restarting them all helps.

    A BaseException on purpose: the worker loop turns an ``Exception`` raised by a stage into
    a failure of the task and carries on with the next one, which a broken group cannot do;
    this one unwinds past it to the rank's entry point, which exits for the supervisor."""


GO, CANCEL, YIELD = 0, 1, 2
"""Rank 0's word before a step: go on; stop, cancelled; stop, handed back (rank 0
checkpointed the loop at the boundary just passed and the controller kept it)."""


class StepGate:
    """The loop's ``should_stop`` on every rank; all of them act on rank 0's word.

    Rank 0 passes its cancel check (``cancelled``), the others None. Before each step rank 0
    broadcasts ``(word, step, steps)``; on YIELD every rank raises StageYielded there (rank 0
    the one its hooks caught, :class:`LeaderHooks`), so all leave the loop before the same
    step with no collective pending, and :func:`settle` finds them alike. Then, going on,
    fault point ``group.step``."""

    def __init__(self, device: torch.device, cancelled: Callable[[], bool] | None) -> None:
        self.cancelled = cancelled
        self.word = torch.zeros(3, dtype=torch.int64, device=device)
        self.yielded: StageYielded | None = None
        """Rank 0: the hand-back its hooks raised at the last boundary, passed on here."""

    def __call__(self) -> bool:
        import torch.distributed as dist

        if self.cancelled is not None:
            y = self.yielded
            word = (YIELD, y.step, y.total) if y is not None else (
                CANCEL if self.cancelled() else GO, 0, 0)
            self.word.copy_(torch.tensor(word, dtype=torch.int64))
        dist.broadcast(self.word, src=0)
        code, step, steps = (int(v) for v in self.word.tolist())
        if code == YIELD:
            if self.yielded is not None:
                raise self.yielded
            raise StageYielded(f"rank 0 handed the task back after step {step} of {steps}; "
                               "this rank leaves the loop with it", step, steps, "group")
        if code == GO:
            faults.hit("group.step")
        return code == CANCEL


class LeaderHooks:
    """Rank 0's loop hooks: the worker's own (:mod:`workers.checkpoints`: periodic
    checkpoints, the hand-back), with the hand-back passed on through the gate instead of
    raised at once (the other ranks are already waiting in the gate's broadcast)."""

    def __init__(self, inner: LoopHooks, gate: StepGate) -> None:
        self.inner = inner
        self.gate = gate
        self.resume = inner.resume

    def boundary(self, step: int, steps: int, snapshot: Callable[[], LoopState]) -> None:
        try:
            self.inner.boundary(step, steps, snapshot)
        except StageYielded as exc:
            # A hand-back comes before a step (never after the last), so a gate follows.
            assert step < steps, "handed back after the last step"
            self.gate.yielded = exc


@dataclass
class FollowerHooks:
    """A follower's loop hooks: start where rank 0's resumed attempt starts (None: from the
    seed's noise); nothing at the boundaries (rank 0 checkpoints for the group)."""

    resume: LoopState | None

    def boundary(self, step: int, steps: int, snapshot: Callable[[], LoopState]) -> None:
        return None


def outcome(run: Callable[[], T]) -> tuple[T | None, BaseException | None]:
    """``run()``'s result, or the exception it raised (an Exception; others propagate)."""
    try:
        return run(), None
    except Exception as exc:
        return None, exc


def report(leader: Channel, error: BaseException | None) -> None:
    """A follower's outcome of the last command, to rank 0."""
    if error is None:
        leader.send(op="done", ok=True)
    else:
        leader.send(op="done", ok=False, error_type=type(error).__name__, error=str(error))


def settle(what: str, result: T | None, error: BaseException | None,
           peers: Sequence[tuple[int, Channel]], timeout_s: float) -> T:
    """Rank 0: the command's result, or the error every rank raised alike; GroupBroken when
    the ranks disagree. ``timeout_s``: how long to wait for a peer's outcome (a peer stuck
    in a collective gets out of it after the process group's timeout)."""
    problems: list[str] = []
    if error is not None:
        problems.append(f"rank 0: {type(error).__name__}: {error}")
    answers: list[dict[str, Any]] = []
    for rank, channel in peers:
        try:
            msg = channel.recv(timeout=timeout_s)
        except (ConnectionLost, TimeoutError) as exc:
            problems.append(f"rank {rank}: no outcome ({exc or 'timed out'})")
            continue
        answers.append(msg)
        if not msg.get("ok"):
            problems.append(f"rank {rank}: {msg.get('error_type')}: {msg.get('error')}")
    if not problems:
        return result  # type: ignore[return-value]  # success: run() returned it
    alike = (
        isinstance(error, DiffringError)
        and len(answers) == len(peers)
        and all(not a.get("ok") and a.get("error_type") == type(error).__name__
                for a in answers)
    )
    if alike:
        assert error is not None
        raise error  # the task's own failure; the group is still in step
    raise GroupBroken(f"transformer group out of step after {what}: " + "; ".join(problems))
