"""The one definition of a ring region's memory layout and of the slot stamp word.

A region is laid out as::

    offset 0    header (128 bytes)
                  0  magic            8 bytes  b"DIFFRING"         immutable
                  8  layout_version   u32                          immutable
                 12  slot_count       u32  (capacity, >= 2)        immutable
                 16  slot_size        u32  payload bytes per slot  immutable
                 20  flags            u32  reserved, 0             immutable
                 24  ring_name        32 bytes, utf-8, NUL padded  immutable
                 56  reserved         8 bytes
                 64  head             u64  consumer hint (see below)
                 72  tail             u64  producer hint (see below)
                 80  tombstones       u64  repairs: unpublished slots turned into tombstones
                 88  freed            u64  repairs: unfreed slots freed for a dead consumer
                 96  revoked          u64  peers revoked (dropped connection or claim timeout)
                104  reserved         24 bytes
    offset 128  stamps[slot_count]   u64 each, contiguous so one READ shows the whole ring
    offset P    payloads[slot_count] slot_size bytes each (P = stamps end rounded up to 64)

Positions. Every push is given a *position* ``p`` (0, 1, 2, ...); it lives in slot
``p % slot_count``. The slot's stamp says which position the slot is at and in which state:

    stamp = position << 24 | holder << 4 | state

    FREE(p)            slot ready for the producer of position p. Initially FREE(i) for slot i.
    CLAIMED_PUSH(p, h) producer h claimed position p and is writing its payload.
    PUBLISHED(p)       payload of position p is complete; consumers may claim it.
    CLAIMED_POP(p, h)  consumer h claimed position p and is reading it.
    TOMBSTONE(p)       the producer of p died before publishing; consumers skip it.

A slot moves FREE(p) -> CLAIMED_PUSH(p,h) -> PUBLISHED(p) -> CLAIMED_POP(p,h) -> FREE(p+cap),
or CLAIMED_PUSH(p,h) -> TOMBSTONE(p) -> FREE(p+cap) when repaired. Every transition is a
compare-and-swap on the stamp, so exactly one peer wins each claim, the claimer's id is
recorded atomically with the claim, and a late verb from a revoked peer fails instead of
corrupting a reused slot.

``tail`` is the number of positions claimed by producers so far, except that it may lag
behind by the claims whose claimers have not yet advanced it (anyone may advance it with a
CAS once it knows position ``tail`` is claimed). ``head`` is the same for consumers.
Invariant: all positions below ``tail`` are claimed; a position is only claimed by a peer
that has just made ``tail`` reach it, so claimed positions are always contiguous.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from rings.errors import ConfigError, LayoutMismatch

MAGIC = b"DIFFRING"
LAYOUT_VERSION = 1
HEADER_SIZE = 128
NAME_BYTES = 32

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
STAMPS_OFFSET = HEADER_SIZE
# Peers may not write below this offset: the identity part of the header is immutable.
WRITABLE_FROM = OFF_HEAD

_STATIC = struct.Struct("<8sIIII32s")
assert _STATIC.size == OFF_HEAD - 8  # magic..name, followed by 8 reserved bytes
for _off in (OFF_HEAD, OFF_TAIL, OFF_TOMBSTONES, OFF_FREED, OFF_REVOKED, STAMPS_OFFSET):
    assert _off % 8 == 0, "counter not 8-byte aligned"

STATE_BITS = 4
HOLDER_BITS = 20
POS_SHIFT = STATE_BITS + HOLDER_BITS
MAX_HOLDER = (1 << HOLDER_BITS) - 1
MAX_POSITION = (1 << (64 - POS_SHIFT)) - 1
_STATE_MASK = (1 << STATE_BITS) - 1

MAX_SLOT_COUNT = 1 << 20
MAX_SLOT_SIZE = 16 << 20

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


def stamp(position: int, state: SlotState, holder: int = HOLDER_NONE) -> int:
    """Pack a stamp word."""
    return (position << POS_SHIFT) | (holder << STATE_BITS) | int(state)


def unpack_stamp(word: int) -> tuple[int, SlotState, int]:
    """Unpack a stamp word into (position, state, holder)."""
    state = word & _STATE_MASK
    holder = (word >> STATE_BITS) & MAX_HOLDER
    return word >> POS_SHIFT, SlotState(state), holder


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
    def payloads_offset(self) -> int:
        return _align(STAMPS_OFFSET + 8 * self.slot_count, 64)

    @property
    def region_size(self) -> int:
        return self.payloads_offset + self.slot_count * self.slot_size

    def stamp_offset(self, position: int) -> int:
        return STAMPS_OFFSET + 8 * (position % self.slot_count)

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
        """A fresh region: header, zero counters, slot i stamped FREE(i)."""
        buf = bytearray(self.region_size)
        buf[:OFF_HEAD] = self.header_bytes()
        for i in range(self.slot_count):
            struct.pack_into("<Q", buf, STAMPS_OFFSET + 8 * i, stamp(i, SlotState.FREE))
        return buf
