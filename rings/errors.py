"""The project's exception tree, in one place.

Every error diffring raises on purpose derives from :class:`DiffringError`. Backend errors
(socket errors, pyverbs errors, Mooncake return codes) are translated into these at the
boundary where they happen, so callers never see ``-1`` or a bare ``OSError``.

    DiffringError
    ├── ConfigError                 bad or unknown configuration
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
    └── TaskError                   a task-level failure (carries the task id)
        ├── TransferError           moving a tensor between stages failed
        └── StageError              a model stage failed to load or run

Workers and the controller add their own subclasses of these; they do not invent new roots.
"""

from __future__ import annotations


class DiffringError(Exception):
    """Root of every error diffring raises on purpose."""


class ConfigError(DiffringError):
    """A configuration value or file is invalid; the message names the key."""


class VerbsError(DiffringError):
    """A verb could not be executed. ``offset`` names the region offset when known."""

    def __init__(self, message: str, *, offset: int | None = None) -> None:
        super().__init__(message)
        self.offset = offset


class VerbRangeError(VerbsError):
    """A verb touched bytes outside the region."""


class VerbAlignmentError(VerbsError):
    """An atomic verb was issued on an offset that is not 8-byte aligned."""


class TransportUnavailable(VerbsError):
    """The requested transport cannot run on this machine (e.g. no RDMA device)."""


class ConnectionLost(VerbsError):
    """The connection to the verbs server dropped (or was revoked) mid-request."""


class HandshakeError(VerbsError):
    """The server refused the connection at handshake; the message names both sides."""


class RingError(DiffringError):
    """Ring-level failure. ``ring`` and ``slot`` name where, when known."""

    def __init__(self, message: str, *, ring: str | None = None, slot: int | None = None):
        super().__init__(message)
        self.ring = ring
        self.slot = slot


class PayloadTooLarge(RingError):
    """A payload does not fit in a slot."""

    def __init__(self, size: int, limit: int, *, ring: str | None = None) -> None:
        where = f" of ring {ring!r}" if ring else ""
        super().__init__(
            f"payload of {size} bytes does not fit a slot{where} (limit {limit} bytes)",
            ring=ring,
        )
        self.size = size
        self.limit = limit


class PayloadCorrupt(RingError):
    """A slot payload failed its length, version or checksum check."""


class RingFull(RingError):
    """Blocking push timed out because the ring stayed full."""


class RingEmpty(RingError):
    """Blocking pop timed out because the ring stayed empty."""


class LayoutMismatch(RingError):
    """A region header does not match the layout the caller expects."""


class TaskError(DiffringError):
    """A failure that concerns one task."""

    def __init__(self, message: str, *, task_id: str | None = None) -> None:
        super().__init__(message)
        self.task_id = task_id


class TransferError(TaskError):
    """Moving a tensor between stages failed (transfer error, checksum mismatch, ...)."""


class StageError(TaskError):
    """A model stage failed to load or to run."""
