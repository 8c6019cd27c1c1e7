"""The host's side of tickets: which positions are handed out but not claimed, who may hold
them, and when one may be given up (see the seats in :mod:`rings.layout`).

A *ticket* is a position a peer got from ``fetch_and_add`` on ``tail`` (producer) or ``head``
(consumer) and has not claimed yet. The host never sees the FAA (an rdma NIC executes it),
so it works from the region alone, in :meth:`TicketWatch.step`, once per scan and right after
each revoke:

1. *Outstanding* positions per side, from the stamps and the counters: a producer position p
   below ``tail`` whose slot has not passed FREE(p) yet, a consumer position q below ``head``
   whose slot has not been claimed (or given up) at q yet.
2. *Declared* ones: a live peer's seat says HOLDS(p). Such a ticket is claimed by CAS before
   its holder touches the slot, so giving it up is safe while the holder lives; the host does
   so once it has been *ready* (FREE(p) / PUBLISHED(q) / TOMBSTONE(q)) and unused for longer
   than the claim timeout, so an idle peer (one that gave up pushing, or stopped popping)
   never stalls the ring.
3. *Undeclared* ones belong to a dead peer or to a live peer between its ticket FAA and the
   batch that declares it, whose seat then says TAKING(seq). A live TAKING ticket must never
   be given up (its holder may write the slot right after seeing it FREE). So an undeclared
   position is given up only if it was undeclared at the previous scan too and every live
   peer that was TAKING at that scan has moved on since (its seat is no longer that
   TAKING(seq)); it is then a dead peer's. Two scans apart, unless a peer sits in one ticket
   window for a whole scan interval; a live peer that stays TAKING with the same ``seq`` past
   the claim timeout is revoked first, like a peer holding a claim too long.
4. Given up: producer FREE(p) -> TOMBSTONE(p) (consumers skip it); consumer PUBLISHED(q) ->
   ORPHANED(q) (any consumer may claim it; the host points the header's orphan hint at it)
   and TOMBSTONE(q) -> FREE(q + cap). A position that is not ready yet (the slot is a lap
   behind, or the item not published yet) stays given up until it is.

Why step 3 is sound, for a live holder H of an undeclared producer ticket p: the host reads
the counters, then the stamps, then the seats. At the previous scan, p below ``tail`` means H
had its ticket when the counters were read, p unclaimed in the stamps that H had not claimed
it, and p undeclared in the seats that H's seat still said TAKING(seq of p): H is among the
peers TAKING at that scan. At this scan H has moved on from that TAKING(seq): it declared
HOLDS(p), so p is declared now (and kept), or it is past p, which it only gets after p was
claimed or void; then the give-up CAS, which expects FREE(p) exactly, fails harmlessly.
(The reasoning is the same for a consumer ticket; there a give-up could anyway only make a
live holder's claim fail and retry on ORPHANED.) tests/integration/test_ring_model.py checks
this with spin (rings/ring.pml).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rings.layout import (
    POP,
    POS_SHIFT,
    PUSH,
    STATE_BITS,
    RingLayout,
    SeatKind,
    SlotState,
    stamp,
    unpack_seat,
)

_STATE_MASK = (1 << STATE_BITS) - 1
SIDES = (PUSH, POP)
SIDE_NAMES = ("producer", "consumer")


@dataclass(frozen=True)
class RegionView:
    """What the host read, in this order: counters, stamps, seats."""

    head: int
    tail: int
    orphan_hint: int
    stamps: tuple[int, ...]
    seats: dict[int, tuple[int, int]]
    """peer id -> (push seat word, pop seat word), for the peers the host asked about."""


@dataclass(frozen=True)
class GiveUp:
    """Replace ``old`` by ``new`` on position ``position``'s stamp (a CAS)."""

    side: int
    position: int
    old: int
    new: int


@dataclass
class Actions:
    give_up: list[GiveUp] = field(default_factory=list)
    revoke: list[int] = field(default_factory=list)
    """Live peers stuck between a ticket and its claim past the claim timeout."""


def outstanding(view: RegionView, side: int, cap: int) -> dict[int, int]:
    """Outstanding tickets of ``side``: position -> current stamp word of its slot."""
    counter = view.tail if side == PUSH else view.head
    out: dict[int, int] = {}
    for word in view.stamps:
        pos = word >> POS_SHIFT
        state = word & _STATE_MASK
        if side == PUSH:
            start = pos if state == SlotState.FREE else pos + cap
        else:
            done = state == SlotState.CLAIMED_POP or state == SlotState.ORPHANED
            start = pos + cap if done else pos
        for p in range(start, counter, cap):
            out[p] = word
    return out


def give_up_move(side: int, position: int, word: int, cap: int) -> GiveUp | None:
    """The CAS that gives ``position`` up, if its slot is ready for it; else None."""
    if word >> POS_SHIFT != position:
        return None
    state = word & _STATE_MASK
    if side == PUSH and state == SlotState.FREE:
        return GiveUp(side, position, word, stamp(position, SlotState.TOMBSTONE))
    if side == POP and state == SlotState.PUBLISHED:
        return GiveUp(side, position, word, stamp(position, SlotState.ORPHANED))
    if side == POP and state == SlotState.TOMBSTONE:
        return GiveUp(side, position, word, stamp(position + cap, SlotState.FREE))
    return None


def held_by(seats: tuple[int, int], view: RegionView, cap: int) -> list[tuple[int, int]]:
    """The (side, position) tickets a peer's seats declare that are still outstanding."""
    held = []
    for side in SIDES:
        kind, value = unpack_seat(seats[side])
        if kind == SeatKind.HOLDS and value in outstanding(view, side, cap):
            held.append((side, value))
    return held


def seat_holds(view: RegionView, seats: tuple[int, int], cap: int) -> bool:
    """Whether a peer holds a ticket: declared and outstanding, or maybe one not declared
    yet (a seat that says TAKING)."""
    taking = any(unpack_seat(w)[0] == SeatKind.TAKING for w in seats)
    return taking or bool(held_by(seats, view, cap))


class TicketWatch:
    """Host state about tickets across scans; :meth:`step` says what to give up or revoke."""

    def __init__(self, layout: RingLayout) -> None:
        self.cap = layout.slot_count
        self.given_up: set[tuple[int, int]] = set()
        """(side, position) of tickets whose holder is gone: given up as soon as ready."""
        # Undeclared positions at the previous scan, and who was TAKING then (peer, seq).
        self._undeclared: set[tuple[int, int]] = set()
        self._was_taking: list[set[tuple[int, int]]] = [set(), set()]
        self._ready_since: dict[tuple[int, int, int], float] = {}
        self._taking_since: dict[tuple[int, int], tuple[int, float]] = {}

    def forget_peer(self, view: RegionView, seats: tuple[int, int]) -> None:
        """A peer is cut off: the tickets its seats declare are given up (an undeclared one
        is found by :meth:`step`, as a position no live peer declares)."""
        self.given_up.update(held_by(seats, view, self.cap))

    def step(self, view: RegionView, live: set[int], now: float, timeout: float) -> Actions:
        """``live``: peers that can still act (connected, or not yet cut off); ``view.seats``
        must cover all of them."""
        acts = Actions()
        cap = self.cap
        taking: list[set[tuple[int, int]]] = [set(), set()]
        declared: list[dict[int, int]] = [{}, {}]
        taking_since: dict[tuple[int, int], tuple[int, float]] = {}
        for pid in live:
            for side in SIDES:
                kind, value = unpack_seat(view.seats[pid][side])
                if kind == SeatKind.TAKING:
                    taking[side].add((pid, value))
                    seq, since = self._taking_since.get((pid, side), (value, now))
                    if seq != value:
                        since = now
                    taking_since[(pid, side)] = (value, since)
                    if now - since > timeout and pid not in acts.revoke:
                        acts.revoke.append(pid)
                elif kind == SeatKind.HOLDS:
                    declared[side][value] = pid
        self._taking_since = taking_since
        undeclared: set[tuple[int, int]] = set()
        ready_since: dict[tuple[int, int, int], float] = {}
        for side in SIDES:
            out = outstanding(view, side, cap)
            self.given_up = {g for g in self.given_up if g[0] != side or g[1] in out}
            for pos, word in out.items():
                key = (side, pos)
                move = give_up_move(side, pos, word, cap)
                if key in self.given_up:
                    if move is not None:
                        acts.give_up.append(move)
                    continue
                holder = declared[side].get(pos)
                if holder is not None:
                    if move is not None:  # ready: time how long its live holder leaves it
                        rkey = (side, pos, holder)
                        since = self._ready_since.get(rkey, now)
                        ready_since[rkey] = since
                        if now - since > timeout:
                            self.given_up.add(key)
                            acts.give_up.append(move)
                    continue
                # Undeclared: a dead peer's once it was undeclared at the previous scan and
                # all who were TAKING then have moved on (those still TAKING(seq) have not).
                if key not in self._undeclared or self._was_taking[side] & taking[side]:
                    undeclared.add(key)
                    continue
                self.given_up.add(key)
                if move is not None:
                    acts.give_up.append(move)
        self._undeclared = undeclared
        self._was_taking = taking
        self._ready_since = ready_since
        return acts
