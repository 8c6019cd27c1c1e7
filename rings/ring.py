"""One peer's handle on a ring: :class:`Ring`, the blocking layer over the non-blocking core.

The protocol (tickets, seats, stamps, claims) and its two operations that never block,
``try_push`` (the item is handed back when the ring is full) and ``try_pop`` (None when it is
empty), are :class:`rings.core.RingCore`. This layer adds what waiting needs: ``push`` and
``pop`` poll with back-off and give up after a timeout (RingFull, RingEmpty).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from rings.core import RingCore
from rings.errors import RingEmpty, RingFull
from rings.verbs import Verbs

# The blocking layer's polling delays (seconds).
POLL_MIN = 50e-6
POLL_MAX = 0.005
# Polls at POLL_MIN in a row before backing off anyway: the step we wait for may belong to a
# stalled peer, which only the host's claim timeout ends.
SOON_POLLS = 40


class Ring(RingCore):
    """One peer's handle on a ring. Not thread-safe: one Ring per thread/process, and one
    Ring at a time per connection (a second Ring on the same verbs resumes the tickets the
    first one left outstanding, through the seat words)."""

    def __init__(self, verbs: Verbs) -> None:
        super().__init__(verbs)
        self._soon_polls = 0

    def push(self, item: Mapping[str, Any], timeout: float | None = None) -> None:
        """Push with backoff; raise RingFull if still full after ``timeout`` seconds."""
        body = self.encode(item)
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = POLL_MIN
        self._soon_polls = 0
        while not self.try_push_body(body):
            if deadline is not None and time.monotonic() >= deadline:
                raise RingFull(f"ring {self.name!r} stayed full for {timeout} s", ring=self.name)
            delay = self._backoff(delay)

    def pop(self, timeout: float | None = None) -> dict[str, Any]:
        """Pop with backoff; raise RingEmpty if nothing arrives within ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = POLL_MIN
        self._soon_polls = 0
        while True:
            item = self.try_pop()
            if item is not None:
                return item
            if deadline is not None and time.monotonic() >= deadline:
                raise RingEmpty(f"ring {self.name!r} stayed empty for {timeout} s", ring=self.name)
            delay = self._backoff(delay)

    def _backoff(self, delay: float) -> float:
        """Sleep before the next try; the next delay. A ticket's slot is reached by one
        particular peer's step, so a waiter whose slot is one step away polls at once
        (otherwise each hand-off on a small ring would wait out a sleeper's backoff)."""
        if self._soon and self._soon_polls < SOON_POLLS:
            self._soon_polls += 1
            time.sleep(POLL_MIN)
            return POLL_MIN
        time.sleep(delay)
        return min(delay * 2, POLL_MAX)
