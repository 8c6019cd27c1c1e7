"""What the coordinator's parts tell the rest of the controller: one narrow interface,
:class:`Outbox`, which the coordinator implements and hands to each part, instead of a
callback per thing to say.

A part reports two things and nothing else: a task's event (``queued``, ``claimed``,
``progress``, ``completed``, ...: the event hub, the metrics and the status page listen, and
at a terminal event the coordinator frees what it kept for the task), and work pushed to a
ring (whose doorbell wakes the idle workers of the next stage). Everything else a part
needs, it is given as a part (the table, the requeue, the leases), never as a way back up.
"""

from __future__ import annotations

from typing import Protocol

from controller.tasks.tasks import Task


class Outbox(Protocol):
    def emit(self, event: str, task: Task) -> None:
        """``task`` had ``event`` (its stage already changed)."""

    def announce(self, ring: str | None) -> None:
        """An item was pushed to ``ring`` (None: to no ring)."""
