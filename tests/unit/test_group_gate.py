"""Rank 0's side of a transformer group's step gate, loop hooks and resumed state, in-process.

A one-rank gloo process group stands in for the group: rank 0 broadcasts to nobody, so its
own word and tensors come back unchanged, which is what a follower would receive. The
whole exchange between real ranks (a hand-back reaching every rank at one step, a resumed
state in every rank) runs in tests/integration/test_group_checkpoints.py.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from contracts import faults
from contracts.errors import FaultInjected, StageYielded
from workers.group.dist import Channel, broadcast_state, state_command
from workers.group.steps import CANCEL, GO, YIELD, FollowerHooks, LeaderHooks, StepGate
from workers.models.loop_state import LoopState, capture_scheduler

CPU = torch.device("cpu")


@pytest.fixture
def one_rank() -> Iterator[None]:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        faults.configure(None)


class WorkerHooks:
    """The worker's own hooks (workers.checkpoints.JobHooks) as far as the gate is
    concerned: they hand the task back at boundary ``at``."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.resume: LoopState | None = None

    def boundary(self, step: int, steps: int, snapshot: Callable[[], LoopState]) -> None:
        if step == self.at:
            raise StageYielded(f"handed back after step {step} of {steps} (preempted)", step,
                               steps, "preempted")


def no_snapshot() -> LoopState:
    raise AssertionError("not taken here")


def test_a_hand_back_at_a_boundary_stops_every_rank_at_the_next_gate(one_rank: None) -> None:
    faults.configure("group.step:raise:nth=3")
    cancel = False
    gate = StepGate(CPU, lambda: cancel)
    hooks = LeaderHooks(WorkerHooks(at=2), gate)
    assert gate() is False and gate.word.tolist() == [GO, 0, 0]
    hooks.boundary(1, 4, no_snapshot)
    assert gate() is False
    hooks.boundary(2, 4, no_snapshot)  # held back: the followers wait in the gate
    cancel = True  # a cancel meanwhile: the checkpoint is kept, the hand-back wins
    with pytest.raises(StageYielded) as caught:
        gate()
    assert gate.word.tolist() == [YIELD, 2, 4]
    assert (caught.value.step, caught.value.why) == (2, "preempted")
    assert faults.fired()["group.step"] == 0  # hit only when the group goes on


def test_a_cancel_is_everyone_s_and_only_going_on_passes_the_fault_point(
        one_rank: None) -> None:
    faults.configure("group.step:raise")
    cancel = True
    gate = StepGate(CPU, lambda: cancel)
    assert gate() is True and gate.word.tolist() == [CANCEL, 0, 0]
    cancel = False
    with pytest.raises(FaultInjected):
        gate()


def test_a_follower_leaves_the_loop_on_rank_0_s_word(one_rank: None) -> None:
    gate = StepGate(CPU, None)
    gate.word.copy_(torch.tensor([YIELD, 3, 8]))  # what rank 0 broadcast
    with pytest.raises(StageYielded) as caught:
        gate()
    assert (caught.value.step, caught.value.total, caught.value.why) == (3, 8, "group")
    assert "after step 3 of 8" in str(caught.value)


def test_a_resumed_state_crosses_the_command_channel_and_the_group_whole(
        one_rank: None) -> None:
    """UniPC after three steps (its history of model outputs, order counters, the sigmas it
    keeps on the CPU): the command goes through a command channel (msgpack), the tensors through
    the process group, and the state comes out equal, each tensor where it was."""
    from diffusers import UniPCMultistepScheduler

    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                    flow_shift=3.0)
    sched.set_timesteps(8, device=CPU)
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 4, 2, 4, 4, generator=gen)
    for t in sched.timesteps[:3]:
        latents = sched.step(torch.randn(latents.shape, generator=gen), t, latents,
                             return_dict=False)[0]
    state = LoopState(3, 8, {"latents": latents}, capture_scheduler(sched))
    command, tensors = state_command(state)
    assert command is not None
    a, b = socket.socketpair()
    try:
        Channel(a, "rank 1").send(op="denoise", resume=command)
        received = Channel(b, "rank 0").recv(timeout=30)["resume"]
    finally:
        a.close()
        b.close()
    got = broadcast_state(received, tensors, CPU)
    assert got is not None and (got.step, got.steps) == (3, 8)
    assert torch.equal(got.tensors["latents"], latents)
    assert set(got.scheduler) == set(state.scheduler)
    for name, value in state.scheduler.items():
        same(got.scheduler[name], value, name)
    assert state_command(None) == (None, {}) and broadcast_state(None, None, CPU) is None
    assert FollowerHooks(got).resume is got


def same(got: Any, want: Any, where: str) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.device == want.device, where
        assert got.dtype == want.dtype and torch.equal(got, want), where
    elif isinstance(want, list | tuple):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            same(g, w, f"{where}[{i}]")
    elif isinstance(want, np.generic):
        assert type(got) is type(want) and got == want, where
    else:
        assert got == want, where
