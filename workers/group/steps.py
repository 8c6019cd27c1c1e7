"""What every rank of a group runs for one command, and how rank 0 judges the outcome.

All ranks run the same denoising loop in lockstep; two things must be decided once for all
of them or they fall out of step (and then wait in a collective until its timeout):

* whether to go on before each step (a cancel reaches rank 0 only): :func:`step_gate` makes
  rank 0's answer everyone's, with a one-element broadcast per step;
* whether a command succeeded: each rank reports its outcome to rank 0 over its channel and
  :func:`settle` decides. Every rank done: success. Every rank failed with the same project
  error (an invalid request, a cancel, an out-of-memory on all of them): the task failed and
  the group, which left no collective half-done, goes on. Anything else (one rank failed,
  a collective broke or timed out, a rank did not answer): the ranks are no longer in step,
  so the group is broken (:class:`GroupBroken`) and is restarted as a whole.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from contracts import faults
from contracts.errors import ConnectionLost, DiffringError
from workers.group.dist import Channel

log = logging.getLogger("diffring.group")

T = TypeVar("T")


class GroupBroken(BaseException):
    """The ranks of a group are out of step; only restarting them all helps.

    A BaseException on purpose: the worker loop turns an ``Exception`` raised by a stage into
    a failure of the task and carries on with the next one, which a broken group cannot do;
    this one unwinds past it to the rank's entry point, which exits for the supervisor."""


def step_gate(device: torch.device, local: Callable[[], bool] | None) -> Callable[[], bool]:
    """The loop's ``should_stop`` on every rank: rank 0 passes its own check (``local``),
    the others None; all return rank 0's answer. Then fault point ``group.step``."""
    import torch.distributed as dist

    flag = torch.zeros(1, dtype=torch.int32, device=device)

    def should_stop() -> bool:
        if local is not None:
            flag.fill_(int(local()))
        dist.broadcast(flag, src=0)
        stop = bool(flag.item())
        if not stop:
            faults.hit("group.step")
        return stop

    return should_stop


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
