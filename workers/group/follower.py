"""Ranks 1.. of a transformer group: they only compute, on rank 0's word.

A follower loads its share of the model at start, says so, and then runs each command rank
0 sends (``warmup``, ``denoise``: from the seed's noise, or from the loop state of a resumed
attempt that rank 0 sends with the inputs) in step with it, reporting its outcome after each
(a hand-back, rank 0's word at a step, is an outcome like a cancel); it never talks to the
controller, the rings or Mooncake, and never checkpoints (rank 0's loop state is its own).
It waits for commands on its channel for as long as the group is idle (no collective is
pending then) and exits on ``stop`` or when rank 0's end of the channel closes.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import torch

from contracts.config import ServiceConfig
from contracts.errors import ConnectionLost
from contracts.request import GenerationRequest
from workers.group.dist import Channel, broadcast_state, broadcast_tensors
from workers.group.steps import FollowerHooks, StepGate, outcome, report
from workers.models import TransformerAdapter
from workers.models.dit.parallel import GroupMesh
from workers.roles import _size, transformer_options

log = logging.getLogger("diffring.group")


def follow(cfg: ServiceConfig, group: GroupMesh, leader: Channel) -> int:
    """Load, then serve rank 0's commands; the process's exit status (2: the model did not
    load, rank 0 was told why)."""
    assert cfg.model_path is not None
    stage: Any = TransformerAdapter.for_task(
        cfg.model_path, cfg.pipeline, cfg.device, cfg.dtype,
        **transformer_options(cfg), group=group)
    if cfg.torch_threads is not None:
        torch.set_num_threads(cfg.torch_threads)
    _, error = outcome(stage.load)
    leader.send(op="loaded", error=None if error is None else f"{type(error).__name__}: "
                f"{error}")
    if error is not None:
        log.error("rank %d: the model did not load: %s", group.rank, error)
        return 2
    while True:
        try:
            msg = leader.recv()
        except ConnectionLost:
            log.info("rank %d: rank 0 is gone; stopping", group.rank)
            return 0
        op = msg.get("op")
        if op == "stop":
            return 0
        if op == "warmup":
            _, error = outcome(partial(stage.warm_up, msg["shapes"]))
        elif op == "denoise":
            _, error = outcome(partial(_denoise, stage, msg))
        else:
            error = ValueError(f"unknown command {op!r} from rank 0")
        try:
            report(leader, error)
        except ConnectionLost:
            log.info("rank %d: rank 0 is gone; stopping", group.rank)
            return 0


def _denoise(stage: Any, msg: dict[str, Any]) -> None:
    device: torch.device = stage.device
    tensors = broadcast_tensors(msg["tensors"], None, device)
    resume = broadcast_state(msg.get("resume"), None, device)
    req = GenerationRequest.from_dict(msg["request"])
    with stage.guarded(_size(req)):
        stage.denoise(req, tensors, should_stop=StepGate(device, None),
                      loop=FollowerHooks(resume))
