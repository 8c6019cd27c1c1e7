"""The measured completion rate, for the ``Retry-After`` of a refused submission."""

from __future__ import annotations

import collections

KEPT = 256
"""Completions remembered (a rate over the last few minutes needs no more)."""


class CompletionRate:
    """Completions per second over a trailing window; times are the caller's ``now``."""

    def __init__(self) -> None:
        self._at: collections.deque[float] = collections.deque(maxlen=KEPT)

    def completed(self, now: float) -> None:
        self._at.append(now)

    def per_second(self, now: float, window_s: float = 300.0) -> float | None:
        """Completions per second over the last ``window_s`` (None before two of them)."""
        recent = [t for t in self._at if now - t <= window_s]
        if len(recent) < 2:
            return None
        return len(recent) / max(now - min(recent), 1e-3)
