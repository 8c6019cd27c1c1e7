"""A DiT worker's denoising checkpoints: when to take one, sending it to the controller off
the loop's path, yielding at a step boundary, and fetching the one a resumed attempt starts
from (the controller's side: :mod:`controller.tasks.checkpoints`, window 8 of
:mod:`controller.ownership.coordinator`).

At a step boundary the loop (:mod:`workers.models.loop_state`) calls :meth:`JobHooks.
boundary`. A checkpoint due there (``checkpoint_every_steps`` steps or ``checkpoint_every_s``
seconds of DiT time since the last) costs the loop only a copy of its state on its device;
the :class:`Sender`'s thread stages that copy in the pool and sends ``checkpoint`` (the
controller pulls the tensors and answers), so the next step starts at once. One checkpoint
is in flight at most: one that falls due meanwhile is taken at the first boundary after it
went. The encoder outputs go with the first checkpoint the controller keeps (a resumed
attempt's are there already).

Yielding -- the worker is draining (SIGTERM), or the controller asks (preemption) -- is done
at the next boundary: wait for the checkpoint in flight, copy the state, send it and wait for
the answer; kept, the loop ends with :class:`~contracts.errors.StageYielded` and the worker
hands the task back (``fail``, fault ``yielded``: uncharged); refused, the loop goes on (and
the worker finishes the task as before). After the last step the final latents are sent the
same way (:meth:`DitCheckpoints.send_final`), kept by the controller until the result is
written, so a lost decoder costs only a decode.

The ``split`` placement (Wan2.2-A14B, ``transformer.experts`` ``high`` / ``low``) hands a
request over at the boundary the same way (:meth:`JobHooks.hand_over`): the high-noise
worker's loop state, its next expert the low-noise one, is sent as a checkpoint marked
``split`` and the task handed back (``yielded``, uncharged); the controller keeps it for a
low-noise worker (:data:`controller.ownership.requeue.LOW`), which resumes it there. A
high-noise worker therefore checkpoints without ``checkpoint_every_*`` (its controller must
keep checkpoints); a handover that is not kept fails the attempt (charged: a retry
starts from the last kept state).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter

from contracts import faults
from contracts.errors import CheckpointError, DiffringError, StageError, StageYielded
from contracts.messages import Checkpoint, CheckpointReply, RegisterReply, Resume, ResumeReply
from contracts.stage_options import SPLIT_EXPERTS, StageOptions
from tensorplane.descriptor import TensorDescriptor
from tensorplane.handoff import pull_tensors, stage_tensors
from workers.metrics import WorkerMetrics
from workers.models.loop_state import LoopState, from_wire, to_wire

log = logging.getLogger("diffring.worker.checkpoints")


@dataclass
class Policy:
    """When a checkpoint is due: every ``every_steps`` steps and/or ``every_s`` seconds of
    the loop's time since the last one (or since the loop started)."""

    every_s: float | None
    every_steps: int | None
    clock: Callable[[], float] = time.monotonic
    _last: float = 0.0
    _last_step: int = 0

    def start(self, step: int) -> None:
        self._last, self._last_step = self.clock(), step

    def due(self, step: int, steps: int) -> bool:
        if step >= steps:  # the end: the final latents go instead (send_final)
            return False
        if self.every_steps is not None and step - self._last_step >= self.every_steps:
            return True
        return self.every_s is not None and self.clock() - self._last >= self.every_s

    def taken(self, step: int) -> None:
        self.start(step)


@dataclass
class Pending:
    """One checkpoint to send: ``state`` of ``job`` (with the encoder outputs ``phase1``
    when the controller has none yet)."""

    job: Any
    state: LoopState
    phase1: Mapping[str, Any] | None
    final: bool = False
    split: bool = False
    """Made by a worker holding one expert: the controller routes a resume of it by its
    next expert (``meta['split']``)."""


class Sender:
    """Sends checkpoints on a thread of its own (one at a time), or on the caller's."""

    def __init__(self, call: Callable[..., Any], pool: Any, engine: Any,
                 metrics: WorkerMetrics, counter: Counter, name: str) -> None:
        self._call = call
        self._pool = pool
        self._engine = engine
        self._metrics = metrics
        self._counter = counter
        self._cond = threading.Condition()
        self._next: Pending | None = None
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"checkpoints-{name}",
                                        daemon=True)
        self._thread.start()

    def busy(self) -> bool:
        with self._cond:
            return self._busy or self._next is not None

    def submit(self, pending: Pending) -> None:
        with self._cond:
            self._next = pending
            self._cond.notify_all()

    def wait_idle(self, timeout: float = 60.0) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not (self._busy or self._next is not None), timeout)

    def send(self, pending: Pending) -> bool:
        """Stage and send ``pending`` now, on this thread; True when the controller kept it."""
        job = pending.job
        tensors, meta = to_wire(pending.state)
        if pending.split:
            meta["split"] = True
        descs: list[TensorDescriptor] = []
        descs1: list[TensorDescriptor] = []
        t0 = time.monotonic()
        try:
            descs = stage_tensors(self._pool, self._engine, tensors, task_id=job.task_id)
            if pending.phase1 is not None:
                descs1 = stage_tensors(self._pool, self._engine, dict(pending.phase1),
                                       task_id=job.task_id)
            reply = self._call(Checkpoint(
                task_id=job.task_id, attempt=job.attempt, step=pending.state.step,
                steps=pending.state.steps, final=pending.final, meta=meta,
                state=[d.to_dict() for d in descs],
                phase1=[d.to_dict() for d in descs1] if pending.phase1 is not None else None),
                CheckpointReply)
        except DiffringError as exc:
            self._counter.labels("failed").inc()
            log.warning("task %s: checkpoint of step %d not sent: %s", job.task_id,
                        pending.state.step, exc)
            return False
        finally:
            # Pulled blocks were released by the controller's reads; the rest are ours.
            self._pool.free_staged([*descs, *descs1])
        self._metrics.stage_seconds.labels("transformer", "checkpoint_send").observe(
            time.monotonic() - t0)
        if not reply.accepted:
            self._counter.labels("refused").inc()
            log.warning("task %s: checkpoint of step %d refused: %s", job.task_id,
                        pending.state.step, reply.reason)
            return False
        self._counter.labels("final" if pending.final else "kept").inc()
        self._metrics.transfer_bytes.labels("checkpoint").inc(
            sum(d.nbytes for d in [*descs, *descs1]))
        if pending.phase1 is not None:
            job.phase1_kept = True
        faults.hit("dit.checkpointed")
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._next is not None or self._closed)
                if self._closed:
                    return
                pending, self._next, self._busy = self._next, None, True
            assert pending is not None
            try:
                kept = self.send(pending)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
            if kept:  # (logged once the next one can go: a test's event to wait for)
                log.info("task %s: checkpoint of step %d/%d kept", pending.job.task_id,
                         pending.state.step, pending.state.steps)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class JobHooks:
    """The loop hooks of one job (:class:`~workers.models.loop_state.LoopHooks`)."""

    def __init__(self, owner: DitCheckpoints, job: Any, inputs: Mapping[str, Any],
                 resume: LoopState | None, yield_reason: Callable[[], str | None]) -> None:
        self.owner = owner
        self.job = job
        self.inputs = inputs
        self.resume = resume
        self.yield_reason = yield_reason
        self.policy = Policy(owner.options.checkpoint_every_s,
                             owner.options.checkpoint_every_steps)
        self.policy.start(resume.step if resume is not None else 0)
        self.owed = False
        self.yield_refused = False
        self.cannot = False
        """The loop's state cannot be captured (CheckpointError): no more checkpoints of
        this job, which runs on as without them."""

    def _pending(self, state: LoopState) -> Pending:
        return Pending(self.job, state, None if self.job.phase1_kept else self.inputs,
                       split=self.owner.split)

    def hand_over(self, step: int, steps: int, snapshot: Callable[[], LoopState]) -> None:
        """``split``: the next step is the other expert's. Send the state (waiting for the
        controller to keep it) and end the loop: the task goes to a worker holding it."""
        sender = self.owner.sender
        t0 = time.monotonic()
        sender.wait_idle()
        state = self._timed(snapshot)
        if state is None or not sender.send(self._pending(state)):
            raise StageError(f"task {self.job.task_id}: the loop state after step {step} of "
                             f"{steps} could not be handed over to the other expert's worker "
                             "(its checkpoint was not kept: see the warning above; a "
                             "controller with checkpoint_store_mb 0 keeps none)")
        seconds = time.monotonic() - t0
        self.owner.metrics.stage_seconds.labels("transformer", "handover_send").observe(seconds)
        log.info("task %s: handed over to the %s-noise expert after step %d/%d (%.3f s)",
                 self.job.task_id, state.expert, step, steps, seconds)
        raise StageYielded(f"handed over to the {state.expert}-noise expert after step {step} "
                           f"of {steps}", step, steps, "handover")

    def boundary(self, step: int, steps: int, snapshot: Callable[[], LoopState]) -> None:
        step_point()
        if self.cannot:
            return
        why = None if self.yield_refused or step >= steps else self.yield_reason()
        sender = self.owner.sender
        if why is not None:
            sender.wait_idle()
            state = self._timed(snapshot)
            if state is not None and sender.send(self._pending(state)):
                raise StageYielded(f"handed back after step {step} of {steps} ({why}), "
                                   "its state checkpointed", step, steps, why)
            self.yield_refused = True  # go on: finish the task rather than lose the steps
            log.warning("task %s: cannot yield (%s): its checkpoint was not kept; finishing "
                        "it", self.job.task_id, why)
        if step >= steps or not (self.owed or self.policy.due(step, steps)):
            return  # (after the last step the final latents go instead: send_final)
        if sender.busy():
            self.owed = True  # taken at the first boundary after the one in flight went
            return
        self.owed = False
        self.policy.taken(step)
        state = self._timed(snapshot)
        if state is not None:
            sender.submit(self._pending(state))

    def _timed(self, snapshot: Callable[[], LoopState]) -> LoopState | None:
        t0 = time.monotonic()
        try:
            state = snapshot()
        except CheckpointError as exc:
            # A checkpoint is worth less than the task: it goes on without them.
            self.cannot = True
            self.owner.counter.labels("failed").inc()
            log.warning("task %s: no checkpoints of this loop: %s", self.job.task_id, exc)
            return None
        self.owner.metrics.stage_seconds.labels("transformer", "checkpoint_capture").observe(
            time.monotonic() - t0)
        return state


class DitCheckpoints:
    """A DiT worker's checkpoints; ``enabled`` once the controller said it keeps them."""

    def __init__(self, options: StageOptions, metrics: WorkerMetrics, name: str) -> None:
        self.options = options
        self.metrics = metrics
        self.name = name
        self.split = options.experts in SPLIT_EXPERTS
        """This worker holds one expert (``split``): its states are routed by their next
        expert."""
        self.wanted = options.checkpointing or options.experts == "high"
        """This worker is configured to checkpoint (``transformer.checkpoint_every_*``), or
        hands requests over at the boundary (``experts: high``)."""
        self.enabled = False
        """... and its controller keeps checkpoints (said at registration)."""
        self.sender: Sender = None  # type: ignore[assignment]  # start()
        self.counter = Counter("diffring_worker_checkpoints", "Denoising checkpoints this "
                               "worker sent, by outcome (kept, final, refused, failed)",
                               ["outcome"], registry=metrics.registry)

    def start(self, call: Callable[..., Any], pool: Any, engine: Any) -> None:
        if self.wanted:
            self.sender = Sender(call, pool, engine, self.metrics, self.counter, self.name)

    def registered(self, reply: RegisterReply) -> None:
        enabled = self.wanted and reply.checkpoints
        if self.wanted and not enabled:
            if self.options.experts == "high":
                log.error("worker %s: experts 'high' (split) hands each request over at the "
                          "boundary as a checkpoint, but the controller keeps none (its "
                          "checkpoint_store_mb is 0): requests will fail at the boundary",
                          self.name)
            else:
                log.warning("worker %s: checkpoint_every_* is set but the controller keeps "
                            "no checkpoints (its checkpoint_store_mb is 0): not "
                            "checkpointing", self.name)
        self.enabled = enabled

    def hooks(self, job: Any, inputs: Mapping[str, Any],
              yield_reason: Callable[[], str | None]) -> JobHooks | Plain:
        """The loop hooks of ``job``, which starts at ``job.resume`` (None: from step 0)."""
        if not self.enabled:
            return Plain(job.resume)
        return JobHooks(self, job, inputs, job.resume, yield_reason)

    def send_final(self, job: Any, outputs: Mapping[str, Any], steps: int) -> None:
        """The final latents (after the last step): kept until the result is written."""
        if not self.enabled:
            return
        self.sender.wait_idle()
        self.sender.send(Pending(job, LoopState(steps, steps, dict(outputs)), None,
                                 final=True))

    def fetch(self, call: Callable[..., Any], engine: Any, pool: Any, job: Any,
              device: str, arrays: Any) -> tuple[dict[str, Any], LoopState]:
        """The encoder outputs and loop state a resumed attempt starts from (``resume``):
        kept by the controller, pulled here (nothing to release: the controller keeps
        them). Any failure is a CheckpointError: the controller then drops the checkpoint
        and the task starts over."""
        t0 = time.monotonic()
        try:
            reply = call(Resume(task_id=job.task_id, attempt=job.attempt), ResumeReply)
            descs1 = [TensorDescriptor.from_dict(d) for d in reply.phase1]
            descs = [TensorDescriptor.from_dict(d) for d in reply.state]
            inputs = pull_tensors(engine, pool, descs1, device=device, task_id=job.task_id,
                                  arrays=arrays)
            tensors = pull_tensors(engine, pool, descs, device=device, task_id=job.task_id,
                                   arrays=arrays)
            state = from_wire(reply.step, reply.steps, tensors, reply.meta, device)
        except (DiffringError, KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"cannot resume from the kept checkpoint: {exc}",
                                  task_id=job.task_id) from exc
        job.phase1_kept = True
        seconds = time.monotonic() - t0
        self.metrics.stage_seconds.labels("transformer", "resume_fetch").observe(seconds)
        log.info("task %s: resuming after step %d of %d (fetched in %.3f s)", job.task_id,
                 state.step, state.steps, seconds)
        return inputs, state

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()


@dataclass
class Plain:
    """The hooks of a worker that does not checkpoint: start at ``resume`` (a checkpoint
    another worker made), pass the step's fault point."""

    resume: LoopState | None

    def boundary(self, step: int, steps: int, snapshot: Callable[[], LoopState]) -> None:
        step_point()

    def hand_over(self, step: int, steps: int, snapshot: Callable[[], LoopState]) -> None:
        raise StageError(f"the loop state after step {step} of {steps} cannot be handed over "
                         "to the other expert's worker: this worker sends no checkpoints (the "
                         "controller keeps none: checkpoint_store_mb is 0)")


def step_point() -> None:
    """Fault point of every DiT step boundary, checkpointing or not."""
    faults.hit("dit.step")
