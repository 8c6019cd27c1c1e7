"""The controller's own refusals (both under :class:`contracts.errors.DiffringError`)."""

from __future__ import annotations

from contracts.errors import DiffringError


class QueueFull(DiffringError):
    """The request ring (or the in-flight limit) has no room: answer 429."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ControlError(DiffringError):
    """A control-channel request that cannot be honoured (reply ok: False)."""
