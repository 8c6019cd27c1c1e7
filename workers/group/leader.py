"""Rank 0 of a transformer group: the one worker the runtime sees.

It is a :class:`~workers.roles.TransformerWorker` in every respect the controller can tell
(it registers, claims from the Phase1 ring, holds the lease and heartbeats, pulls the inputs
with Mooncake, publishes Phase2, reports progress), with the compute step done by the whole
group: the inputs go to every rank (:func:`~workers.group.dist.broadcast_tensors`), every
rank denoises its share, and rank 0 publishes its latents, which equal every other rank's.
With ``checkpoint_every_*`` it checkpoints, resumes and hands tasks back (drain, preemption)
for the whole group, as a one-process DiT does: see :meth:`GroupLeader.compute`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from contracts.config import ServiceConfig
from contracts.errors import ConnectionLost, ModelLoadError
from workers.group.dist import (
    Channel,
    broadcast_state,
    broadcast_tensors,
    state_command,
    tensor_specs,
)
from workers.group.steps import GroupBroken, LeaderHooks, StepGate, outcome, settle
from workers.models.dit.parallel import GroupMesh
from workers.roles import TransformerWorker, _request, _size, transformer_options
from workers.worker import Job, StageWorker

log = logging.getLogger("diffring.group")

T = TypeVar("T")


class GroupLeader(TransformerWorker):
    """The transformer worker of a group's rank 0; ``peers`` are the channels to ranks 1.."""

    def __init__(self, cfg: ServiceConfig, token: str, env: Mapping[str, str],
                 group: GroupMesh, peers: Sequence[tuple[int, Channel]]) -> None:
        super().__init__(cfg, token, env)
        self.group = group
        self.peers = list(peers)
        self.timeout_s = cfg.transformer.group_timeout_s
        self.broken = False
        """The ranks fell out of step: the others are not told to stop (the supervisor takes
        them down with this one, and names this rank's exit as the cause)."""

    def adapter_options(self) -> dict[str, Any]:
        return {**transformer_options(self.cfg), "group": self.group}

    def load_model(self) -> None:
        """Load this rank's share, wait for every rank's (the worker registers only when the
        whole group can compute), then warm the group up together."""
        self.checkpoints.start(self.link.call, self.pool, self.engine)
        StageWorker.load_model(self)
        for rank, channel in self.peers:
            msg = channel.recv()  # a rank that dies or hangs while loading: the supervisor
            if msg.get("error"):
                raise ModelLoadError(f"transformer group rank {rank}: {msg['error']}")
        log.info("worker %s: all %d ranks of the group (%s) loaded", self.name,
                 self.group.layout.size, self.group.layout)
        if self.cfg.warmup_shapes:
            shapes = list(self.cfg.warmup_shapes)
            t0 = time.monotonic()
            self.together("warm-up", lambda: self.stage.warm_up(shapes), op="warmup",
                          shapes=shapes)
            log.info("worker %s: group warm-up of %s took %.1f s", self.name,
                     ", ".join(shapes), time.monotonic() - t0)

    def compute(self, job: Job, inputs: dict[str, Any]) -> dict[str, Any]:
        """The group's loop. Checkpoints, drain and preemption are rank 0's, exactly as a
        one-process DiT's (:class:`~workers.roles.TransformerWorker`): its loop state is
        every rank's; a resumed attempt's state goes to the others with the inputs, and a
        hand-back reaches them through the step gate (:mod:`workers.group.steps`)."""
        req = _request(job)
        specs = tensor_specs(inputs)
        resume, resume_tensors = state_command(job.resume)
        device = self.stage.device
        gate = StepGate(device, job.cancel.is_set)
        hooks = LeaderHooks(self.checkpoints.hooks(job, inputs, lambda: self.yield_reason(job)),
                            gate)

        def run() -> dict[str, Any]:
            tensors = broadcast_tensors(specs, inputs, device)
            broadcast_state(resume, resume_tensors, device)
            with self.stage.guarded(_size(req)):
                out: dict[str, Any] = self.stage.denoise(
                    req, tensors,
                    on_step=lambda k, n: self.progress.report(job, k, n),
                    should_stop=gate,
                    loop=hooks,
                )
            return out

        out = self.together(f"task {job.task_id}", run, op="denoise",
                            request=job.item["request"], tensors=specs, resume=resume)
        self.progress.flush(job)
        job.result = out  # the final latents, kept by the controller (release)
        return out

    def together(self, what: str, run: Callable[[], T], **command: Any) -> T:
        """Send ``command`` to every other rank, run this rank's part, settle the outcome
        (:func:`~workers.group.steps.settle`). A broken group is reported to the controller
        here, at once (the task goes back in play, not charged), before it unwinds."""
        try:
            for _rank, channel in self.peers:
                channel.send(**command)
            result, error = outcome(run)
            return settle(what, result, error, self.peers, self.timeout_s + 30)
        except ConnectionLost as exc:  # a rank is gone before it got the command
            raise self._broken(GroupBroken(f"transformer group: {exc} ({what})")) from None
        except GroupBroken as exc:
            raise self._broken(exc) from None

    def _broken(self, exc: GroupBroken) -> GroupBroken:
        self.broken = True
        self.report_fatal(str(exc))
        return exc

    def close(self) -> None:
        for _rank, channel in self.peers:
            if not self.broken:
                try:
                    channel.send(op="stop")
                except ConnectionLost as exc:  # that rank is gone already: the supervisor knows
                    log.debug("stop to a rank: %s", exc)
            channel.close()
        super().close()
