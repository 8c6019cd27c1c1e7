"""Wake-ups for idle workers: a long-poll on the control port, rung when a ring gets work.

An idle worker, instead of polling its input ring every few milliseconds (each poll a tcp
round trip served by this event loop), opens a second connection to the control port and
sends ``wait {ring, timeout_s}``; the reply comes when

1. the ring already holds a published item when the wait arrives (checked here against the
   ring memory this controller hosts, so a push that raced ahead of the wait is not missed),
2. the ring is *rung*: the controller pushed to it (a new task, a retry), a producer
   reported the handoff of an item it published there, or the sweep found work waiting, or
3. ``timeout_s`` passes (the worker then polls its ring once and waits again).

A wake-up is only a hint: the woken worker claims through the ring like any other, and may
find the item taken. One ring wakes at most as many waiters as items it announces, so a push
does not stampede every idle worker. *Which* waiters matters: an idle consumer that polled
an empty ring keeps the pop ticket it took (``rings.ring``), so the next item pushed lands at
the position some idle worker already holds, and only that worker can claim it until the
host gives the ticket up. A wait therefore names the ticket its worker holds, and a published
item wakes the waiter holding its position first; items no waiter holds a ticket for (the
head has not reached them, or they are ORPHANED: re-offered to anyone) wake ticketless
waiters, oldest first, then any. A lost wake-up (a producer that
dies between its publish and its handoff, a peer on rdma) costs at most the sweep interval
for waiters, and the wait timeout at worst.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from rings.layout import POS_SHIFT, STAMPS_OFFSET, STATE_BITS, SlotState
from rings.verbs import Verbs

MAX_WAIT_S = 60.0
"""Longest wait a worker may ask for (it asks for less: see the worker's idle loop)."""


_STATE_MASK = (1 << STATE_BITS) - 1
_PUBLISHED = int(SlotState.PUBLISHED)
_ORPHANED = int(SlotState.ORPHANED)


def ring_work(verbs: Verbs) -> tuple[set[int], int]:
    """(positions of the PUBLISHED slots, number of ORPHANED slots) of a ring: one read of
    the stamp array. Masks the state bits (the layout's ``STATE_BITS``) rather than
    unpacking each stamp (called for every wait and every ring)."""
    raw = verbs.read(STAMPS_OFFSET, 8 * verbs.layout.slot_count)
    stamps = memoryview(raw).cast("Q")  # little-endian hosts only, like the verbs themselves
    positions: set[int] = set()
    orphaned = 0
    for word in stamps:
        state = word & _STATE_MASK
        if state == _PUBLISHED:
            positions.add(word >> POS_SHIFT)
        elif state == _ORPHANED:
            orphaned += 1
    return positions, orphaned


def published(verbs: Verbs) -> int:
    """How many slots of a ring hold an item a consumer can take (PUBLISHED or ORPHANED)."""
    positions, orphaned = ring_work(verbs)
    return len(positions) + orphaned


@dataclass(eq=False)
class _Waiter:
    future: asyncio.Future[bool]
    ticket: int | None
    """The pop ticket (ring position) its worker holds, None when it holds none."""
    on_ring: Callable[[], object] | None


class Doorbell:
    """Waiting workers per ring, and the ringing of them. Runs on the event-loop thread."""

    def __init__(self, rings: Mapping[str, Verbs]) -> None:
        self._rings = dict(rings)
        self._waiters: dict[str, list[_Waiter]] = {name: [] for name in self._rings}
        self.rung = 0
        """Waiters woken by a ring (for tests and metrics)."""

    def waiting(self, ring: str) -> int:
        return len(self._waiters[ring])

    def has_work(self, ring: str, ticket: int | None = None) -> bool:
        """Whether ``ring`` holds an item a worker holding ``ticket`` could claim now."""
        positions, orphaned = ring_work(self._rings[ring])
        if orphaned or (ticket is not None and ticket in positions):
            return True
        # A ticketless worker takes the next position: useful for items nobody holds yet.
        return ticket is None and bool(positions)

    async def wait(
        self, ring: str, timeout_s: float, on_ring: Callable[[], object] | None = None,
        ticket: int | None = None,
    ) -> bool:
        """Until ``ring`` has work for this waiter (True) or ``timeout_s`` passes (False).

        ``ticket``: the pop ticket the waiting worker holds (see the module docstring).
        ``on_ring`` is called inside :meth:`ring` itself, so the control server can send the
        wake-up before the ringing code path (an HTTP response, a handoff reply) finishes,
        rather than one event-loop turn later."""
        if ring not in self._waiters:
            raise ValueError(f"no ring {ring!r} to wait on (rings: {', '.join(self._waiters)})")
        if self.has_work(ring, ticket):
            return True
        waiter = _Waiter(asyncio.get_running_loop().create_future(), ticket, on_ring)
        queue = self._waiters[ring]
        queue.append(waiter)
        try:
            return await asyncio.wait_for(waiter.future, min(max(timeout_s, 0.0), MAX_WAIT_S))
        except TimeoutError:
            return False
        finally:
            if waiter in queue:  # timed out, or the connection went away while waiting
                queue.remove(waiter)

    def ring(self, ring: str, items: int = 1) -> int:
        """Wake up to ``items`` waiters of ``ring``, no more than the ring holds claimable
        items: the holders of published positions first, then (for items no waiter holds)
        ticketless waiters, oldest first, then any; returns how many.

        A producer reports its handoff after its push, and a busy consumer often took the
        item in between: counting what is still published keeps that late ring from
        waking a worker for nothing."""
        queue = self._waiters.get(ring)
        if not queue:
            return 0
        positions, orphaned = ring_work(self._rings[ring])
        budget = min(items, len(positions) + orphaned)
        chosen: list[_Waiter] = []
        held = {w.ticket for w in queue}
        for w in queue:
            if len(chosen) < budget and w.ticket is not None and w.ticket in positions:
                chosen.append(w)
        unheld = len(positions - held) + orphaned
        for pick_ticketless in (True, False):
            for w in queue:
                if len(chosen) >= budget or len(chosen) >= len(positions & held) + unheld:
                    break
                if w not in chosen and (w.ticket is None) == pick_ticketless:
                    chosen.append(w)
        for w in chosen:
            queue.remove(w)
            if not w.future.done():
                w.future.set_result(True)
                if w.on_ring is not None:
                    w.on_ring()
        self.rung += len(chosen)
        return len(chosen)

    def sweep(self) -> None:
        """Ring every ring that holds claimable items while workers wait on it: covers
        wake-ups that were never sent (a producer that died before its handoff)."""
        for name, queue in self._waiters.items():
            if queue:
                self.ring(name, len(queue))
