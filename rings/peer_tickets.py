"""A peer's side of tickets on one ring (the host's side is :mod:`rings.tickets`).

:class:`PeerTickets` is what one peer's :class:`~rings.ring.Ring` keeps between operations
and the first round trip of each of them (the protocol is :mod:`rings.core`): the peer's two
seat words, the outstanding ticket of each side and whether the seat declares it, the ticket
batch (WRITE seat TAKING(seq); FAA; READ header + stamps), and picking up the tickets an
earlier Ring on the same connection left. :func:`_push_view` / :func:`_pop_view` say what
the stamp of a ticket's slot means to the ticket's holder.

The underscored names here are the ring's hot-path vocabulary, shared with :mod:`rings.core`
(the other half of the same algorithm) and nobody else.
"""

from __future__ import annotations

import struct
from typing import Any

from rings.layout import (
    MAX_HOLDER,
    OFF_HEAD,
    OFF_ORPHAN_HINT,
    OFF_TAIL,
    POP,
    POS_SHIFT,
    PUSH,
    STAMPS_OFFSET,
    STATE_BITS,
    RingLayout,
    SeatKind,
    SlotState,
    unpack_seat,
)
from rings.verbs import FAA, READ, WRITE, Op, Verbs

_STATE_MASK = (1 << STATE_BITS) - 1
_Q = struct.Struct("<Q")
# The ticket batch reads the header and every stamp of rings up to this many slots (4 KiB);
# larger rings get a window of this many stamps from the last counter value seen.
WINDOW_SLOTS = 512
# Offsets inside the ticket batch's READ, which starts at OFF_HEAD.
_V_HEAD = 0
_V_TAIL = OFF_TAIL - OFF_HEAD
_V_ORPHAN = OFF_ORPHAN_HINT - OFF_HEAD
_V_STAMPS = STAMPS_OFFSET - OFF_HEAD

# What the stamp of a ticket's slot means to the ticket's holder.
_READY = 0  # claim it now
_WAIT = 1  # the slot has not reached the position yet (ring full / empty there)
_VOID = 2  # the position is gone (given up by the host, or past): take a new ticket
_SKIP = 3  # consumer: a tombstone at our position; free it and take a new ticket
_MINE = 4  # already claimed by this peer


# Stamp and seat words are built inline on the hot path (rings.layout.stamp() / seat() spell
# the same arithmetic): a push and a pop build about ten of them.
_FREE = int(SlotState.FREE)
_CLAIMED_PUSH = int(SlotState.CLAIMED_PUSH)
_PUBLISHED = int(SlotState.PUBLISHED)
_CLAIMED_POP = int(SlotState.CLAIMED_POP)
_TOMBSTONE = int(SlotState.TOMBSTONE)
_ORPHANED = int(SlotState.ORPHANED)
_TAKING = int(SeatKind.TAKING)
_HOLDS = int(SeatKind.HOLDS)


def _push_view(word: int, p: int, me: int) -> int:
    pos = word >> POS_SHIFT
    if pos < p:
        return _WAIT
    if pos > p:
        return _VOID
    state = word & _STATE_MASK
    if state == _FREE:
        return _READY
    if state == _CLAIMED_PUSH and (word >> STATE_BITS) & MAX_HOLDER == me:
        return _MINE
    return _VOID


def _pop_view(word: int, q: int, me: int) -> int:
    pos = word >> POS_SHIFT
    if pos < q:
        return _WAIT
    if pos > q:
        return _VOID
    state = word & _STATE_MASK
    if state == _PUBLISHED or state == _ORPHANED:
        return _READY
    if state == _FREE or state == _CLAIMED_PUSH:
        return _WAIT
    if state == _TOMBSTONE:
        return _SKIP
    if (word >> STATE_BITS) & MAX_HOLDER == me:
        return _MINE
    return _VOID


class RingStats:
    """Counters of one Ring object (this peer's view), for benchmarks and metrics."""

    __slots__ = (
        "claim_retries",
        "last_claim_s",
        "last_ticket_s",
        "orphans_taken",
        "pops",
        "pushes",
        "round_trips",
        "tombstones_skipped",
    )

    def __init__(self) -> None:
        self.last_claim_s = 0.0
        """Seconds the last successful claim took (from the first verb to the answer of the
        round trip whose stamp CAS won)."""
        self.last_ticket_s = 0.0
        """Seconds from the last successful operation's first verb to its ticket."""
        self.pushes = 0
        self.pops = 0
        self.round_trips = 0
        self.claim_retries = 0
        """Tickets this peer had to give up (given up by the host, or past) and replace."""
        self.tombstones_skipped = 0
        self.orphans_taken = 0
        """ORPHANED items (a dead or idle consumer's ticket) this peer delivered."""


class PeerTickets:
    """A peer's tickets on one ring and the ticket round trip; :class:`~rings.core.RingCore`
    claims, publishes and frees the positions they give."""

    def __init__(self, verbs: Verbs) -> None:
        self.verbs = verbs
        self.layout: RingLayout = verbs.layout
        self.name = self.layout.name
        self.cap = self.layout.slot_count
        self.me = verbs.peer_id
        self.stats = RingStats()
        lay = self.layout
        self._seat_off = (lay.seat_offset(self.me, PUSH), lay.seat_offset(self.me, POP))
        # Outstanding ticket per side (-1: none) and whether our seat says HOLDS(ticket).
        self._ticket = [-1, -1]
        self._declared = [False, False]
        self._seq = -1  # -1: seats not read yet; the first operation resumes from them
        self._seen = [0, 0]  # last tail / head read: where a big ring's stamp window starts
        self._skip: list[Op] = []  # a tombstone skip, posted with the next ticket batch
        self._whole = self.cap <= WINDOW_SLOTS

    def _batch(self, ops: list[Op]) -> list[Any]:
        self.stats.round_trips += 1
        return self.verbs.batch(ops)

    def _resume(self) -> None:
        """Pick up the tickets a previous Ring on this connection left outstanding."""
        raw = self._batch([(READ, self._seat_off[PUSH], 16)])[0]
        seq = 0
        held: list[tuple[int, int]] = []
        for side in (PUSH, POP):
            kind, value = unpack_seat(_Q.unpack_from(raw, 8 * side)[0])
            if kind == SeatKind.TAKING:
                seq = max(seq, value + 1)
            elif kind == SeatKind.HOLDS:
                held.append((side, value))
        self._seq = seq
        if not held:
            return
        res = self._batch([(READ, self.layout.stamp_offset(pos), 8) for _side, pos in held])
        for (side, pos), raw_word in zip(held, res, strict=True):
            word = _Q.unpack(raw_word)[0]
            view = (_push_view if side == PUSH else _pop_view)(word, pos, self.me)
            if view in (_READY, _WAIT, _SKIP):
                self._ticket[side] = pos
                self._declared[side] = True

    def _take(self, side: int) -> tuple[int, int, bytes]:
        """The ticket round trip: (position, its slot's stamp or -1 if the window missed it,
        the header bytes from OFF_HEAD)."""
        self._seq += 1
        self._declared[side] = False  # the seat says TAKING from this batch on
        cap = self.cap
        ops = self._skip
        self._skip = []
        ops.append((WRITE, self._seat_off[side], _Q.pack(self._seq << STATE_BITS | _TAKING)))
        ops.append((FAA, OFF_TAIL if side == PUSH else OFF_HEAD, 1))
        if self._whole:
            ops.append((READ, OFF_HEAD, _V_STAMPS + 8 * cap))
            res = self._batch(ops)
            pos, view = res[-2], res[-1]
            return pos, _Q.unpack_from(view, _V_STAMPS + 8 * (pos % cap))[0], view
        first = self._seen[side] % cap
        n = min(WINDOW_SLOTS, cap - first)
        ops.append((READ, OFF_HEAD, _V_STAMPS))
        ops.append((READ, STAMPS_OFFSET + 8 * first, 8 * n))
        res = self._batch(ops)
        pos, view, window = res[-3], res[-2], res[-1]
        self._seen[PUSH] = _Q.unpack_from(view, _V_TAIL)[0]
        self._seen[POP] = _Q.unpack_from(view, _V_HEAD)[0]
        k = pos % cap - first
        return pos, _Q.unpack_from(window, 8 * k)[0] if 0 <= k < n else -1, view

    @property
    def pop_ticket(self) -> int | None:
        """The position of the pop ticket this peer holds and has not claimed yet (an idle
        consumer keeps the ticket it took on an empty ring), None when it holds none."""
        q = self._ticket[POP]
        return q if q >= 0 else None
