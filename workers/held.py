"""Results the decoder could not write yet: held and retried, within a bound.

A result write that fails for the storage's reasons (:class:`~contracts.errors.
ResultWriteBlocked`: a full disk, a read-only, missing or forbidden folder, on this host or
at the controller) is the system's fault, not the task's. The decoder keeps the encoded
result here instead of failing the attempt; a thread retries each write with back-off
(:data:`RETRY_FIRST_S` doubling up to :data:`RETRY_MAX_S`) until it succeeds. The task's
lease stays with the decoder meanwhile (its heartbeats renew every lease it holds), and
each heartbeat reports :meth:`HeldResults.report`, on which the controller refuses new tasks.

The bound (``max_held_results``, ``result_write_retry_s`` in :mod:`contracts.config`): at
most ``capacity`` results are held — while full, the decoder claims nothing, and a write
that fails beyond the bound gives its task up at once; a result held for ``retry_s`` is
given up. Giving up is handing the task back, uncharged (``give_up``, the decoder's choice).

The retry pass (:meth:`HeldResults.retry_due`) takes the time it runs at, so tests drive the
clock instead of sleeping; :meth:`start` runs it on a thread against the real one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contracts.errors import ConnectionLost, ResultWriteBlocked
from contracts.messages import StorageReport

log = logging.getLogger("diffring.worker.held")

RETRY_FIRST_S = 0.5
"""Pause before the first retry of a held write."""
RETRY_MAX_S = 10.0
"""Longest pause between two retries: a fixed disk is noticed within this."""


@dataclass
class Held:
    """One result waiting for its write."""

    job: Any
    """The decoder's job (its task id and attempt)."""
    result: Any
    """What the write needs again (the encoded artifact)."""
    error: str
    since: float
    """Clock time of the first failed write."""
    since_wall: float = field(default_factory=time.time)
    local: Path | None = None
    """This decoder's own copy, once written (only the controller's write is left)."""
    tries: int = 1
    due: float = 0.0


class HeldResults:
    """At most ``capacity`` held results, each retried by ``deliver(held)`` (raises
    ResultWriteBlocked while the storage still fails) and given up to ``give_up(held, why)``
    after ``retry_s``."""

    def __init__(
        self,
        capacity: int,
        retry_s: float,
        deliver: Callable[[Held], None],
        give_up: Callable[[Held, str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.capacity = capacity
        self.retry_s = retry_s
        self._deliver = deliver
        self._give_up = give_up
        self._clock = clock
        self._held: dict[tuple[str, int], Held] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    # -- the decoder's side --------------------------------------------------------------------
    def hold(self, job: Any, result: Any, error: str, local: Path | None = None) -> bool:
        """Keep ``result`` for a retry; False (nothing kept) when ``capacity`` are held."""
        now = self._clock()
        with self._cond:
            if len(self._held) >= self.capacity or self._closed:
                return False
            self._held[(job.task_id, job.attempt)] = Held(
                job, result, error, now, local=local, due=now + RETRY_FIRST_S
            )
            self._cond.notify_all()
        log.warning("task %s: result held, its write failed for the storage's reasons (%s); "
                    "retrying for up to %g s (result_write_retry_s)", job.task_id, error,
                    self.retry_s)
        return True

    @property
    def count(self) -> int:
        with self._cond:
            return len(self._held)

    def wait_for_room(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until fewer than ``capacity`` are held."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self._held) < self.capacity, timeout)

    def report(self) -> StorageReport | None:
        """What the heartbeat tells the controller: None while nothing is held."""
        with self._cond:
            if not self._held:
                return None
            oldest = min(self._held.values(), key=lambda h: h.since)
            latest = max(self._held.values(), key=lambda h: h.since)
            return StorageReport(error=latest.error, held=len(self._held),
                                 since=oldest.since_wall)

    # -- retrying --------------------------------------------------------------------------------
    def retry_due(self, now: float) -> float | None:
        """Retry every write due at ``now``; give up those held ``retry_s``. Returns when the
        next is due (None: nothing held)."""
        with self._cond:
            due = [h for h in self._held.values() if h.due <= now]
        for held in due:
            key = (held.job.task_id, held.job.attempt)
            try:
                self._deliver(held)
            except ResultWriteBlocked as exc:
                held.error, held.tries = str(exc), held.tries + 1
                if now - held.since >= self.retry_s:
                    self._drop(key)
                    self._give_up(held, f"result not written in {self.retry_s:g} s "
                                        f"(result_write_retry_s, {held.tries} tries): {exc}")
                else:
                    held.due = now + min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** (held.tries - 1))
                continue
            except ConnectionLost as exc:
                # The controller put the task back in play when the connection went: nothing
                # of it is ours to keep.
                log.warning("task %s: held result dropped, control channel lost: %s",
                            held.job.task_id, exc)
            except Exception as exc:  # anything else: hand it back rather than sit on it
                log.exception("task %s: retry of a held result failed", held.job.task_id)
                self._drop(key)
                self._give_up(held, f"its held result could not be retried: {exc}")
                continue
            else:
                log.info("task %s: held result written after %d tries", held.job.task_id,
                         held.tries)
            self._drop(key)
        with self._cond:
            return min((h.due for h in self._held.values()), default=None)

    def _drop(self, key: tuple[str, int]) -> None:
        with self._cond:
            self._held.pop(key, None)
            self._cond.notify_all()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="held-results", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                nxt = min((h.due for h in self._held.values()), default=None)
                wait = None if nxt is None else nxt - self._clock()
                if wait is None or wait > 0:
                    self._cond.wait(wait)  # hold() and close() wake it
                    continue
                self._cond.release()
                try:
                    self.retry_due(self._clock())
                finally:
                    self._cond.acquire()

    def close(self, why: str) -> None:
        """Stop retrying; give every held result up (``why``)."""
        with self._cond:
            self._closed = True
            held = list(self._held.values())
            self._held.clear()
            self._cond.notify_all()
        for h in held:
            self._give_up(h, f"{why} while its result could not be written ({h.error})")
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
