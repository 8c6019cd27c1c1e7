"""Claim leases: how long a worker may hold a task without being heard from (window 4 of the
ownership argument in :mod:`controller.ownership.coordinator`).

A claim grants a lease until ``now + lease_s``; every heartbeat of the holder renews all of
its leases; the sweep puts back in play every task whose lease ran out. Time is always the
caller's ``now`` (the controller's monotonic clock; a test drives its own), never read here.
The deadline lives on the task (``Task.lease_expires``); the table clears it at a handoff,
a retry and every terminal stage.
"""

from __future__ import annotations

from collections.abc import Mapping

from controller.tasks.tasks import Task


class Leases:
    """The lease deadlines of the live tasks of one table (``tasks``: unfinished only)."""

    def __init__(self, tasks: Mapping[str, Task], lease_s: float) -> None:
        self.tasks = tasks
        self.lease_s = lease_s

    def until(self, now: float) -> float:
        """The deadline of a lease granted or renewed at ``now``."""
        return now + self.lease_s

    def held_by(self, worker_id: int) -> list[Task]:
        return [t for t in self.tasks.values() if t.worker_id == worker_id]

    def renew(self, worker_id: int, now: float) -> None:
        deadline = self.until(now)
        for t in self.held_by(worker_id):
            t.lease_expires = deadline

    def expired(self, now: float) -> list[Task]:
        return [
            t for t in self.tasks.values() if t.lease_expires is not None and t.lease_expires < now
        ]
