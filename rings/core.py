"""Bounded MPMC ring over one-sided verbs: FAA tickets, per-slot stamps, declared seats.

Stamp states, seat words and counters are documented in :mod:`rings.layout`, the host's side
of tickets in :mod:`rings.tickets`; ``rings/ring.pml`` is this protocol as a Promela model that
spin checks (tests/integration/test_ring_model.py). Contenders never race for one position:
each takes its own with a fetch-and-add, so a push or a pop costs two round trips however
many peers contend.

push, round trip 1 (the ticket, Ring._take):
    WRITE seat.push = TAKING(seq); FAA tail -> p; READ header + stamps
  The FAA hands p to us alone. Verbs of a batch take effect in order, so the seat says TAKING
  before we hold p, and until we declare p the host knows we may hold a ticket it cannot see.
  The READ runs after the FAA: it shows p's slot as it was once p was ours. (A ring of more
  than WINDOW_SLOTS slots reads a window of stamps from the last tail seen instead.)
push, round trip 2, the slot was FREE(p) (the common case):
    CAS stamp FREE(p) -> CLAIMED_PUSH(p, me); WRITE payload[p]; CAS -> PUBLISHED(p);
    WRITE seat.push = HOLDS(p)
  Writing the payload before the claim has answered is safe: FREE(p) changes only by the claim
  of p's ticket holder (us) or by the host giving p up, and the host gives an undeclared ticket
  up only once its holder is dead or has moved on from the TAKING(seq) it showed, never while
  our seat still says TAKING(seq). So the claim wins and the payload lands in a slot we own,
  the publish after it. The seat is declared last, so it says TAKING while the batch runs; the
  claim still records our id in the stamp, so a peer dying between the verbs of the batch (rdma)
  leaves a CLAIMED_PUSH that the host repairs as before.
push, the slot was not FREE(p): the ring is full at p (subtle point 2):
  The slot still holds p - cap (or older). A ticket cannot be handed back (an FAA cannot be
  undone), so we keep it, declared, and try_push returns False (the payload is handed back):
    WRITE seat.push = HOLDS(p); CAS stamp FREE(p) -> CLAIMED_PUSH(p, me); READ head
  The next try_push (or a new Ring on the same connection: it resumes from the seat) polls with
  that CAS, one round trip, and once it wins: WRITE payload[p]; CAS -> PUBLISHED(p). A declared
  ticket is claimed by CAS before anything is written, so the host may give it up while its
  holder lives: it does when the holder is dead, or when the slot has been FREE(p) for the claim
  timeout with nobody claiming it (a producer that got "full" and never came back): FREE(p) ->
  TOMBSTONE(p), which the consumer of p skips. A holder that comes back sees its CAS fail and
  takes a new ticket. So a full ring never leaves a slot waiting for a producer that left.
pop, round trip 1 (the ticket):
    WRITE seat.pop = TAKING(seq); FAA head -> q; READ header + stamps
pop, round trip 2, the slot was PUBLISHED(q):
    CAS stamp PUBLISHED(q) -> CLAIMED_POP(q, me); READ payload[q]; CAS -> FREE(q + cap);
    WRITE seat.pop = HOLDS(q)
  The READ follows the won claim and the free follows the READ, so the item is read whole before
  the slot goes to the producer of q + cap. (Slots over WHOLE_SLOT_READ bytes are read
  SPECULATIVE_READ bytes first and freed in a third round trip, after the rest is read.)
pop, nothing published at q: an empty ring (subtle point 1):
  With FAA a consumer gets q even when no producer has q yet. try_pop must not block, and an item
  published at q later must not be lost. The consumer keeps q, declared, and returns None:
    WRITE seat.pop = HOLDS(q); CAS stamp PUBLISHED(q) -> CLAIMED_POP(q, me); READ payload;
    CAS -> FREE(q + cap); READ header (counters, orphan hint)
  and the next try_pop repeats that batch: one round trip per poll, taking the item when it
  comes. If the holder dies, or leaves a published item unclaimed for the claim timeout (a
  consumer that stopped polling), the host gives q up: PUBLISHED(q) -> ORPHANED(q), with the
  header's orphan hint pointing at it. Any consumer whose own ticket waits claims an ORPHANED
  slot by CAS (one wins); an orphan also blocks its slot's next lap, so the peers that wait there
  are the ones that take it. The item is delivered once, and no slot waits forever for a
  consumer that left. While consumers wait, head runs ahead of tail by at most their number.
A TOMBSTONE at our ticket is skipped: CAS TOMBSTONE(q) -> FREE(q + cap), posted with the next
ticket batch. A ticket whose position is gone (given up, or past) is replaced by a new one.

Dead ticket holders (subtle point 3). A peer that dies after its FAA and before its claim CAS
holds a position that no stamp names; its seat says TAKING (or HOLDS(p), once declared). The
host learns it from the region alone, which also works over rdma, where the NIC runs the FAA
unseen: after revoking the peer it gives up the tickets its seat declares, and a position below
the counter that is unclaimed and declared by no live seat is given up once it was so at two
scans in a row and every peer TAKING at the first has moved on since (rings.tickets argues why
only a dead peer's ticket remains). A live peer stuck between a ticket and its claim past the
claim timeout is revoked first, like a peer that holds a claim too long.

No counter is changed by read-modify-write outside an atomic verb. ``try_push`` / ``try_pop``
(:class:`RingCore`, here) never block; ``push`` / ``pop`` (:class:`rings.ring.Ring`) add
polling and a timeout. The ticket round trip and the seat words a peer keeps between
operations are :class:`rings.peer_tickets.PeerTickets`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from rings import payload as pl
from rings.errors import ConnectionLost, PayloadCorrupt
from rings.layout import OFF_HEAD, OFF_ORPHAN_HINT, POP, POS_SHIFT, PUSH, STATE_BITS
from rings.peer_tickets import (
    _CLAIMED_POP,
    _CLAIMED_PUSH,
    _FREE,
    _HOLDS,
    _ORPHANED,
    _PUBLISHED,
    _Q,
    _READY,
    _SKIP,
    _STATE_MASK,
    _V_ORPHAN,
    _V_TAIL,
    _VOID,
    _WAIT,
    PeerTickets,
    _pop_view,
    _push_view,
)
from rings.verbs import CAS, READ, WRITE, Op, Verbs

# Slots up to this size are read whole in the claim batch, which can then free the slot in
# the same round trip; a larger slot is read SPECULATIVE_READ bytes first and freed after.
WHOLE_SLOT_READ = 4096
SPECULATIVE_READ = 1024


class RingCore(PeerTickets):
    """The non-blocking operations of one peer's handle on a ring (:class:`~rings.ring.Ring`
    adds the blocking ones)."""

    def __init__(self, verbs: Verbs) -> None:
        super().__init__(verbs)
        lay = self.layout
        self._first_read = min(lay.slot_size, WHOLE_SLOT_READ)
        if self._first_read < lay.slot_size:
            self._first_read = SPECULATIVE_READ
        self._free_with_claim = self._first_read == lay.slot_size
        self._last_old = 0  # the stamp a failed pop claim found
        self._last_hint = -1  # the orphan hint a pop claim read (-1: none)
        self._last_tail = 0  # the tail a pop claim read
        # Set when try_push / try_pop came back empty-handed and the slot our ticket waits
        # for is one step from ready: the blocking layer then polls again at once.
        self._soon = False

    # -- producer ------------------------------------------------------------------------
    def encode(self, item: Mapping[str, Any]) -> bytes:
        """msgpack body of ``item``; raises PayloadTooLarge before anything is claimed."""
        return pl.encode_body(item, self.layout.slot_size, ring=self.name)

    def try_push(self, item: Mapping[str, Any]) -> Mapping[str, Any] | None:
        """Push ``item``; None on success, ``item`` handed back when the ring is full."""
        body = self.encode(item)
        return None if self.try_push_body(body) else item

    def try_push_body(self, body: bytes) -> bool:
        """Push an already-encoded body; False when the ring is full."""
        lay = self.layout
        me = self.me
        seat_off = self._seat_off[PUSH]
        t0 = t_ticket = time.perf_counter()
        if self._seq < 0:
            self._resume()
        while True:
            p = self._ticket[PUSH]
            if p < 0:
                p, word, _ = self._take(PUSH)
                t_ticket = time.perf_counter()
                if word == p << POS_SHIFT | _FREE:
                    # Our own ticket's slot is FREE(p): only we can claim it, and nothing
                    # but our claim changes it while our seat says TAKING, so the claim,
                    # the payload and the publish go in one batch; the seat is declared
                    # last (see the module docstring, push round trip 2).
                    stamp_off = lay.stamp_offset(p)
                    free = p << POS_SHIFT
                    mine = free | me << STATE_BITS | _CLAIMED_PUSH
                    res = self._batch(
                        [
                            (CAS, stamp_off, free, mine),
                            (WRITE, lay.payload_offset(p), pl.frame(body, p)),
                            (CAS, stamp_off, mine, free | _PUBLISHED),
                            (WRITE, seat_off, _Q.pack(p << STATE_BITS | _HOLDS)),
                        ]
                    )
                    if res[0] != free:
                        raise ConnectionLost(
                            f"ring {self.name!r}: position {p} was taken from this peer "
                            "between its ticket and its claim (revoked?)"
                        )
                    self._published(res[2], mine, p, t0, t_ticket, time.perf_counter())
                    return True
                if word >= 0 and _push_view(word, p, me) == _VOID:
                    self.stats.claim_retries += 1
                    continue
                self._ticket[PUSH] = p
            # An outstanding ticket: declare it, then claim it by CAS before any write.
            stamp_off = lay.stamp_offset(p)
            free = p << POS_SHIFT
            mine = free | me << STATE_BITS | _CLAIMED_PUSH
            ops: list[Op] = [(CAS, stamp_off, free, mine), (READ, OFF_HEAD, 8)]
            if not self._declared[PUSH]:
                ops.insert(0, (WRITE, seat_off, _Q.pack(p << STATE_BITS | _HOLDS)))
            res = self._batch(ops)
            old = res[-2]
            self._declared[PUSH] = True
            if old == free or old == mine:
                t_claim = time.perf_counter()
                res = self._batch(
                    [
                        (WRITE, lay.payload_offset(p), pl.frame(body, p)),
                        (CAS, stamp_off, mine, free | _PUBLISHED),
                    ]
                )
                self._published(res[1], mine, p, t0, t_ticket, t_claim)
                return True
            if _push_view(old, p, me) == _WAIT:
                # Full: the ticket stays ours for the next try. Its slot is soon ours when
                # the previous lap is being freed, or published with its consumer's ticket
                # out (the peers in between are at work, not waiting themselves).
                state = old & _STATE_MASK
                head = _Q.unpack(res[-1])[0]
                self._soon = old >> POS_SHIFT == p - self.cap and (
                    state == _CLAIMED_POP
                    or state == _ORPHANED
                    or (state == _PUBLISHED and p - self.cap < head)
                )
                return False
            self._ticket[PUSH] = -1
            self.stats.claim_retries += 1

    def _published(
        self, old: int, mine: int, p: int, t0: float, t_ticket: float, t_claim: float
    ) -> None:
        self._ticket[PUSH] = -1
        if old != mine:
            # Only the host changes a claimed stamp, and only after revoking us.
            raise ConnectionLost(
                f"ring {self.name!r}: claim of position {p} was revoked before publish"
            )
        self.stats.last_ticket_s = t_ticket - t0
        self.stats.last_claim_s = t_claim - t0
        self.stats.pushes += 1

    # -- consumer ------------------------------------------------------------------------
    def try_pop(self) -> dict[str, Any] | None:
        """Pop the oldest published item, or None when there is none right now."""
        me = self.me
        t0 = t_ticket = time.perf_counter()
        if self._seq < 0:
            self._resume()
        while True:
            q = self._ticket[POP]
            if q < 0:
                q, word, view = self._take(POP)
                t_ticket = time.perf_counter()
                ready = _pop_view(word, q, me) if word >= 0 else _WAIT
                if ready == _READY:
                    # PUBLISHED(q) seen after our own ticket: claim, read, free in one batch.
                    item = self._claim(q, word, q, t0, t_ticket, optimistic=True)
                    if item is not None:
                        return item
                    word = self._last_old
                    ready = _pop_view(word, q, me)
                if ready == _SKIP:
                    self._skip_tombstone(q, word)
                    continue
                if ready != _WAIT and ready != _READY:
                    self.stats.claim_retries += 1
                    continue
                self._ticket[POP] = q
                hint = _Q.unpack_from(view, _V_ORPHAN)[0] - 1
                item = self._take_orphan(hint, q, t0, t_ticket)
                if item is not None:
                    return item
            # An outstanding ticket: declare it, and claim it if it has been published.
            expect = q << POS_SHIFT | _PUBLISHED
            while True:
                item = self._claim(q, expect, q, t0, t_ticket)
                if item is not None:
                    return item
                old = self._last_old
                ready = _pop_view(old, q, me)
                if ready != _READY:
                    break
                expect = old  # ORPHANED(q): the host gave our idle ticket up; try it anyway
            if ready == _WAIT:
                # Nothing at our position yet: the ticket stays ours. It is soon published
                # if its producer is writing it, or holds its ticket and the slot is free.
                state = old & _STATE_MASK
                self._soon = old >> POS_SHIFT == q and (
                    state == _CLAIMED_PUSH or (state == _FREE and q < self._last_tail)
                )
                # An ORPHANED item may be what holds the ring up (it blocks its slot's next
                # lap): take it.
                return self._take_orphan(self._last_hint, q, t0, t_ticket)
            self._ticket[POP] = -1
            if ready == _SKIP:
                self._skip_tombstone(q, old)
            else:
                self.stats.claim_retries += 1

    def _take_orphan(
        self, orphan: int, q: int, t0: float, t_ticket: float
    ) -> dict[str, Any] | None:
        if orphan < 0 or orphan == q:
            return None
        item = self._claim(orphan, orphan << POS_SHIFT | _ORPHANED, q, t0, t_ticket)
        if item is not None:
            self.stats.orphans_taken += 1
        return item

    def _claim(
        self,
        pos: int,
        expect: int,
        q: int,
        t0: float,
        t_ticket: float,
        optimistic: bool = False,
    ) -> dict[str, Any] | None:
        """One claim round trip on ``pos`` (our ticket ``q``, or an orphan); the item if the
        claim won, else None with the stamp it found in ``self._last_old``."""
        lay = self.layout
        stamp_off = lay.stamp_offset(pos)
        mine = pos << POS_SHIFT | self.me << STATE_BITS | _CLAIMED_POP
        freed = (pos + self.cap) << POS_SHIFT | _FREE
        holds = (WRITE, self._seat_off[POP], _Q.pack(q << STATE_BITS | _HOLDS))
        ops: list[Op] = []
        if not optimistic and not self._declared[POP]:
            ops.append(holds)
        i = len(ops)
        ops.append((CAS, stamp_off, expect, mine))
        ops.append((READ, lay.payload_offset(pos), self._first_read))
        if self._free_with_claim:
            ops.append((CAS, stamp_off, mine, freed))
        if pos != q:  # whoever tries the hinted orphan clears the hint; the host renews it
            ops.append((CAS, OFF_ORPHAN_HINT, pos + 1, 0))
        elif not optimistic:  # polling our own ticket: the counters and the orphan hint
            ops.append((READ, OFF_HEAD, _V_ORPHAN + 8))
        if optimistic:
            ops.append(holds)
        res = self._batch(ops)
        if pos == q and not optimistic:
            self._last_hint = _Q.unpack_from(res[-1], _V_ORPHAN)[0] - 1
            self._last_tail = _Q.unpack_from(res[-1], _V_TAIL)[0]
        self._declared[POP] = True
        old = res[i]
        self._last_old = old
        if old != expect:
            return None
        t_claim = time.perf_counter()
        data: bytes = res[i + 1]
        if self._free_with_claim:
            was = res[i + 2]
        else:
            length = int.from_bytes(data[:4], "little")
            more = pl.HEADER_SIZE + length - len(data)
            tail: list[Op] = []
            if 0 < more <= lay.slot_size - len(data):
                tail.append((READ, lay.payload_offset(pos) + len(data), more))
            tail.append((CAS, stamp_off, mine, freed))
            r = self._batch(tail)
            if len(r) == 2:
                data += r[0]
            was = r[-1]
        if pos == q:
            self._ticket[POP] = -1
        if was != mine:
            raise ConnectionLost(
                f"ring {self.name!r}: claim of position {pos} was revoked before free"
            )
        self.stats.last_ticket_s = t_ticket - t0
        self.stats.last_claim_s = t_claim - t0
        self.stats.pops += 1
        try:
            return pl.unframe(data, pos, ring=self.name)
        except PayloadCorrupt as exc:
            exc.slot = pos % self.cap
            raise

    def _skip_tombstone(self, q: int, word: int) -> None:
        self._skip.append(
            (CAS, self.layout.stamp_offset(q), word, (q + self.cap) << POS_SHIFT | _FREE)
        )
        self.stats.tombstones_skipped += 1
