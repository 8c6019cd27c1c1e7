"""Bounded MPMC ring over one-sided verbs (Vyukov's per-slot sequence stamps).

The protocol (stamp states and the head/tail invariants are documented in
:mod:`rings.layout`). Each peer keeps a *hint*: the next position it believes it can claim,
together with the knowledge that the position before it has already been claimed. That
knowledge is what lets a claim be one round trip:

push, round trip 1 (claim):
    CAS tail (p-1 -> p)                 tail >= p-1 is known, so afterwards tail >= p
    CAS stamp[p] FREE(p) -> CLAIMED_PUSH(p, me)
  The stamp CAS can only succeed when position p is unclaimed, i.e. when tail == p, so
  claimed positions stay contiguous. On failure the old stamp tells why: p was taken (try
  p+1), the slot is a lap behind (ring full), or we are far behind (jump to the old tail).
push, round trip 2 (publish):
    WRITE payload[p]; CAS stamp CLAIMED_PUSH(p, me) -> PUBLISHED(p); CAS tail (p -> p+1)
  Verbs of one batch take effect in order, so the payload lands before the stamp.

pop, round trip 1 (claim and read):
    CAS head (q-1 -> q); CAS stamp[q] PUBLISHED(q) -> CLAIMED_POP(q, me); READ payload[q]
  The READ runs after the CAS: if the claim won, the bytes are the published payload.
pop, round trip 2 (free):
    CAS stamp CLAIMED_POP(q, me) -> FREE(q+cap); CAS head (q -> q+1)

A tombstone at q (a dead producer's slot, repaired by the host) is skipped by freeing it.
No counter is ever changed by read-modify-write outside an atomic verb.

``try_push`` / ``try_pop`` never block; ``push`` / ``pop`` add backoff and a timeout.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from typing import Any

from rings import payload as pl
from rings.errors import ConnectionLost, PayloadCorrupt, RingEmpty, RingFull
from rings.layout import OFF_HEAD, OFF_TAIL, POS_SHIFT, RingLayout, SlotState, stamp
from rings.verbs import CAS, READ, WRITE, Op, Verbs

_STATE_MASK = (1 << 4) - 1
# The first read of a pop fetches at most this many payload bytes speculatively; larger
# payloads cost one more read while the claim is held.
SPECULATIVE_READ = 1024
CONTENTION_BACKOFF_MAX = 0.002


class RingStats:
    """Counters of one Ring object (this peer's view), for benchmarks and metrics."""

    __slots__ = (
        "claim_retries",
        "last_claim_s",
        "pops",
        "pushes",
        "round_trips",
        "tombstones_skipped",
    )

    def __init__(self) -> None:
        self.last_claim_s = 0.0
        """Seconds the last successful claim took (from the first verb to the won CAS)."""
        self.pushes = 0
        self.pops = 0
        self.round_trips = 0
        self.claim_retries = 0
        self.tombstones_skipped = 0


class Ring:
    """One peer's handle on a ring. Not thread-safe: one Ring per thread/process."""

    def __init__(self, verbs: Verbs) -> None:
        self.verbs = verbs
        self.layout: RingLayout = verbs.layout
        self.name = self.layout.name
        self.cap = self.layout.slot_count
        self.me = verbs.peer_id
        self._tail_hint = -1  # -1: unknown, read tail on first use
        self._head_hint = -1
        self.stats = RingStats()

    # -- helpers -------------------------------------------------------------------------
    def _batch(self, ops: list[Op]) -> list[Any]:
        self.stats.round_trips += 1
        return self.verbs.batch(ops)

    def _contended(self, lost: int) -> int:
        """Back off after losing a claim race, randomised and growing with each loss.

        Without it, every peer that lost position p retries p+1 in lockstep and all but
        one lose again: each won claim costs one round trip per contender.
        """
        if lost:
            time.sleep(random.uniform(0, min(CONTENTION_BACKOFF_MAX, 25e-6 * (1 << lost))))
        return min(lost + 1, 16)

    def _load_hint(self, counter: int) -> int:
        (value,) = self._batch([(READ, counter, 8)])
        return int.from_bytes(value, "little")

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
        t0 = time.perf_counter()
        lost = 0
        p = self._tail_hint if self._tail_hint >= 0 else self._load_hint(OFF_TAIL)
        while True:
            stamp_off = lay.stamp_offset(p)
            want = stamp(p, SlotState.FREE)
            mine = stamp(p, SlotState.CLAIMED_PUSH, self.me)
            ops: list[Op] = [(CAS, stamp_off, want, mine)]
            if p > 0:
                ops.insert(0, (CAS, OFF_TAIL, p - 1, p))
            res = self._batch(ops)
            old = res[-1]
            if old == want:
                self.stats.last_claim_s = time.perf_counter() - t0
                break
            self.stats.claim_retries += 1
            opos = old >> POS_SHIFT
            if opos == p:  # another producer claimed p first
                # The tail we just read says how far the claims have gone meanwhile: under
                # contention it is often well past p, and stepping p+1 would lose again.
                p = max(p + 1, res[0]) if p > 0 else p + 1
                lost = self._contended(lost)
            elif opos < p:  # the slot still holds the previous lap: full
                self._tail_hint = p
                return False
            else:  # we are at least a lap behind; resync from the tail
                old_tail = res[0] if p > 0 else self._load_hint(OFF_TAIL)
                p = max(p + 1, old_tail)
        published = stamp(p, SlotState.PUBLISHED)
        res = self._batch(
            [
                (WRITE, lay.payload_offset(p), pl.frame(body, p)),
                (CAS, stamp_off, mine, published),
                (CAS, OFF_TAIL, p, p + 1),
            ]
        )
        if res[1] != mine:
            # Only the host changes a claimed stamp, and only after revoking us.
            raise ConnectionLost(
                f"ring {self.name!r}: claim of position {p} was revoked before publish"
            )
        self._tail_hint = p + 1
        self.stats.pushes += 1
        return True

    def push(self, item: Mapping[str, Any], timeout: float | None = None) -> None:
        """Push with backoff; raise RingFull if still full after ``timeout`` seconds."""
        body = self.encode(item)
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 50e-6
        while not self.try_push_body(body):
            if deadline is not None and time.monotonic() >= deadline:
                raise RingFull(f"ring {self.name!r} stayed full for {timeout} s", ring=self.name)
            time.sleep(delay)
            delay = min(delay * 2, 0.005)

    # -- consumer ------------------------------------------------------------------------
    def try_pop(self) -> dict[str, Any] | None:
        """Pop the oldest published item, or None when there is none right now."""
        lay = self.layout
        t0 = time.perf_counter()
        lost = 0
        q = self._head_hint if self._head_hint >= 0 else self._load_hint(OFF_HEAD)
        first_read = min(lay.slot_size, SPECULATIVE_READ)
        while True:
            stamp_off = lay.stamp_offset(q)
            want = stamp(q, SlotState.PUBLISHED)
            mine = stamp(q, SlotState.CLAIMED_POP, self.me)
            ops: list[Op] = [
                (CAS, stamp_off, want, mine),
                (READ, lay.payload_offset(q), first_read),
            ]
            if q > 0:
                ops.insert(0, (CAS, OFF_HEAD, q - 1, q))
            res = self._batch(ops)
            old = res[-2]
            if old == want:
                self.stats.last_claim_s = time.perf_counter() - t0
                data = res[-1]
                break
            self.stats.claim_retries += 1
            opos = old >> POS_SHIFT
            ostate = old & _STATE_MASK
            if opos == q:
                if ostate == SlotState.FREE or ostate == SlotState.CLAIMED_PUSH:
                    self._head_hint = q
                    return None  # nothing published at q yet
                if ostate == SlotState.TOMBSTONE:
                    self._batch([(CAS, stamp_off, old, stamp(q + self.cap, SlotState.FREE))])
                    self.stats.tombstones_skipped += 1
                    q += 1
                else:  # taken by another consumer; the head we read may be further on
                    q = max(q + 1, res[0]) if q > 0 else q + 1
                    lost = self._contended(lost)
            elif opos < q:  # slot still at a lap behind: nothing at q yet
                self._head_hint = q
                return None
            else:  # at least a lap behind; resync from the head
                old_head = res[0] if q > 0 else self._load_hint(OFF_HEAD)
                q = max(q + 1, old_head)
        length = int.from_bytes(data[:4], "little")
        if pl.HEADER_SIZE + length > len(data) and pl.HEADER_SIZE + length <= lay.slot_size:
            off = lay.payload_offset(q) + len(data)
            data += self._batch([(READ, off, pl.HEADER_SIZE + length - len(data))])[0]
        res = self._batch(
            [
                (CAS, stamp_off, mine, stamp(q + self.cap, SlotState.FREE)),
                (CAS, OFF_HEAD, q, q + 1),
            ]
        )
        self._head_hint = q + 1
        if res[0] != mine:
            raise ConnectionLost(
                f"ring {self.name!r}: claim of position {q} was revoked before free"
            )
        self.stats.pops += 1
        try:
            return pl.unframe(data, q, ring=self.name)
        except PayloadCorrupt as exc:
            exc.slot = q % self.cap
            raise

    def pop(self, timeout: float | None = None) -> dict[str, Any]:
        """Pop with backoff; raise RingEmpty if nothing arrives within ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 50e-6
        while True:
            item = self.try_pop()
            if item is not None:
                return item
            if deadline is not None and time.monotonic() >= deadline:
                raise RingEmpty(f"ring {self.name!r} stayed empty for {timeout} s", ring=self.name)
            time.sleep(delay)
            delay = min(delay * 2, 0.005)
