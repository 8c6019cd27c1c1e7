"""Message layouts shared by the controller and the workers (one definition each).

Ring payloads are msgpack maps (framed by :mod:`rings.payload`); the ``kind`` field says
which one. Control-channel messages are msgpack maps in length-prefixed frames; ``op`` says
which one. Field names are part of the protocol: add fields, never reuse one for a new
meaning, and bump ``CONTROL_VERSION`` on an incompatible change.

Ring payloads
    request ring  {kind: "task", task_id, attempt, pipeline, request, image}
    phase1 ring   {kind: "phase1", task_id, attempt, pipeline, request, tensors, producer}
    phase2 ring   {kind: "phase2", task_id, attempt, pipeline, request, tensors, producer}
  A task handed over at Wan2.2-A14B's boundary (the ``split`` placement) waits at the
  controller, not in a ring, and a low-noise worker gets its resume item with ``take``.
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
  One typed message per op below (:class:`ControlMessage`), each a msgspec struct whose
  fields, types and meaning are the protocol; :func:`encode` and :func:`decode` are the only
  way a message becomes a msgpack map and back, and :func:`decode` refuses a map whose fields
  have the wrong types (:class:`BadMessage`, naming the field). Replies are typed the same
  way (``*Reply``). The handshake carries :data:`CONTROL_VERSION`; the controller refuses a
  worker of another version (another build of diffring) before it registers.
  reply frame: {seq, ok: True, <the reply's fields>} or {seq, ok: False, error}

Doorbell channel (a worker's second connection to the control port, handshake extra
``channel: "doorbell"``; it never registers, and carries only :class:`Wait`): answered when
``ring`` holds a published item (at once if it already does), or with ``wake: False`` after
``timeout_s``. A wake-up is a hint: the worker still claims through the ring.

Leases: a claim starts a lease on the task for the claiming worker; heartbeats renew every
lease the worker holds; a handoff, completion or failure ends it. A lease that expires, or
whose worker's control connection drops, puts the task back in play (a new attempt).
"""

from __future__ import annotations

import enum
from typing import Any, Final, TypeVar

import msgspec

from contracts.roles import Role

CONTROL_RING = "control"
CONTROL_VERSION = 2
"""Version of the control messages below, sent in the control handshake and checked there:
bump it on an incompatible change (a field removed, renamed or given another meaning or
type). Adding an optional field keeps the version. 2: typed messages; ``stage`` of claim,
handoff and fail, ``worker_path`` of complete and the heartbeat reply's ``drop`` gone (sent,
never read)."""


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
    TAKE = "take"


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
    HANDOVER = "handover"
    """Wan2.2-A14B's ``split`` placement: the worker holds one expert and handed the task
    back at the boundary with its state kept, for a worker holding the other: as YIELDED,
    never counted (and expected: every request of a split group has one)."""


# Ring payload kind each role consumes.
ROLE_INPUT_KIND: Final[dict[Role, Kind]] = {
    Role.ENCODER: Kind.TASK,
    Role.TRANSFORMER: Kind.PHASE1,
    Role.DECODER: Kind.PHASE2,
}


# -- the control channel's messages -----------------------------------------------------------
# Each op is a struct tagged by its ``op`` field; kw_only so a field can never be given by
# position; a field left at its default is not sent (the other end fills it in). Unknown
# fields are ignored on decode: a newer peer's optional field does not break an older one
# (see CONTROL_VERSION).


class Message(msgspec.Struct, kw_only=True, omit_defaults=True, tag_field="op"):
    """A control message (worker -> controller)."""


class Reply(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The controller's answer to one message (its fields, beside ``seq`` and ``ok``)."""


class Endpoint(msgspec.Struct):
    what: str
    host: str
    port: int


class Preflight(Message, tag="preflight"):
    """Sent before register: the controller opens a TCP connection to each endpoint the
    worker advertises (its Mooncake segment) and refuses, naming the address and what
    failed, when one cannot be reached."""

    role: str
    name: str
    endpoints: list[Endpoint]


class Checked(msgspec.Struct):
    what: str
    host: str
    port: int
    seconds: float


class PreflightReply(Reply):
    checked: list[Checked] = []


class Describe(Message, tag="describe"):
    """What the controller serves, asked before register (``--check`` of a worker compares
    it with its own configuration)."""


class DescribeReply(Reply):
    pipeline: str


class FusedAdapter(msgspec.Struct):
    name: str
    strength: float


class Register(Message, tag="register"):
    role: str
    name: str
    pid: int
    pipeline: str
    segment: str = ""
    loras: list[str] = []
    """The adapters of a DiT's ``lora_dir`` requests may name."""
    caches: list[str] = []
    """The step-cache kinds a DiT runs."""
    fused: list[FusedAdapter] = []
    """The adapters a DiT merged into its weights at load (``transformer.lora_fuse``)."""
    recipe: str | None = None
    """The distilled recipe a DiT serves (:mod:`contracts.recipes`), or None."""
    checkpoints: bool = False
    """The DiT checkpoints its loops and can yield at a step boundary."""
    experts: str | None = None
    """Wan2.2-A14B's ``split`` placement: the one expert this DiT holds (``high`` / ``low``;
    a ``low`` one takes its tasks with ``take``); None: every DiT of the model."""


class RegisterReply(Reply):
    worker_id: int
    heartbeat_interval_s: float
    lease_timeout_s: float
    checkpoints: bool
    """The controller keeps checkpoints (its store is on)."""


class StorageReport(msgspec.Struct):
    """A decoder's results held because their files cannot be written."""

    error: str
    held: int
    since: float


class Heartbeat(Message, tag="heartbeat"):
    tasks: list[str] = []
    """The tasks whose leases this renews."""
    staged: list[tuple[str, int]] = []
    """(task, attempt) of the outputs this producer keeps staged for the next stage."""
    storage: StorageReport | None = None
    """Decoders only: None, or the results held (the front door refuses new tasks
    meanwhile)."""
    stats: dict[str, Any] | None = None
    """The stage's memory report (resident / peak bytes), shown in the status."""


class HeartbeatReply(Reply):
    cancel: list[str] = []
    """Tasks to stop: cancelled, over, or no longer this worker's (its lease expired)."""
    drop_staged: list[tuple[str, int]] = []
    """Staged outputs nobody will pull any more, by attempt (an older attempt's may be
    unwanted while the current one's is being read)."""
    yield_: list[str] = msgspec.field(default_factory=list, name="yield")
    """Tasks to hand back at the next step boundary, checkpointed (preempted)."""


class Claim(Message, tag="claim"):
    task_id: str
    attempt: int


class ClaimReply(Reply):
    proceed: bool
    reason: str = ""
    defer: bool = False
    """Not now: a more urgent task waits encoded (the DiT pushes the item back to its
    ring)."""


class Progress(Message, tag="progress"):
    task_id: str
    attempt: int
    step: int
    steps: int
    expert: str | None = None
    """Wan2.2-A14B: the expert that ran the step (``high`` / ``low``); None: one DiT."""


class ProgressReply(Reply):
    cancel: bool = False
    yield_: bool = msgspec.field(default=False, name="yield")


class Checkpoint(Message, tag="checkpoint"):
    """A DiT's loop state after ``step`` of ``steps``, staged in its pool; answered once the
    controller pulled it (its reads release the DiT's blocks)."""

    task_id: str
    attempt: int
    step: int
    steps: int
    final: bool = False
    """The Phase2 outputs (kept until the result is written), not a loop state."""
    meta: dict[str, Any] = {}
    """The non-tensor scheduler state."""
    state: list[dict[str, Any]] = []
    """Descriptor maps of the latents and scheduler tensors (or, final, the outputs)."""
    phase1: list[dict[str, Any]] | None = None
    """Descriptor maps of the encoder's outputs, or None when the controller has them."""


class CheckpointReply(Reply):
    accepted: bool
    reason: str = ""


class Resume(Message, tag="resume"):
    """The kept checkpoint a resumed attempt starts from."""

    task_id: str
    attempt: int


class ResumeReply(Reply):
    """Descriptor maps without a release word, in the controller's pool."""

    step: int
    steps: int
    final: bool
    meta: dict[str, Any]
    phase1: list[dict[str, Any]]
    state: list[dict[str, Any]]


class Take(Message, tag="take"):
    """A low-noise DiT worker of the ``split`` placement asks for a task handed over at the
    boundary: the controller holds those (never in a ring: ring claims are FIFO, and a
    high-noise worker must not pop one), and grants the claim in the same step."""


class TakeReply(Reply):
    """``item``: the resume item of the task now claimed by the asking worker (its lease
    started), None when no task waits for a low-noise worker."""

    item: dict[str, Any] | None = None


class Handoff(Message, tag="handoff"):
    task_id: str
    attempt: int


class Complete(Message, tag="complete"):
    task_id: str
    attempt: int
    extension: str
    media_type: str
    data: bytes


class CompleteReply(Reply):
    accepted: bool
    storage_error: str | None = None
    """The controller cannot write its copy for the storage's reasons (full, read-only,
    ...): the decoder holds the result and sends it again later."""


class Fail(Message, tag="fail"):
    """``fault`` (:class:`Fault`) says whose fault the failed attempt was; the controller
    decides from it (and from what it knows: is the producer still alive?) whether the
    attempt counts against the task's retry budget."""

    task_id: str
    attempt: int
    error: str
    error_type: str = "error"
    retryable: bool = False
    fault: str | None = None


class Dropped(Message, tag="dropped"):
    """A ring item the worker took but cannot run (corrupt, wrong kind, malformed);
    ``task_id`` / ``attempt`` are None when the item cannot name its task."""

    ring: str
    reason: str = ""
    slot: int | None = None
    task_id: str | None = None
    attempt: int | None = None


class Fatal(Message, tag="fatal"):
    """The worker is about to exit."""

    error: str


class Bye(Message, tag="bye"):
    """Graceful deregistration."""


class Wait(Message, tag="wait"):
    """Doorbell channel: wake me when ``ring`` holds a published item. ``ticket``: the pop
    ticket (ring position) the worker holds, or None; the holder of a published position is
    woken first."""

    ring: str
    timeout_s: float
    ticket: int | None = None


class WaitReply(Reply):
    wake: bool


class Empty(Reply):
    """The reply of an op that answers nothing but ``ok``."""


ControlMessage = (Preflight | Describe | Register | Heartbeat | Claim | Progress | Checkpoint
                  | Resume | Take | Handoff | Complete | Fail | Dropped | Fatal | Bye | Wait)
"""Every message a worker sends on the control port."""

OP: Final[dict[type[Message], Op]] = {
    cls: Op(str(cls.__struct_config__.tag))
    for cls in (Preflight, Describe, Register, Heartbeat, Claim, Progress, Checkpoint, Resume,
                Take, Handoff, Complete, Fail, Dropped, Fatal, Bye, Wait)
}
"""The op of each message type (its tag); every :class:`Op` has one."""
assert set(OP.values()) == set(Op), "an Op without its message type"


class BadMessage(ValueError):
    """A control map that is not a valid message: an unknown op, a missing field, a field
    of the wrong type. The text names the field."""


_BUILTIN = (bytes, bytearray, memoryview)  # msgpack carries bytes as they are


def encode(msg: msgspec.Struct) -> dict[str, Any]:
    """The msgpack map of a message (``op`` included), a reply, or a part of one."""
    out: dict[str, Any] = msgspec.to_builtins(msg, builtin_types=_BUILTIN)
    return out


def decode(data: dict[str, Any]) -> ControlMessage:
    """The message a control map holds; :class:`BadMessage` if it holds none."""
    try:
        msg: ControlMessage = msgspec.convert(data, ControlMessage)
    except msgspec.ValidationError as exc:
        raise BadMessage(f"malformed {data.get('op')!r} message: {exc}") from None
    return msg


R = TypeVar("R", bound=Reply)


def decode_reply(data: dict[str, Any], kind: type[R]) -> R:
    """The reply of type ``kind`` a control map holds (``seq`` and ``ok`` ignored)."""
    try:
        return msgspec.convert(data, kind)
    except msgspec.ValidationError as exc:
        raise BadMessage(f"malformed {kind.__name__}: {exc}") from None
