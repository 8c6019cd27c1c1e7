"""Errors of the tensor plane, under :class:`contracts.errors.TransferError`: each names the
task, tensor and peer it concerns."""

from __future__ import annotations

from concurrent.futures import Future

from contracts.errors import TransferError

__all__ = [
    "ChecksumMismatch",
    "DescriptorError",
    "EngineError",
    "MooncakeConfigError",
    "MooncakeNotInstalled",
    "PoolExhausted",
    "RequestTooLarge",
    "TransferError",
    "TransferFailed",
]


class MooncakeNotInstalled(TransferError):
    """The mooncake package (or the libibverbs it links) cannot be imported."""


class MooncakeConfigError(TransferError, ValueError):
    """Invalid Mooncake settings: bad value, unknown key, unreadable config file."""


class EngineError(TransferError):
    """The engine could not start, register or unregister memory, or was used unstarted."""


class TransferFailed(TransferError):
    """A Mooncake read or write failed (non-zero rc, exception, or deadline passed).

    ``pending`` is set when the caller stopped waiting but Mooncake still owns the call: the
    local buffer may still be written, so it must not be reused until ``pending`` is done
    (``StagingPool.quarantine`` does that).
    """

    def __init__(
        self,
        message: str,
        *,
        nbytes: int,
        rc: int | None = None,
        timed_out: bool = False,
        pending: Future[int] | None = None,
        task_id: str | None = None,
        tensor: str | None = None,
        peer: str | None = None,
    ) -> None:
        super().__init__(message, task_id=task_id, tensor=tensor, peer=peer)
        self.nbytes = nbytes
        self.rc = rc
        self.timed_out = timed_out
        self.pending = pending


class ChecksumMismatch(TransferError):
    """The bytes pulled do not hash to the descriptor's checksum (torn, stale or foreign)."""

    def __init__(self, message: str, *, expected: int, actual: int, **where: str | None) -> None:
        super().__init__(message, **where)
        self.expected = expected
        self.actual = actual


class PoolExhausted(TransferError):
    """Backpressure: no block of the requested size became free before the timeout."""

    def __init__(
        self, message: str, *, requested: int, free_bytes: int, **where: str | None
    ) -> None:
        super().__init__(message, **where)
        self.requested = requested
        self.free_bytes = free_bytes


class RequestTooLarge(TransferError, ValueError):
    """A request that can never fit (larger than the whole pool): failed at once, no wait."""

    def __init__(self, message: str, *, requested: int, capacity: int, **where: str | None) -> None:
        super().__init__(message, **where)
        self.requested = requested
        self.capacity = capacity


class DescriptorError(TransferError, ValueError):
    """A tensor descriptor that is malformed (unknown key, wrong type, inconsistent size)."""
