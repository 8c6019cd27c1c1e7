"""The one definition of a ring region's memory layout, the slot stamp and the seat words.

A region is laid out as::

    offset 0    header (128 bytes)
                  0  magic            8 bytes  b"DIFFRING"         immutable
                  8  layout_version   u32                          immutable
                 12  slot_count       u32  (capacity, >= 2)        immutable
                 16  slot_size        u32  payload bytes per slot  immutable
                 20  flags            u32  reserved, 0             immutable
                 24  ring_name        32 bytes, utf-8, NUL padded  immutable
                 56  reserved         8 bytes
                 64  head             u64  consumer tickets handed out (see below)
                 72  tail             u64  producer tickets handed out (see below)
                 80  tombstones       u64  repairs: positions turned into tombstones
                 88  freed            u64  repairs: unfreed slots freed for a dead consumer
                 96  revoked          u64  peers revoked (dropped connection or claim timeout)
                104  orphan_hint      u64  1 + position of an ORPHANED slot, 0 = none known
                112  orphaned         u64  repairs: items of given-up consumer tickets that
                                           were re-offered to any consumer (ORPHANED)
                120  reserved         8 bytes
    offset 128  stamps[slot_count]   u64 each, contiguous so one READ shows the whole ring
    offset S    seats[SEATS][2]      u64 each: [push seat, pop seat] of the peer with id
                                     ``i`` at index ``i % SEATS`` (S = stamps end, rounded
                                     up to 64)
    offset P    payloads[slot_count] slot_size bytes each (P = seats end rounded up to 64)

Positions and tickets. Every push is given a *position* ``p`` (0, 1, 2, ...); it lives in
slot ``p % slot_count``. A producer takes its position as a *ticket*: ``fetch_and_add(tail,
1)`` returns ``p``, and no other producer can ever be handed ``p``. Consumers take tickets
from ``head`` the same way. So ``tail`` is exactly the number of producer tickets handed out
and ``head`` the number of consumer tickets; both only grow, and only by that FAA. A ticket
is a right, not yet a claim: the ticket holder records itself in the slot's stamp with a CAS
(the claim) once the slot has reached its position.

The slot's stamp says which position the slot is at and in which state::

    stamp = position << 24 | holder << 4 | state

    FREE(p)            slot ready for the producer holding ticket p. Initially FREE(i).
    CLAIMED_PUSH(p, h) producer h (holding ticket p) claimed it and is writing its payload.
    PUBLISHED(p)       payload of position p is complete; the consumer holding ticket p
                       claims it.
    CLAIMED_POP(p, h)  consumer h claimed position p and is reading it.
    TOMBSTONE(p)       position p will never be published (its producer died or gave its
                       ticket up); the consumer holding ticket p skips it.
    ORPHANED(p)        published, but the consumer ticket p was given up (its holder died or
                       left it unused past the claim timeout): *any* consumer may claim it.

A slot moves FREE(p) -> CLAIMED_PUSH(p,h) -> PUBLISHED(p) -> CLAIMED_POP(p,h) -> FREE(p+cap),
with the repairs CLAIMED_PUSH(p,h) -> TOMBSTONE(p) and FREE(p) -> TOMBSTONE(p) (producer side),
PUBLISHED(p) -> ORPHANED(p) -> CLAIMED_POP(p,h) and TOMBSTONE(p) -> FREE(p+cap) (consumer
side). Every transition is a compare-and-swap on the stamp, so exactly one peer wins each
claim, the claimer's id is recorded atomically with the claim, and a late verb from a revoked
peer fails instead of corrupting a reused slot. Only the host writes TOMBSTONE over FREE and
ORPHANED over PUBLISHED, and only for a ticket whose holder can no longer act on it unseen
(see the seats).

Seats: who holds a ticket that is not claimed yet. Between its ticket FAA and its claim CAS a
peer holds a position that no stamp names. Each peer therefore keeps two words in the region,
one per side, at index ``peer_id % SEATS`` (the host never gives two live peers one seat)::

    seat = value << 4 | kind

    IDLE            no ticket.
    TAKING(seq)     written in the same batch as, and before, the ticket FAA: the peer may
                    hold a ticket it has not declared yet. ``seq`` changes on every ticket,
                    so the host can tell a peer that moved on from one that is stuck.
    HOLDS(p)        the peer's latest ticket is p. It is outstanding while p's stamp is not
                    claimed, published-over or skipped; after that the word is stale and
                    means nothing. A HOLDS ticket is always claimed by CAS *before* the peer
                    writes the slot, so the host may give it up (TOMBSTONE / ORPHANED) while
                    its holder lives: the holder's claim then fails and it takes a new ticket.

A peer writes its slot's payload before its claim CAS has answered only while its seat says
TAKING (the claim, the payload write and the publish in one batch, right after seeing FREE(p)
for its own ticket); a TAKING seat is never given up behind its holder's back: the host
revokes the peer first (claim timeout) or waits until the peer is gone.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from rings.errors import ConfigError, LayoutMismatch

MAGIC = b"DIFFRING"
LAYOUT_VERSION = 2  # 2: ticket counters, seats, ORPHANED
HEADER_SIZE = 128
NAME_BYTES = 32
RING_NAMES = ("request", "phase1", "phase2")
"""The controller's three rings, in pipeline order (each a region of its own, with this name
in its header)."""

# Header field offsets (bytes). Counters are 8-byte aligned because RDMA atomics and our
# tcp atomics both demand natural alignment.
OFF_MAGIC = 0
OFF_VERSION = 8
OFF_SLOT_COUNT = 12
OFF_SLOT_SIZE = 16
OFF_FLAGS = 20
OFF_NAME = 24
OFF_HEAD = 64
OFF_TAIL = 72
OFF_TOMBSTONES = 80
OFF_FREED = 88
OFF_REVOKED = 96
OFF_ORPHAN_HINT = 104
OFF_ORPHANED = 112
STAMPS_OFFSET = HEADER_SIZE
# Peers may not write below this offset: the identity part of the header is immutable.
WRITABLE_FROM = OFF_HEAD

_STATIC = struct.Struct("<8sIIII32s")
assert _STATIC.size == OFF_HEAD - 8  # magic..name, followed by 8 reserved bytes
for _off in (
    OFF_HEAD,
    OFF_TAIL,
    OFF_TOMBSTONES,
    OFF_FREED,
    OFF_REVOKED,
    OFF_ORPHAN_HINT,
    OFF_ORPHANED,
):
    assert _off % 8 == 0, "counter not 8-byte aligned"

STATE_BITS = 4
HOLDER_BITS = 20
POS_SHIFT = STATE_BITS + HOLDER_BITS
MAX_HOLDER = (1 << HOLDER_BITS) - 1
MAX_POSITION = (1 << (64 - POS_SHIFT)) - 1
_STATE_MASK = (1 << STATE_BITS) - 1

MAX_SLOT_COUNT = 1 << 20
MAX_SLOT_SIZE = 16 << 20

# Seats: how many peers of one ring can hold tickets at once (16 bytes each, 16 KiB per
# region). The host allocates peer ids so that no two live peers share ``id % SEATS``.
SEATS = 1024
SEAT_BYTES = 16
PUSH = 0
POP = 1

# Holder ids: 0 means "nobody" (used in unclaimed states); 1 is the host's own in-process
# access; remote peers get ids from 2 upwards.
HOLDER_NONE = 0
HOLDER_LOCAL = 1


class SlotState(enum.IntEnum):
    FREE = 0
    CLAIMED_PUSH = 1
    PUBLISHED = 2
    CLAIMED_POP = 3
    TOMBSTONE = 4
    ORPHANED = 5


class SeatKind(enum.IntEnum):
    IDLE = 0
    TAKING = 1
    HOLDS = 2


def stamp(position: int, state: SlotState, holder: int = HOLDER_NONE) -> int:
    """Pack a stamp word."""
    return (position << POS_SHIFT) | (holder << STATE_BITS) | int(state)


def unpack_stamp(word: int) -> tuple[int, SlotState, int]:
    """Unpack a stamp word into (position, state, holder)."""
    state = word & _STATE_MASK
    holder = (word >> STATE_BITS) & MAX_HOLDER
    return word >> POS_SHIFT, SlotState(state), holder


def seat(kind: SeatKind, value: int = 0) -> int:
    """Pack a seat word: a sequence number for TAKING, a position for HOLDS."""
    return (value << STATE_BITS) | int(kind)


def unpack_seat(word: int) -> tuple[SeatKind, int]:
    """Unpack a seat word into (kind, value)."""
    return SeatKind(word & _STATE_MASK), word >> STATE_BITS


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class RingLayout:
    """Geometry of one ring region. Two peers agree on a ring only if these agree."""

    name: str
    """Ring name (request / phase1 / phase2 or a test name); at most 32 utf-8 bytes."""
    slot_count: int
    """Number of slots (ring capacity); at least 2."""
    slot_size: int
    """Payload bytes per slot, a multiple of 8 so every slot starts 8-byte aligned."""
    version: int = LAYOUT_VERSION
    """Layout version; bumped whenever this file changes the byte layout."""

    def __post_init__(self) -> None:
        if not self.name or len(self.name.encode()) > NAME_BYTES:
            raise ConfigError(f"ring name must be 1..{NAME_BYTES} utf-8 bytes, got {self.name!r}")
        if not 2 <= self.slot_count <= MAX_SLOT_COUNT:
            raise ConfigError(
                f"ring {self.name!r}: slot count must be in 2..{MAX_SLOT_COUNT}, "
                f"got {self.slot_count}"
            )
        if not 64 <= self.slot_size <= MAX_SLOT_SIZE or self.slot_size % 8:
            raise ConfigError(
                f"ring {self.name!r}: slot size must be a multiple of 8 in 64..{MAX_SLOT_SIZE}"
                f", got {self.slot_size}"
            )

    @property
    def seats_offset(self) -> int:
        return _align(STAMPS_OFFSET + 8 * self.slot_count, 64)

    @property
    def payloads_offset(self) -> int:
        return _align(self.seats_offset + SEATS * SEAT_BYTES, 64)

    @property
    def region_size(self) -> int:
        return self.payloads_offset + self.slot_count * self.slot_size

    def stamp_offset(self, position: int) -> int:
        return STAMPS_OFFSET + 8 * (position % self.slot_count)

    def seat_offset(self, peer_id: int, side: int) -> int:
        """Offset of ``peer_id``'s seat word for ``side`` (PUSH or POP)."""
        return self.seats_offset + SEAT_BYTES * (peer_id % SEATS) + 8 * side

    def payload_offset(self, position: int) -> int:
        return self.payloads_offset + self.slot_size * (position % self.slot_count)

    def header_bytes(self) -> bytes:
        """The immutable first 64 bytes of the region."""
        static = _STATIC.pack(
            MAGIC, self.version, self.slot_count, self.slot_size, 0, self.name.encode()
        )
        return static + bytes(OFF_HEAD - len(static))

    def describe(self) -> dict[str, int | str]:
        return {
            "name": self.name,
            "version": self.version,
            "slot_count": self.slot_count,
            "slot_size": self.slot_size,
        }

    @classmethod
    def from_header(cls, data: bytes) -> RingLayout:
        """Parse a region header; raises LayoutMismatch when it is not a diffring region."""
        if len(data) < OFF_HEAD:
            raise LayoutMismatch(f"region header too short ({len(data)} bytes)")
        magic, version, count, size, _flags, raw_name = _STATIC.unpack_from(data)
        if magic != MAGIC:
            raise LayoutMismatch(f"not a diffring ring region (magic {magic!r})")
        if version != LAYOUT_VERSION:
            raise LayoutMismatch(
                f"region layout version {version}, this build understands {LAYOUT_VERSION}"
            )
        return cls(raw_name.rstrip(b"\0").decode(), count, size, version)

    def initial_region(self) -> bytearray:
        """A fresh region: header, zero counters, slot i stamped FREE(i), every seat IDLE."""
        buf = bytearray(self.region_size)
        buf[:OFF_HEAD] = self.header_bytes()
        for i in range(self.slot_count):
            struct.pack_into("<Q", buf, STAMPS_OFFSET + 8 * i, stamp(i, SlotState.FREE))
        return buf
