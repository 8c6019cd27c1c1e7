"""Whether results can be written now: the condition the front door refuses new tasks on.

A result write that fails for the storage's reasons (:func:`contracts.errors.storage_fault`:
a full disk, a read-only, missing or forbidden output folder) is the system's fault: the
decoder holds the result and retries (``workers/held.py``), uncharged. Two places see it:
a decoder's own write (each of its heartbeats carries ``storage``: None, or what it holds
and why) and the controller's write of the copy it serves (:meth:`ResultWrites.failed`,
cleared by its next successful write). While either reports a fault, new tasks are refused
with 503 (:meth:`ResultWrites.refusal`): the accepted ones are not joined by more that could
not be delivered either. The condition shows in ``/v1/service/status`` (``result_writes``),
in the metric ``diffring_result_writes_blocked`` and in a log line when it starts and ends.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("diffring.controller")

CONTROLLER = "controller"


@dataclass
class Blocked:
    """One place whose result writes fail."""

    where: str
    """``controller``, or the decoder's name."""
    error: str
    held: int
    """Results held there (the controller holds none: its decoders do)."""
    since: float
    """Wall-clock time of the first failure."""

    def public(self) -> dict[str, Any]:
        return {"where": self.where, "error": self.error, "held": self.held,
                "since": self.since}


class ResultWrites:
    """The storage condition, by place (the controller and each decoder)."""

    def __init__(self) -> None:
        self._blocked: dict[str, Blocked] = {}

    def report(self, worker: str, storage: Any) -> None:
        """A decoder's heartbeat field: None (writing fine) or {error, held, since}."""
        if not isinstance(storage, dict):
            self._clear(worker)
            return
        try:
            held = int(storage.get("held", 0))
            since = float(storage.get("since", time.time()))
        except (TypeError, ValueError):
            held, since = 0, time.time()
        self._set(Blocked(worker, str(storage.get("error", "?"))[:500], held, since))

    def forget(self, worker: str) -> None:
        """The decoder is gone: what it held is back in play at the controller."""
        self._clear(worker)

    def failed(self, error: str) -> None:
        """The controller's own result write failed for the storage's reasons."""
        known = self._blocked.get(CONTROLLER)
        self._set(Blocked(CONTROLLER, error, 0, known.since if known else time.time()))

    def written(self) -> None:
        """The controller wrote a result: its own storage works (again)."""
        if CONTROLLER in self._blocked:
            self._clear(CONTROLLER)

    def _set(self, blocked: Blocked) -> None:
        if blocked.where not in self._blocked:
            log.error("result writes blocked at %s: %s; new tasks are refused until it is "
                      "fixed (held results are retried, not charged)", blocked.where,
                      blocked.error)
        self._blocked[blocked.where] = blocked

    def _clear(self, where: str) -> None:
        if self._blocked.pop(where, None) is not None:
            log.warning("result writes at %s work again", where)

    @property
    def blocked(self) -> list[Blocked]:
        return list(self._blocked.values())

    def refusal(self) -> str | None:
        """The 503 detail while result writes are blocked (None: accept new tasks)."""
        if not self._blocked:
            return None
        first = min(self._blocked.values(), key=lambda b: b.since)
        held = sum(b.held for b in self._blocked.values())
        return (
            f"results cannot be written ({first.where}: {first.error}); {held} finished "
            "result(s) are held until the output folder is writable again, and new tasks "
            "are refused meanwhile: free space (or fix the folder), then retry"
        )

    def public(self) -> dict[str, Any]:
        """The ``result_writes`` field of the service status."""
        return {
            "status": "blocked" if self._blocked else "ok",
            "held": sum(b.held for b in self._blocked.values()),
            "blocked": [b.public() for b in self._blocked.values()],
        }
