"""Reconciling the task table against the rings the controller hosts (window 2 of the
ownership argument in :mod:`controller.ownership.coordinator`).

A consumer's pop frees its slot before the consumer's claim reaches the controller, so a
consumer that dies in between leaves a task that no slot and no lease names. The controller
hosts the ring memory, so it can look: :func:`census` reads every slot that still holds an
item a consumer can get (published, or claimed and being read -- any state but free,
claimed-for-push and tombstone) and returns the (task, attempt) each names;
:class:`MissingTracker` times how long each waiting task has been absent from its ring, and
hands back those absent for longer than the grace (``lease_timeout_s``: the popper's
implicit lease). Only reads: the census never claims, frees or repairs a slot.

Over tcp every peer's verbs run on the controller's event loop, as does this, so a census
is one instant of the ring; over rdma NICs may change slots while it reads, so a task can be
missed for one census but not for a whole grace period of them.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping

from controller.tasks.tasks import WAITING_RING, Stage, Task
from rings.errors import PayloadCorrupt
from rings.layout import STAMPS_OFFSET, SlotState, unpack_stamp
from rings.payload import unframe
from rings.ring import Ring
from rings.verbs import READ

Census = Mapping[str, set[tuple[str, int]]]
"""Per ring name, the (task_id, attempt) of every item a consumer can still get from it."""

_EMPTY = (SlotState.FREE, SlotState.CLAIMED_PUSH, SlotState.TOMBSTONE)


def ring_items(ring: Ring) -> tuple[set[tuple[str, int]], int]:
    """(task_id, attempt) of every item in ``ring``, and how many items name no task."""
    lay = ring.layout
    raw = ring.verbs.read(STAMPS_OFFSET, 8 * lay.slot_count)
    positions = []
    for (word,) in struct.iter_unpack("<Q", raw):
        pos, state, _holder = unpack_stamp(word)
        if state not in _EMPTY:
            positions.append(pos)
    if not positions:
        return set(), 0
    slots = ring.verbs.batch([(READ, lay.payload_offset(p), lay.slot_size) for p in positions])
    found: set[tuple[str, int]] = set()
    unnamed = 0
    for pos, data in zip(positions, slots, strict=True):
        try:
            item = unframe(bytes(data), pos, ring=lay.name)
        except PayloadCorrupt:
            unnamed += 1  # a consumer will drop it; its task shows up as missing
            continue
        tid, attempt = item.get("task_id"), item.get("attempt")
        if isinstance(tid, str) and isinstance(attempt, int):
            found.add((tid, attempt))
        else:
            unnamed += 1
    return found, unnamed


def census(rings: Mapping[str, Ring]) -> Census:
    """What each of the controller's rings holds right now."""
    return {name: ring_items(ring)[0] for name, ring in rings.items()}


class MissingTracker:
    """Times how long each waiting task has been missing from its ring."""

    def __init__(self) -> None:
        # (task_id, attempt, stage) -> when it was first seen missing (monotonic).
        self._since: dict[tuple[str, int, Stage], float] = {}

    def lost(self, tasks: Iterable[Task], present: Census, now: float, grace: float
             ) -> list[tuple[Task, str, float]]:
        """(task, ring, seconds missing) of each task in a waiting stage, with no lease,
        whose current attempt has been in no item of its ring for ``grace`` seconds.

        Keyed by (task, attempt, stage), so a task that moved on and came back starts
        afresh; a task seen in its ring, or no longer waiting, is forgotten."""
        since: dict[tuple[str, int, Stage], float] = {}
        lost = []
        for task in tasks:
            ring = WAITING_RING.get(task.stage)
            if ring is None or task.worker_id is not None or ring not in present:
                continue
            if (task.task_id, task.attempt) in present[ring]:
                continue
            key = (task.task_id, task.attempt, task.stage)
            first = since[key] = self._since.get(key, now)
            if now - first >= grace:
                lost.append((task, ring, now - first))
                del since[key]
        self._since = since
        return lost
