"""The root of the project's exception tree and its metadata-plane branch.

``rings`` is the bottom layer: it imports nothing else of diffring, so the root
:class:`DiffringError` and the errors of verbs and rings are defined here. The whole tree,
task-level errors included, is documented and completed in :mod:`contracts.errors`, which
re-exports these; code above ``rings`` imports errors from there. Backend errors (socket
errors, pyverbs errors) are translated into these at the boundary where they happen, so
callers never see ``-1`` or a bare ``OSError``.

    DiffringError, ConfigError; VerbsError (VerbRangeError, VerbAlignmentError,
    TransportUnavailable, ConnectionLost, HandshakeError); RingError (PayloadTooLarge,
    PayloadCorrupt, RingFull, RingEmpty, LayoutMismatch). The tree is drawn, with what each
    one means, in :mod:`contracts.errors`.
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
