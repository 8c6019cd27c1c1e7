"""The controller's coordination logic: tasks in, worker events, leases, requeue, results.

The coordinator is where the ownership argument below is enforced: it assembles the parts
that each enforce a piece of it, and is the one face the rest of the controller calls. It
is handed the task table (:mod:`controller.tasks.table`) and the controller's own handle on the
request ring; it keeps, each a module of this package (:mod:`controller.ownership`), the
worker registry (``registry``), the admission of new tasks (``admission``), the claims and
their leases (``claims``, ``leases``), the requeue (``requeue``), the completions
(``completions``, into the result folder of ``results``), the recovery paths (``recovery``,
with the retry budget of ``budget``), the checkpoints (``resumes``) and the priorities
(``priorities``). Each window below names the module that
enforces it; what stays here joins them: registration, heartbeats, a worker gone, a reported
failure, cancelling, the sweep and the restart. The front door calls ``submit`` /
``cancel``; the control server calls the ``on_*`` handlers; a sweeper calls ``sweep(now)``
periodically. Everything runs on the event-loop thread, except what would block it: result
files are written on a thread pool (:meth:`Completions.complete` awaits them), the task
store writes on its own thread (:mod:`controller.tasks.store`), and checkpoints are pulled in one
lane (thread) per DiT worker (:mod:`controller.tasks.checkpoints`). So each handler sees the
table, the registry and (over tcp) the ring memory at one instant.

Ownership without gaps
----------------------
At every instant each unfinished task is owned by the controller, by a ring slot, or by a
worker's lease, and the owner is what puts it back in play when it fails:

============================  ======================================  ====================
stage (``controller.tasks.tasks``)  owner                                   if the owner fails
============================  ======================================  ====================
accepted                      the controller (``requeue``)            task store (restart)
queued / phase1 / phase2      an item of the current attempt in the   reconciliation
                              stage's ring (``WAITING_RING``)
encoding / denoising /        the lease of the worker that claimed    connection drop,
decoding                      it                                      fatal report or
                                                                      lease expiry
============================  ======================================  ====================

A denoising checkpoint (8) adds no owner: it is the task's *progress*, kept by the
controller, and says only where the next attempt starts.

The windows, one by one (the fault point of :mod:`contracts.faults` that kills or fails a
process inside each is named; ``tests/integration/test_fault_points.py`` fires every one of them and
``tests/unit/test_recovery.py`` walks each window in-process):

1. *Accepted, then queued* (``admission``, ``requeue``).
   ``submit`` adds the task to the table -- which hands its row, input image included, to
   the task store's writer thread -- pushes it to the request ring and marks it queued, in
   one turn of the event loop. The front door answers only once the row is durable
   (:meth:`TaskJournal.durable`), so an acknowledged task survives a restart (7); a row the
   store cannot write cancels the task and refuses it (503). A full ring or in-flight limit
   refuses it (429) and keeps nothing (the row is deleted again). With ``release_ahead``
   set, a new task instead joins those waiting in the ``requeue`` (accepted, owned by the
   controller) and is pushed in priority order as the release bound and the ring allow --
   at once if they have room. A task put back in play (2-8) is accepted again in a new
   attempt, its input image staged afresh (the ended attempt's encoder may have freed it),
   and pushed at once -- or, the ring full (or the release bound reached), left waiting in
   the ``requeue`` and pushed at a later sweep, claim or registration.
2. *Popped, claim not yet heard* (``worker.after_pop``). A consumer's pop frees the slot
   before its ``claim`` message leaves, so for a moment nothing names the task. The gap is
   closed by reconciliation (:meth:`Coordinator.reconcile`, :meth:`Recovery.reconcile`):
   every sweep the controller reads the rings it hosts (``reconcile``) and
   lists the (task, attempt) of every item a consumer can still get (an ORPHANED item,
   re-offered by the host after its consumer died or idled, counts). A task in a waiting
   stage, with no lease, whose current attempt is in no such slot, is *missing*; missing for
   ``lease_timeout_s`` -- the implicit lease of whoever popped it -- it is put back in play
   (a system fault: not counted). The popper, if it lives, then claims an old attempt and is
   refused (:meth:`Claims.claim`). The same check catches every other way an item leaves its
   ring unclaimed: a consumer killed holding the slot (the host frees it), a claim timed
   out, a payload corrupted so badly it cannot name its task. The doorbell
   (:mod:`controller.doorbell`) that wakes idle consumers when an item is pushed is only a
   hint: the item stays owned by its slot, so a lost or late ring delays a task and never
   loses it. A DiT whose claim is deferred behind a more urgent task
   (``priorities``) pushes the popped item back to its ring: until that push
   this is the same gap, and a ring too full to take it back makes it a dropped item (3).
3. *Dropped item* (:meth:`Recovery.dropped`). A worker that pops an item it cannot run
   (corrupt, wrong kind, malformed) reports it (``dropped``). An item that names the task's
   current attempt, waiting for that worker's role, puts the task back in play at once; one
   that names nothing is left to 2.
4. *Claimed: the lease* (``worker.after_claim``, ``worker.stage``,
   ``worker.before_publish``, ``control.drop``). From the claim (``claims``,
   the deadline of ``leases``) to the handoff, completion or failure, the task
   is the worker's; each heartbeat renews every lease the worker holds and names the tasks
   that are no longer its own, which it stops (``on_heartbeat``). A dropped control
   connection (crash, network) or a fatal error the worker reports revokes all its leases at
   once (``on_gone``); a worker that stops heartbeating (hung, SIGSTOPped) loses them when
   they expire (``sweep``); either way ``recovery`` puts the tasks back in
   play. The attempt number then fences the old holder (:meth:`TaskTable.held`): its
   progress, handoff, failure and result are refused, so a zombie never completes a task
   twice. A result is refused even when its lease ends while the file is being written
   (``decoder.result_write``; ``completions`` writes the file off the loop,
   records the completion only if the lease still holds, and removes the file otherwise);
   completions of one task are serialised, so only the winner's file stays. A decoder
   encoding its result in the background (:mod:`workers.encode_pool`) keeps the lease until
   it reports; so does one holding a result whose file the storage refuses
   (``decoder.before_write``, ``controller.result_write``: a full disk, here or at the
   decoder), which retries the write uncharged and, past ``result_write_retry_s``, hands the
   task back as a system fault (``result_writes``: new tasks are refused
   meanwhile).
5. *Published, handoff in flight* (``worker.after_publish``; :meth:`Claims.handoff`). A
   producer publishes to the next ring, then reports the handoff: meanwhile both its lease
   and the slot name the task (an overlap, not a gap). The next stage may claim first
   (``CLAIMABLE_FROM``, :meth:`TaskTable.claim`); the late handoff is then ignored. A
   producer dying here loses its lease (4): the task is retried and the published item, now
   of an old attempt, is refused at its claim.
6. *Handed off, then the producer dies* (``transfer.pull``, ``transfer.read``;
   :meth:`Recovery.failed`, the refund of ``budget``). The item names buffers
   that died with it: the consumer's pull fails, reports ``fault: transfer``, and the task
   is retried; a producer that is gone does not count against the task (a failure charged
   while it still looked alive is refunded when its connection drops).
7. *Controller restart* (:meth:`Coordinator.restore`). The rings live in the controller's
   memory and die with it, and leases die with its connections. The task store brings back
   every accepted task (an older controller's JSON-lines journal is imported into it once),
   the unfinished ones as accepted in a new attempt (1), pushed before the control channel
   opens as far as the rings and the release bound let them -- the rest wait in the
   ``requeue``, owned by the controller, as in 1; workers' old jobs fail on their dead
   connections and they register again -- heard from again, they are no longer held against
   the tasks they lost.
8. *Checkpointed* (``dit.step``, ``dit.checkpointed``, ``keep.release``; ``resumes``, the
   store of :mod:`controller.tasks.checkpoints`). A DiT that checkpoints sends its loop
   state (``checkpoint``) while it holds the lease (4); the controller pulls it off the loop,
   in that worker's own lane, and keeps it only if the sender holds the lease of the current
   attempt, checked before the pull and again after it, so a task has at most one checkpoint
   and it is always its owning attempt's latest: one that was in flight when the attempt
   ended is discarded, never replacing the state a new attempt resumes from. Keeping it
   changes no ownership: the lease still owns the task, and the pull never delays the
   lease's end: the control server runs it as a task of its own, so the worker's heartbeats
   are answered meanwhile and its dropped connection revokes the lease at once (4) -- the
   pull and the release writes it has left are then dropped, what it kept is freed -- and a
   worker frozen mid-pull holds up only its own lane while its lease expires (4). When the
   attempt ends (worker gone, lease expired, a
   failure, a yield) the task is put back in play exactly as in 1 -- accepted, owned by the
   controller -- and only its route differs (:class:`controller.ownership.requeue.Route`, from
   :meth:`Resumes.route`): with a kept checkpoint the controller pushes a Phase1 item of the
   new attempt that names no tensors but ``resume: {step}`` (the DiT that claims it fetches
   the kept tensors with ``resume``, which only the lease holder of the current attempt
   may); with kept final latents, a Phase2 item naming them, so a decoder lost after the
   handoff costs one decode. From the push the task waits in that ring's stage and
   reconciliation (2) covers the item as any other. Final latents are kept from the DiT
   that produced them (the lease holder, or -- the decoder having claimed first -- the
   producer of the current attempt's Phase2 item) until the task ends. Kept tensors are
   read by consumers but never released by them (their descriptors carry no release word):
   the store frees them when the task ends (any terminal stage) or its checkpoint is
   replaced or found unusable (then the task starts over, uncharged). A drain or a
   preemption (``priorities`` picks whom to ask) is the same move: at a step
   boundary the DiT checkpoints, waits until the controller has it, and reports ``fail``
   with fault ``yielded``: uncharged, the task resumes from that step; refused, the DiT does
   not yield (it finishes the task). A zombie DiT that wakes after its task resumed
   elsewhere holds an old attempt: its checkpoints, progress, handoff, failure and
   ``resume`` are refused and its heartbeat tells it to stop; a Phase2 item it still
   publishes is refused at the decoder's claim (5). A restart (7) keeps what the checkpoint
   files hold: the unfinished tasks resume from them.
   Wan2.2-A14B's ``split`` placement (DiT workers holding one expert) is this window every
   time: at the boundary the high-noise worker's state is kept as any checkpoint (marked
   ``split``, its next expert ``low``) and the worker reports fault ``handover``, handled as
   ``yielded``. The task is put back in play as above, accepted and owned by the controller,
   but its route is no ring (:data:`controller.ownership.requeue.LOW`): ring claims are FIFO,
   and a high-noise worker must not pop it. It stays in the waiting list until a low-noise
   worker asks (``take``): :meth:`Claims.take` moves it to Phase1 and claims it for that
   worker in one synchronous step of the event loop, so its owner goes from the controller
   to the worker's lease with no slot, no message and no await between; the reply that
   carries the item may be lost with the worker, whose lease then ends as in (4), putting
   the task back in the waiting list. The attempt number fences the taker as any holder.

Cancelling (``cancel``) ends ownership like any terminal stage: a task no worker holds is
cancelled at once, and whoever claims its ring item next is refused and frees the buffers
the item names; a running one is told at its next progress report or heartbeat and stops
at a step boundary.

Each task put back in play (``recovery``) is charged to its retry budget by
the cause of the ended attempt (``budget``): only failures the task causes
count, and a task that keeps killing the workers that take it is quarantined as poison.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from contracts.messages import Checkpoint as CheckpointMsg
from contracts.messages import CheckpointReply, Fault
from contracts.roles import Role
from controller.config import CoordinatorConfig
from controller.ownership.admission import Admission
from controller.ownership.budget import RetryBudget
from controller.ownership.claims import Claims
from controller.ownership.completions import Completions
from controller.ownership.leases import Leases
from controller.ownership.priorities import Priorities
from controller.ownership.rates import CompletionRate
from controller.ownership.reconcile import Census
from controller.ownership.recovery import Recovery
from controller.ownership.registry import WorkerInfo, WorkerRegistry
from controller.ownership.requeue import Requeue
from controller.ownership.results import Results
from controller.ownership.resumes import Resumes
from controller.tasks.checkpoints import CheckpointStore
from controller.tasks.table import TaskTable
from controller.tasks.tasks import TERMINAL, Task
from rings.ring import Ring

log = logging.getLogger("diffring.controller")


class Coordinator:
    """Task lifecycle glue between the front door, the rings and the workers.

    Built from its sub-config and the parts the assembly made: the task table (its store
    already open; the coordinator closes it), the controller's own handle on the request
    ring, and optionally the input-image staging (``stage_image`` / ``release_image``) and
    the census of the rings it hosts (``census``; None: nothing to reconcile, e.g. the
    in-process baseline, whose queue hands items over without a gap). ``checkpoints``: the
    store of denoising checkpoints, with ``rings`` the controller's handles on the Phase1
    and Phase2 rings it pushes resumes to (None: no checkpoints kept). ``clock`` is the
    monotonic clock of leases and liveness; tests drive their own.
    """

    def __init__(
        self,
        config: CoordinatorConfig,
        table: TaskTable,
        request_ring: Ring,
        *,
        stage_image: Callable[[bytes], dict[str, Any]] | None = None,
        release_image: Callable[[Task], None] | None = None,
        census: Callable[[], Census] | None = None,
        checkpoints: CheckpointStore | None = None,
        rings: Mapping[str, Ring] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.table = table
        self.request_ring = request_ring
        self.stage_image = stage_image
        self.release_image = release_image
        self.census = census
        self.clock = clock
        self.leases = Leases(table.tasks, config.lease_timeout_s)
        self.registry = WorkerRegistry(config.pipeline, config.heartbeat_interval_s)
        self.results = Results(config.output_dir)
        self.result_writes = self.results.writes
        """Whether results can be written (the front door refuses new tasks while not)."""
        self.budget = RetryBudget(config.max_task_failures, config.poison_worker_deaths)
        self.rates = CompletionRate()
        self.checkpoints = checkpoints  # window 8
        # Each part reports through this coordinator as its Outbox (emit, announce): one
        # narrow interface, not a callback per report.
        self.resumes = Resumes(checkpoints, table, self)
        self.requeue = Requeue(  # pushed by the controller: from the start, or resumed (8)
            request_ring, table, self,
            rings=rings, route=self.resumes.route, limit=self._release_limit, clock=clock)
        self.priorities = Priorities(table, self.registry, self, config.preempt_after_s,
                                     config.max_preemptions)
        self.recovery = Recovery(table, self.budget, self.requeue, self, self._stage,
                                 config.lease_timeout_s, clock())
        self.claims = Claims(table, self.leases, self.priorities, self.requeue, self,
                             clock)  # windows 4, 5
        self.completions = Completions(table, self.results, self.rates, self, clock)
        self.admission = Admission(table, self.requeue, self.rates, self, clock,
                                   max_pending=config.max_pending,
                                   release_ahead=config.release_ahead)  # window 1
        self.listeners: list[Callable[[str, Task], None]] = []
        self.on_work: Callable[[str], object] | None = None
        """Called with a ring's name when an item was pushed to it (by this controller, or
        by a producer that reported the handoff): the doorbell that wakes idle workers."""

    # -- helpers ---------------------------------------------------------------------------
    def emit(self, event: str, task: Task) -> None:
        """Tell the listeners; at a terminal event, free what was kept for the task (its
        staged input image, its checkpoint). One half of the parts' :class:`Outbox`."""
        for fn in self.listeners:
            fn(event, task)
        if task.stage in TERMINAL:
            if self.release_image is not None and task.image:
                self.release_image(task)
            task.image = None
            task.image_bytes = None
            if self.checkpoints is not None:
                self.checkpoints.drop(task.task_id)  # window 8: its progress is over too

    def _stage(self, task: Task) -> None:
        """Stage the kept input image of ``task`` for its new attempt. The encoder of an
        ended attempt may have released the staged copy already; freeing the old block again
        is safe (it only frees the allocation the descriptor names, if still live)."""
        if task.image_bytes is None or self.stage_image is None:
            return
        if self.release_image is not None and task.image:
            self.release_image(task)
        task.image = self.stage_image(task.image_bytes)

    def _release_limit(self) -> int | None:
        """Tasks of a class and up that may be ahead of the DiTs (``requeue``)."""
        if self.config.release_ahead is None:
            return None
        return self.config.release_ahead + sum(
            w.role in (Role.ENCODER, Role.TRANSFORMER) for w in self.registry)

    def announce(self, ring: str | None) -> None:
        """Ring the doorbell of ``ring`` (work was pushed to it): the other half of the
        parts' :class:`Outbox`."""
        if ring is not None and self.on_work is not None:
            self.on_work(ring)

    def restore(self) -> int:
        """After a restart: reload the task store and put unfinished tasks back in play."""
        unfinished = self.table.restore()
        self.resumes.load(unfinished)  # window 8: they resume from their files
        for task in unfinished:
            self._stage(task)
            self.requeue.later(task)
        return len(unfinished)

    def close(self) -> None:
        """Finish pending result writes and close the task table (commits what is queued)."""
        self.results.close()
        self.table.close()
        if self.checkpoints is not None:
            self.checkpoints.close()

    # -- front door ------------------------------------------------------------------------
    def submit(self, task: Task) -> None:
        """Accept a task and queue it, or raise QueueFull and keep nothing of it (window 1):
        :meth:`Admission.submit`."""
        self.admission.submit(task)

    def cancel(self, task: Task) -> str:
        """Cancel a task: queued ones never start, running ones stop at the next step."""
        if task.stage in TERMINAL:
            return "do_nothing"
        task.cancel_requested = True
        if task.worker_id is None:
            # Nobody works on it: it waits in a ring (or for a requeue). Whoever claims it
            # next is told to drop it, and releases the buffers its descriptor names.
            self.table.cancelled(task, f"cancelled by the client while {task.stage.value}")
            self.emit("cancelled", task)
        log.info("task %s cancel requested (stage=%s)", task.task_id, task.stage.value)
        return "success"

    # -- control channel -------------------------------------------------------------------
    def on_register(
        self, role: str, name: str, pid: int, pipeline: str, segment: str, *,
        loras: tuple[str, ...] = (), caches: tuple[str, ...] = (),
        fused: tuple[tuple[str, float], ...] = (), recipe: str | None = None,
        checkpoints: bool = False, experts: str | None = None,
    ) -> WorkerInfo:
        info = self.registry.register(role, name, pid, pipeline, segment, self.clock(),
                                      loras=loras, caches=caches, fused=fused, recipe=recipe,
                                      checkpoints=checkpoints and self.checkpoints is not None,
                                      experts=experts)
        log.info("worker %d registered: %s %s pid=%d segment=%s", info.worker_id, role, name,
                 pid, segment)
        self.budget.worker_back(name, self.table)  # it was not killed: its connection dropped
        self.requeue.drain()  # the release bound grew
        return info

    def on_heartbeat(
        self, worker: WorkerInfo, tasks: list[str], staged: list[tuple[str, int]]
    ) -> tuple[list[str], list[tuple[str, int]]]:
        """Renew the worker's leases (window 4). Returns (of ``tasks``, those it should stop;
        of ``staged``, the (task, attempt) outputs it should free): :meth:`TaskTable.not_held`,
        :meth:`TaskTable.unwanted`."""
        now = self.clock()
        self.registry.heard(worker, now)
        self.budget.worker_back(worker.name, self.table)  # it outlived any lease it lost
        self.leases.renew(worker.worker_id, now)
        return self.table.not_held(worker.worker_id, tasks), self.table.unwanted(
            worker.role, staged)

    def on_claim(self, worker: WorkerInfo, task_id: str, attempt: int) -> tuple[bool, str]:
        """Grant, refuse (windows 2, 5) or defer a claim: :meth:`Claims.claim`."""
        return self.claims.claim(worker, task_id, attempt)

    def on_take(self, worker: WorkerInfo) -> dict[str, Any] | None:
        """A low-noise worker's ``take`` (window 8, ``split``): :meth:`Claims.take`."""
        return self.claims.take(worker)

    def on_progress(
        self, worker: WorkerInfo, task_id: str, attempt: int, step: int, steps: int,
        expert: str | None = None,
    ) -> bool:
        """Record a denoising step (and the expert that ran it); True when the worker should
        stop (cancel)."""
        return self.claims.progress(worker, task_id, attempt, step, steps, expert)

    def on_handoff(self, worker: WorkerInfo, task_id: str, attempt: int) -> None:
        self.claims.handoff(worker, task_id, attempt)  # window 5

    async def on_complete(
        self, worker: WorkerInfo, task_id: str, attempt: int, extension: str, media_type: str,
        data: bytes,
    ) -> bool:
        """Write the result file and record the completion (window 4):
        :meth:`Completions.complete`."""
        return await self.completions.complete(worker, task_id, attempt, extension,
                                               media_type, data)

    def on_fail(
        self, worker: WorkerInfo, task_id: str, attempt: int, error: str, error_type: str,
        retryable: bool, fault: str | None = None,
    ) -> None:
        worker.tasks.discard(task_id)
        task = self.table.held(task_id, attempt, worker.worker_id)
        if task is None:
            return  # not this worker's attempt (any more): its failure changes nothing
        if fault == Fault.HANDOVER:  # split: expected once per request, not a failure
            log.info("task %s handed over by worker=%s attempt=%d: %s", task_id, worker.name,
                     attempt, error)
        else:
            log.warning("task %s failed at worker=%s attempt=%d (%s, %s): %s", task_id,
                        worker.name, attempt, error_type, fault, error)
        if fault is None:  # a worker of an older build: only ``retryable``
            fault = Fault.TASK if retryable else Fault.INPUT
        self.recovery.failed(
            task, f"{worker.role} {worker.name}: {error}", error, error_type, fault,
            alive=lambda w: self.registry.alive(w, self.clock()), drop=self.resumes.drop,
            preempted=self.priorities.yielded)

    def on_dropped(
        self, worker: WorkerInfo, ring: str, reason: str, task_id: str | None,
        attempt: int | None,
    ) -> None:
        """A worker took an item from ``ring`` that it cannot run (window 3 of the module
        doc). Retry the task it names if it is that task's current item; an item that names
        no task is left to reconciliation."""
        log.warning("worker %s dropped an item of ring %s (task %s attempt %s): %s",
                    worker.name, ring, task_id, attempt, reason)
        self.recovery.dropped(worker, ring, reason, task_id, attempt)

    def on_gone(self, worker: WorkerInfo, reason: str) -> None:
        """A worker's control connection dropped or it reported a fatal error: every lease
        it holds is revoked at once (window 4)."""
        if not self.registry.drop(worker):
            return
        self.result_writes.forget(worker.name)
        held = self.leases.held_by(worker.worker_id)
        log.warning("worker %d (%s %s) gone: %s; %d task(s) back in play", worker.worker_id,
                    worker.role, worker.name, reason, len(held))
        self.recovery.worker_lost(worker, reason, held)
        self.resumes.worker_gone(worker)  # window 8: its pulls and releases left are dropped

    # -- checkpoints (window 8: resumes) ---------------------------------------------------
    async def on_checkpoint(self, worker: WorkerInfo, msg: CheckpointMsg) -> CheckpointReply:
        """Keep a DiT's checkpoint (pulled off the loop, in the worker's own lane); answered
        once kept or refused. The control server runs it as a task of its own, so the
        worker's other messages, and its connection dropping, are not held up meanwhile."""
        return await self.resumes.keep(worker, msg)

    def on_resume(self, worker: WorkerInfo, task_id: str, attempt: int) -> dict[str, Any]:
        """The kept checkpoint the lease holder of a resumed attempt starts from."""
        return self.resumes.fetch(worker, task_id, attempt)

    # -- periodic --------------------------------------------------------------------------
    def sweep(self, now: float) -> None:
        """Expire leases whose worker stopped heartbeating (window 4), reconcile the table
        with the rings (window 2), push pending requeues (window 1). ``now``: the clock's
        time of this sweep."""
        self.recovery.leases_expired(self.leases.expired(now), self._holder)
        self.registry.mark_silent(now - self.config.lease_timeout_s)
        if self.census is not None:
            self.reconcile(self.census(), now)
        self.requeue.drain()
        self.priorities.sweep(now)

    def reconcile(self, present: Census, now: float) -> int:
        """Put back in play every task missing from its ring for ``lease_timeout_s``
        (window 2 of the module doc); returns how many. ``present``: what the rings hold,
        read on this thread just now, so no claim can land between that read and this."""
        return self.recovery.reconcile(present, now)

    def _holder(self, task: Task) -> str:
        worker = self.registry.get(task.worker_id)
        return worker.name if worker else "?"
