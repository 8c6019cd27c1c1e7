"""Message layouts shared by the controller and the workers (one definition each).

Ring payloads are msgpack maps (framed by :mod:`rings.payload`); the ``kind`` field says
which one. Control-channel messages are msgpack maps in length-prefixed frames; ``op`` says
which one. Field names are part of the protocol: add fields, never reuse one for a new
meaning, and bump ``CONTROL_VERSION`` on an incompatible change.

Ring payloads
    request ring  {kind: "task", task_id, attempt, pipeline, request, image}
    phase1 ring   {kind: "phase1", task_id, attempt, pipeline, request, tensors, producer}
    phase2 ring   {kind: "phase2", task_id, attempt, pipeline, request, tensors, producer}
  A phase1 item the controller pushes itself to resume a task from its checkpoint carries
  ``tensors: []``, ``producer: "controller"`` and ``resume: {step, steps}`` (the DiT fetches
  the kept tensors with ``resume``); a phase2 item it pushes to re-run only the decoder names
  the kept final latents, whose descriptors have no release word (the controller frees them).
  ``request`` is the generation request as a map; ``image`` a tensor descriptor map or None;
  ``tensors`` a list of tensor descriptor maps (segment, address, bytes, dtype, shape,
  checksum, release word); ``producer`` the producing worker's name (for error messages).

Control channel (worker -> controller; every request gets one reply with the same ``seq``,
in the order the requests came except ``checkpoint``'s, sent when its pull is done: a worker
matches replies to requests by ``seq``)
    preflight {role, name, endpoints: [{what, host, port}]}
                                                    -> {checked: [{what, host, port, seconds}]}
              the controller opens a TCP connection to each endpoint the worker advertises
              (its Mooncake segment) and refuses (ok: False, error naming the address and
              what failed) when one cannot be reached; sent before register
    describe  {}                                    -> {pipeline}
              what the controller serves, asked before register (``--check`` of a worker
              compares it with its own configuration)
    register  {role, name, pid, pipeline, segment, checkpoints}
                                                    -> {worker_id, heartbeat_interval_s,
                                                        lease_timeout_s, checkpoints}
              checkpoints (request): the DiT checkpoints its loops and can yield at a step
              boundary; (reply): the controller keeps checkpoints (its store is on)
    heartbeat {tasks: [task_id], staged: [[task_id, attempt]], storage}
                                                    -> {cancel: [task_id],
                                                        drop_staged: [[task_id, attempt]],
                                                        drop: [task_id], yield: [task_id]}
              cancel: tasks to stop (cancelled, over, or no longer this worker's: its lease
              expired); drop_staged: staged outputs nobody will pull any more, by attempt
              (an older attempt's may be unwanted while the current one's is being read);
              drop: their task ids, for workers of an older build only; yield: tasks to
              hand back at the next step boundary, checkpointed (preempted); storage
              (decoders only): None, or {error, held, since} while results are held because
              their files cannot be written (the front door refuses new tasks meanwhile)
    claim     {task_id, attempt, stage}             -> {proceed: bool, reason, defer: bool}
              defer: not now, a more urgent task waits encoded (the DiT pushes the item
              back to its ring)
    progress  {task_id, attempt, step, steps}       -> {cancel: bool, yield: bool}
    checkpoint {task_id, attempt, step, steps, final, meta, phase1, state}
                                                    -> {accepted: bool, reason}
              a DiT's loop state after ``step`` of ``steps``, staged in its pool: ``state``
              (latents and scheduler tensors, or with ``final`` the Phase2 outputs) and
              ``phase1`` (the encoder's outputs, or None when the controller has them) are
              descriptor lists, ``meta`` the non-tensor scheduler state; answered once the
              controller pulled them (its reads release the DiT's blocks)
    resume    {task_id, attempt}                    -> {step, steps, final, meta, phase1,
                                                        state}
              the kept checkpoint a resumed attempt starts from (descriptors without a
              release word, in the controller's pool)
    handoff   {task_id, attempt, stage}             -> {}
    complete  {task_id, attempt, extension, media_type, data, worker_path}
                                                    -> {accepted, storage_error}
              storage_error: the controller cannot write its copy for the storage's reasons
              (full, read-only, ...): the decoder holds the result and sends it again later
    fail      {task_id, attempt, stage, error, error_type, retryable, fault} -> {}
    dropped   {ring, slot, reason, task_id, attempt}  -> {}   a ring item the worker took but
                                                    cannot run (corrupt, wrong kind, malformed);
                                                    task_id / attempt are None when the item
                                                    cannot name its task
    fatal     {error}                               -> {}   the worker is about to exit
    bye       {}                                    -> {}   graceful deregistration
  reply: {seq, ok: True, ...} or {seq, ok: False, error}

``fault`` of a ``fail`` (:class:`Fault`) says whose fault the failed attempt was; the
controller decides from it (and from what it knows: is the producer still alive?) whether the
attempt counts against the task's retry budget.

Doorbell channel (a worker's second connection to the control port, handshake extra
``channel: "doorbell"``; it never registers, and carries only)
    wait      {ring, timeout_s, ticket}             -> {wake: bool}
  answered when ``ring`` holds a published item (at once if it already does), or with
  ``wake: False`` after ``timeout_s``. A wake-up is a hint: the worker still claims through
  the ring. ``ticket``: the pop ticket (ring position) the worker holds, or None; the
  holder of a published position is woken first.

Leases: a claim starts a lease on the task for the claiming worker; heartbeats renew every
lease the worker holds; a handoff, completion or failure ends it. A lease that expires, or
whose worker's control connection drops, puts the task back in play (a new attempt).
"""

from __future__ import annotations

import enum
from typing import Final

from contracts.roles import Role

CONTROL_RING = "control"
CONTROL_VERSION = 1


class Kind(enum.StrEnum):
    TASK = "task"
    PHASE1 = "phase1"
    PHASE2 = "phase2"


class Op(enum.StrEnum):
    PREFLIGHT = "preflight"
    DESCRIBE = "describe"
    REGISTER = "register"
    HEARTBEAT = "heartbeat"
    CLAIM = "claim"
    PROGRESS = "progress"
    HANDOFF = "handoff"
    COMPLETE = "complete"
    FAIL = "fail"
    FATAL = "fatal"
    BYE = "bye"
    WAIT = "wait"
    DROPPED = "dropped"
    CHECKPOINT = "checkpoint"
    RESUME = "resume"


DOORBELL_CHANNEL: Final = "doorbell"
"""Handshake ``channel`` of a worker's doorbell connection (see the module docstring)."""


class Fault(enum.StrEnum):
    """Whose fault a failed attempt was (the ``fault`` field of a ``fail`` message)."""

    SYSTEM = "system"
    """The infrastructure's (lost connection, revoked ring claim, full pool, injected fault):
    retried, never counted against the task."""
    TRANSFER = "transfer"
    """A Mooncake transfer from the producer failed: not counted when the producer is gone
    (its buffer died with it), counted when it is alive."""
    TASK = "task"
    """The task's (its stage raised, its tensors keep failing their checksum): retried and
    counted (``max_task_failures``)."""
    INPUT = "input"
    """The task can never succeed (a request the model cannot serve): failed at once."""
    CANCELLED = "cancelled"
    """The client cancelled it."""
    YIELDED = "yielded"
    """The worker handed the task back at a step boundary after checkpointing it (drained,
    or preempted by a more urgent task): resumed from that step, never counted."""


# Ring payload kind each role consumes.
ROLE_INPUT_KIND: Final[dict[Role, Kind]] = {
    Role.ENCODER: Kind.TASK,
    Role.TRANSFORMER: Kind.PHASE1,
    Role.DECODER: Kind.PHASE2,
}
