"""The project's exception tree, in one place.

Every error diffring raises on purpose derives from :class:`DiffringError`. The root and the
metadata-plane branch are defined in :mod:`rings.errors` (``rings`` is the bottom layer and
imports nothing of ours) and re-exported here; the task-level branch is defined here. The
tensor plane adds its transfer errors under :class:`TransferError`
(:mod:`tensorplane.errors`); the model adapters add theirs under :class:`StageError` (below).
Nobody invents a new root.

    DiffringError
    ├── ConfigError                 bad or unknown configuration
    │   └── PreflightFailed         an advertised address does not work (which, and why)
    ├── VerbsError                  a one-sided verb could not be executed
    │   ├── VerbRangeError          out-of-region offset/length (peer asked for it)
    │   ├── VerbAlignmentError      atomic on an address that is not 8-byte aligned
    │   ├── TransportUnavailable    the transport cannot run here (no RDMA device, ...)
    │   ├── ConnectionLost          the peer or server went away mid-request
    │   └── HandshakeError          refused at handshake (token, ring or layout mismatch)
    ├── RingError                   ring-level failures
    │   ├── PayloadTooLarge         a payload does not fit its slot (size and limit named)
    │   ├── PayloadCorrupt          checksum/version/length check failed on a slot payload
    │   ├── RingFull / RingEmpty    timeouts of the blocking push/pop layer
    │   └── LayoutMismatch          a region header does not describe the expected layout
    ├── ControlRefused              the controller answered a control request with an error
    ├── FaultInjected               a fault point fired with action ``raise`` (contracts.faults)
    ├── ResultWriteBlocked          a result file cannot be written for the storage's reasons
    │                               (full, read-only, missing or forbidden folder): held
    └── TaskError                   a task-level failure (carries the task id)
        ├── TransferError           moving a tensor between stages failed (task, tensor,
        │   │                       peer named); subclasses in tensorplane.errors
        ├── CheckpointError         a denoising checkpoint cannot be taken, kept or resumed
        └── StageError              a model stage failed to load or run
            └── ModelError          raised by the stage adapters
                ├── ModelLoadError       missing folder/component, bad device/dtype/backend
                ├── InvalidRequestError  a request field the task or model cannot serve
                ├── StageInputError      a stage got inputs outside its contract
                │   └── AdapterError     a LoRA adapter a request names cannot be served
                ├── StageCancelled       the caller asked a running stage to stop
                └── StageYielded         the loop stopped at a step boundary with its state
                                         checkpointed (drain, preemption): handed back
"""

from __future__ import annotations

import errno

from rings.errors import (
    ConfigError,
    ConnectionLost,
    DiffringError,
    HandshakeError,
    LayoutMismatch,
    PayloadCorrupt,
    PayloadTooLarge,
    RingEmpty,
    RingError,
    RingFull,
    TransportUnavailable,
    VerbAlignmentError,
    VerbRangeError,
    VerbsError,
)

__all__ = [
    "AdapterError",
    "CheckpointError",
    "ConfigError",
    "ConnectionLost",
    "ControlRefused",
    "DiffringError",
    "FaultInjected",
    "HandshakeError",
    "InvalidRequestError",
    "LayoutMismatch",
    "ModelError",
    "ModelLoadError",
    "PayloadCorrupt",
    "PayloadTooLarge",
    "PreflightFailed",
    "ResultWriteBlocked",
    "RingEmpty",
    "RingError",
    "RingFull",
    "StageCancelled",
    "StageError",
    "StageInputError",
    "StageYielded",
    "TaskError",
    "TransferError",
    "TransportUnavailable",
    "VerbAlignmentError",
    "VerbRangeError",
    "VerbsError",
]


class PreflightFailed(ConfigError):
    """A service's transport preflight failed: the address it advertises cannot be reached
    (or used) the way its peers will use it. The message names the address and what failed."""


class ControlRefused(DiffringError):
    """The controller answered a control-channel request with an error."""


class FaultInjected(DiffringError):
    """A fault point armed with ``raise`` fired where the real failure has no error of its own
    (:mod:`contracts.faults`); it counts as the system's fault, never the task's."""


STORAGE_ERRNOS = frozenset({
    errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT,
    errno.EIO, errno.ESTALE, errno.ENOTCONN,
})
"""``errno`` of a write that failed for the storage's reasons: no space or quota, a read-only,
forbidden or vanished folder, a lost network mount. None is the task's doing, and each clears
when someone fixes the storage. (A name too long, a path that is a folder: not listed; those
come from the task's own ``save_result_path``.)"""


def storage_fault(exc: BaseException) -> bool:
    """Whether ``exc`` is a write failure of the storage (:data:`STORAGE_ERRNOS`)."""
    return isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS


class ResultWriteBlocked(DiffringError):
    """A result file cannot be written now for the storage's reasons (:func:`storage_fault`):
    the decoder holds the result and retries; the task is not charged."""


class TaskError(DiffringError):
    """A failure that concerns one task."""

    def __init__(self, message: str, *, task_id: str | None = None) -> None:
        super().__init__(message)
        self.task_id = task_id


def _where(task_id: str | None, tensor: str | None, peer: str | None) -> str:
    parts = [f"task {task_id}" if task_id else "", f"tensor {tensor!r}" if tensor else ""]
    parts.append(f"peer {peer}" if peer else "")
    return ", ".join(p for p in parts if p)


class TransferError(TaskError):
    """Moving a tensor between stages failed; the message says which task, tensor and peer
    it concerns (also kept as attributes)."""

    def __init__(
        self,
        message: str,
        *,
        task_id: str | None = None,
        tensor: str | None = None,
        peer: str | None = None,
    ) -> None:
        where = _where(task_id, tensor, peer)
        super().__init__(f"{message} [{where}]" if where else message, task_id=task_id)
        self.tensor = tensor
        self.peer = peer


class StageError(TaskError):
    """A model stage failed to load or to run."""


class ModelError(StageError):
    """Base class of the stage adapters' errors."""


class ModelLoadError(ModelError):
    """A stage could not load its components: missing folder or component, unreadable weights,
    an unavailable device, dtype or attention backend."""


class InvalidRequestError(ModelError, ValueError):
    """A request field has a value the task or the loaded model cannot serve."""


class StageInputError(ModelError, ValueError):
    """A stage received inputs that do not fit its contract: a missing or misshapen tensor,
    an input image that is missing, unexpected or not decodable."""


class AdapterError(StageInputError):
    """A LoRA adapter a request names cannot be served here: not in the worker's folder,
    unreadable, not a LoRA checkpoint, or matching no layer of the model (the file named)."""


class StageCancelled(ModelError):
    """The caller asked a running stage to stop (``should_stop()`` returned True)."""

    def __init__(self, message: str, completed_steps: int = 0, total_steps: int = 0) -> None:
        super().__init__(message)
        self.completed_steps = completed_steps
        self.total_steps = total_steps


class StageYielded(ModelError):
    """The denoising loop stopped at a step boundary after its state was checkpointed outside
    the worker (a drain or a preemption): the task is handed back, not failed, and resumes
    from that step on any DiT worker."""

    def __init__(self, message: str, step: int, total: int, why: str) -> None:
        super().__init__(message)
        self.step = step
        self.total = total
        self.why = why
        """``drain`` (the worker is stopping) or ``preempted`` (a more urgent task)."""


class CheckpointError(TaskError):
    """A denoising checkpoint could not be taken, kept or resumed (the task id named): the
    scheduler holds state that cannot travel, the controller refused it (its store is full),
    or a resume could not fetch it."""
