"""Keeping a ring region flowing when its peers die: revocation, then repair.


Liveness. A peer is alive while its connection is open. When the connection drops, or when
one of its claims is older than ``claim_timeout_s`` (timed by the host itself from when it
first saw the claim, so no peer clock is trusted), the host

  1. revokes the peer: marks it revoked, so none of its buffered or later verbs is executed,
     and closes its connection (an rdma peer's queue pair is destroyed by its revoke hook);
  2. then repairs the peer's slots: an unpublished CLAIMED_PUSH becomes a TOMBSTONE that
     consumers skip, an unfreed CLAIMED_POP is freed, each by a CAS on the stamp, counted in
     the region header;
  3. and gives up the tickets it held but had not claimed (its seat words, and positions no
     live peer declares; see :mod:`rings.tickets`): a producer's becomes a TOMBSTONE
     (counted), a consumer's item becomes ORPHANED for any consumer to take.

Order matters: a slot is never repaired while its holder could still write to it. A live
peer's declared ticket is given up without revoking it when it has been ready and unused past
the claim timeout (its holder claims by CAS first, so it just takes a new ticket); a live peer
stuck between a ticket and its claim past the timeout is revoked like a stuck claimer.

A :class:`RingRepair` is the part of a :class:`~rings.host.RingHost` that knows who holds
what in the region (the peers that can act, their claims, their tickets) and puts right what
a dead or stuck peer leaves; the host adds the port that peers join on.
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rings.layout import (
    HOLDER_LOCAL,
    OFF_FREED,
    OFF_HEAD,
    OFF_ORPHAN_HINT,
    OFF_ORPHANED,
    OFF_REVOKED,
    OFF_TOMBSTONES,
    PUSH,
    SEAT_BYTES,
    SEATS,
    STAMPS_OFFSET,
    RingLayout,
    SlotState,
    stamp,
    unpack_stamp,
)
from rings.tickets import SIDE_NAMES, RegionView, TicketWatch, seat_holds
from rings.verbs import READ, LocalVerbs, Region, Verbs

# One logger for the whole host (rings.host, rings.repair, rings.connection).
log = logging.getLogger("diffring.rings.host")


@dataclass
class PeerInfo:
    """What the host knows about one connected peer."""

    peer_id: int
    name: str
    role: str
    transport: str
    address: str
    connected_at: float
    revoked: bool = False
    revoke_hook: Callable[[], None] | None = None
    verbs_served: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RepairCounts:
    tombstones: int
    freed: int
    revoked: int
    orphaned: int = 0


class RingRepair:
    """One ring region, the peers that may act on it, and their revocation and repair.

    ``peers`` holds the peers that can act (joined and not cut off); a subclass that serves
    them connections drops a revoked peer's in :meth:`_disconnect`.
    """

    def __init__(self, layout: RingLayout, claim_timeout_s: float) -> None:
        self.layout = layout
        self.claim_timeout_s = claim_timeout_s
        self.region = Region(layout)
        # The host's own verbs. With rdma, start() swaps in a loopback queue pair: a NIC's
        # atomics are not atomic with respect to CPU updates made under region.lock.
        self.local: Verbs = LocalVerbs(self.region, HOLDER_LOCAL)
        self.peers: dict[int, PeerInfo] = {}
        self._first_seen: dict[tuple[int, int], float] = {}
        self._pending_revoke: dict[int, PeerInfo] = {}
        self._tickets = TicketWatch(layout)
        self._in_ticket_repair = False

    def _disconnect(self, peer_id: int) -> None:
        """Close a revoked peer's connection (none here: see :class:`~rings.host.RingHost`)."""

    def _holds_any(self, pid: int) -> bool:
        return any(holder == pid for _s, _p, _st, holder in self._stamps())

    def _stamps(self) -> list[tuple[int, int, SlotState, int]]:
        raw = self.local.read(STAMPS_OFFSET, 8 * self.layout.slot_count)
        out = []
        for slot, (word,) in enumerate(struct.iter_unpack("<Q", raw)):
            pos, state, holder = unpack_stamp(word)
            out.append((slot, pos, state, holder))
        return out
    def revoke(self, peer_id: int, reason: str, *, timed_out: bool = False) -> None:
        """Cut a peer off, then repair every slot it holds.

        A peer that leaves holding no claim is just gone; a peer cut off while holding
        claims (or for holding one too long) counts as revoked in the region header.
        """
        peer = self.peers.pop(peer_id, None)
        holds = self._holds_any(peer_id)
        if peer is not None and not peer.revoked:
            peer.revoked = True
            counted = holds or timed_out or self._seat_holds(peer_id)
            if peer.revoke_hook is not None and not self._run_revoke_hook(peer):
                # Its queue pair may still be able to write: repair only once the hook
                # succeeds (retried by the scanner), never while the peer can write.
                self._pending_revoke[peer_id] = peer
                holds = False
            else:
                self._release_seats(peer_id)
            if counted:
                self.local.fetch_and_add(OFF_REVOKED, 1)
                log.warning(
                    "ring %s: revoked peer %d (%s, %s): %s",
                    self.layout.name,
                    peer_id,
                    peer.name,
                    peer.address,
                    reason,
                )
            else:
                log.info("ring %s: peer %d (%s) left", self.layout.name, peer_id, peer.name)
        self._disconnect(peer_id)
        if holds:
            self.repair(peer_id)
        self.repair_tickets()

    def _run_revoke_hook(self, peer: PeerInfo) -> bool:
        assert peer.revoke_hook is not None
        try:
            peer.revoke_hook()
        except Exception:
            log.exception(
                "ring %s: revoke hook of peer %d failed; repair deferred",
                self.layout.name,
                peer.peer_id,
            )
            return False
        return True

    def repair(self, peer_id: int) -> int:
        """Turn ``peer_id``'s claimed slots into tombstones / free slots; returns count."""
        repaired = 0
        cap = self.layout.slot_count
        for slot, pos, state, holder in self._stamps():
            if holder != peer_id:
                continue
            off = STAMPS_OFFSET + 8 * slot
            old = stamp(pos, state, holder)
            if state == SlotState.CLAIMED_PUSH:
                new, counter = stamp(pos, SlotState.TOMBSTONE), OFF_TOMBSTONES
            elif state == SlotState.CLAIMED_POP:
                new, counter = stamp(pos + cap, SlotState.FREE), OFF_FREED
            else:
                continue
            if self.local.compare_and_swap(off, old, new) == old:
                self.local.fetch_and_add(counter, 1)
                repaired += 1
                log.warning(
                    "ring %s: repaired slot %d (position %d, %s of peer %d)",
                    self.layout.name,
                    slot,
                    pos,
                    state.name,
                    peer_id,
                )
        return repaired

    # -- tickets (see rings.tickets) -------------------------------------------------------
    def _view(self, extra: tuple[int, ...] = ()) -> RegionView:
        """Counters, then stamps, then the seats of every peer that can act (and ``extra``):
        one batch, read in this order (what rings.tickets relies on)."""
        lay = self.layout
        head_raw, stamps_raw, seats_raw = self.local.batch(
            [
                (READ, OFF_HEAD, OFF_ORPHAN_HINT + 8 - OFF_HEAD),
                (READ, STAMPS_OFFSET, 8 * lay.slot_count),
                (READ, lay.seats_offset, SEATS * SEAT_BYTES),
            ]
        )
        head, tail = struct.unpack_from("<QQ", head_raw)
        (hint,) = struct.unpack_from("<Q", head_raw, OFF_ORPHAN_HINT - OFF_HEAD)
        pids = {*self.peers, *self._pending_revoke, HOLDER_LOCAL, *extra}
        return RegionView(
            head,
            tail,
            hint,
            tuple(w for (w,) in struct.iter_unpack("<Q", stamps_raw)),
            {p: struct.unpack_from("<QQ", seats_raw, SEAT_BYTES * (p % SEATS)) for p in pids},
        )

    def _seat_holds(self, peer_id: int) -> bool:
        """Whether a peer's seats say it holds a ticket (or may: TAKING)."""
        view = self._view((peer_id,))
        return seat_holds(view, view.seats[peer_id], self.layout.slot_count)

    def _release_seats(self, peer_id: int) -> None:
        """A cut-off peer's declared tickets are given up; its seat is free for another."""
        view = self._view((peer_id,))
        self._tickets.forget_peer(view, view.seats[peer_id])
        self.local.write(self.layout.seat_offset(peer_id, PUSH), bytes(SEAT_BYTES))

    def repair_tickets(self, now: float | None = None) -> None:
        """Give up the tickets whose holders are gone or idle past the claim timeout; revoke
        live peers stuck between a ticket and its claim past it; renew the orphan hint."""
        if self._in_ticket_repair:  # a revoke below comes back here
            return
        self._in_ticket_repair = True
        try:
            now = time.monotonic() if now is None else now
            view = self._view()
            live = {*self.peers, *self._pending_revoke, HOLDER_LOCAL}
            acts = self._tickets.step(view, live, now, self.claim_timeout_s)
            orphans = {
                pos
                for pos, state, _ in map(unpack_stamp, view.stamps)
                if state == SlotState.ORPHANED
            }
            for g in acts.give_up:
                off = self.layout.stamp_offset(g.position)
                if self.local.compare_and_swap(off, g.old, g.new) != g.old:
                    continue
                new_state = unpack_stamp(g.new)[1]
                if new_state == SlotState.TOMBSTONE:
                    self.local.fetch_and_add(OFF_TOMBSTONES, 1)
                elif new_state == SlotState.ORPHANED:
                    self.local.fetch_and_add(OFF_ORPHANED, 1)
                    orphans.add(g.position)
                log.warning(
                    "ring %s: gave up the %s ticket of position %d (%s)",
                    self.layout.name,
                    SIDE_NAMES[g.side],
                    g.position,
                    new_state.name,
                )
            hint = min(orphans) + 1 if orphans else 0
            if hint != view.orphan_hint:
                self.local.write(OFF_ORPHAN_HINT, struct.pack("<Q", hint))
            for pid in acts.revoke:
                if pid in self.peers:
                    self.revoke(
                        pid,
                        f"ticket held unclaimed longer than the {self.claim_timeout_s:g} s "
                        "claim timeout",
                        timed_out=True,
                    )
        finally:
            self._in_ticket_repair = False
        if acts.revoke:
            self.repair_tickets(now)

    def repair_counts(self) -> RepairCounts:
        raw = self.local.read(OFF_TOMBSTONES, OFF_ORPHANED + 8 - OFF_TOMBSTONES)
        t, f, r, _hint, o = struct.unpack("<QQQQQ", raw)
        return RepairCounts(t, f, r, o)

    def scan_once(self, now: float | None = None) -> None:
        """Time every claim; revoke holders of over-age claims and repair orphaned ones."""
        now = time.monotonic() if now is None else now
        for pid, peer in list(self._pending_revoke.items()):
            if self._run_revoke_hook(peer):
                del self._pending_revoke[pid]
                self.repair(pid)
                self._release_seats(pid)
        seen: dict[tuple[int, int], float] = {}
        stale: set[int] = set()
        for slot, pos, state, holder in self._stamps():
            if state not in (SlotState.CLAIMED_PUSH, SlotState.CLAIMED_POP):
                continue
            if holder == HOLDER_LOCAL:
                continue
            if holder in self._pending_revoke:
                continue  # not yet cut off: must not be repaired
            if holder not in self.peers:
                # The holder is gone (its revoke raced with this claim's verb, or it was
                # never a live peer): nobody can write this slot any more, repair it.
                stale.add(holder)
                continue
            key = (slot, stamp(pos, state, holder))
            first = self._first_seen.get(key, now)
            seen[key] = first
            if now - first > self.claim_timeout_s:
                stale.add(holder)
        self._first_seen = seen
        for holder in stale:
            if holder in self.peers:
                self.revoke(
                    holder,
                    f"claim held longer than the {self.claim_timeout_s:g} s claim timeout",
                    timed_out=True,
                )
            else:
                self.repair(holder)
        self.repair_tickets(now)

