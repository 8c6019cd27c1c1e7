"""Slot payload framing: a versioned msgpack map behind a small checked header.

    offset 0   body_len   u32   bytes of msgpack that follow the header
           4   format     u16   PAYLOAD_FORMAT (bumped on incompatible changes)
           6   reserved   u16   0
           8   crc32      u32   zlib.crc32 of the body
          12   reserved   u32   0
          16   position   u64   ring position the payload was written for
          24   body       msgpack map with str keys

The position ties a payload to one lap of its slot, so a late write meant for another lap
(a revoked peer's, say) is detected rather than served; the crc catches torn writes.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Mapping
from typing import Any

import msgpack

from rings.errors import PayloadCorrupt, PayloadTooLarge

PAYLOAD_FORMAT = 1
_HEADER = struct.Struct("<IHHIIQ")
HEADER_SIZE = _HEADER.size
assert HEADER_SIZE == 24


def max_body(slot_size: int) -> int:
    """Largest msgpack body that fits a slot of ``slot_size`` bytes."""
    return slot_size - HEADER_SIZE


def encode_body(item: Mapping[str, Any], slot_size: int, ring: str | None = None) -> bytes:
    """Pack ``item`` as msgpack; raise PayloadTooLarge (size and limit) if it cannot fit."""
    if not isinstance(item, Mapping):
        raise TypeError(f"ring payloads are maps, got {type(item).__name__}")
    body: bytes = msgpack.packb(dict(item), use_bin_type=True)
    limit = max_body(slot_size)
    if len(body) > limit:
        raise PayloadTooLarge(len(body), limit, ring=ring)
    return body


def frame(body: bytes, position: int) -> bytes:
    """Header + body, ready to be written into a slot for ``position``."""
    return _HEADER.pack(len(body), PAYLOAD_FORMAT, 0, zlib.crc32(body), 0, position) + body


def unframe(data: bytes, position: int, ring: str | None = None) -> dict[str, Any]:
    """Check and decode a slot's bytes; raise PayloadCorrupt naming what is wrong."""
    if len(data) < HEADER_SIZE:
        raise PayloadCorrupt(f"slot payload shorter than its header ({len(data)} bytes)", ring=ring)
    length, fmt, _r1, crc, _r2, pos = _HEADER.unpack_from(data)
    if fmt != PAYLOAD_FORMAT:
        raise PayloadCorrupt(
            f"payload format {fmt} at position {position}, expected {PAYLOAD_FORMAT}",
            ring=ring,
        )
    if pos != position:
        raise PayloadCorrupt(
            f"payload written for position {pos} found at position {position}", ring=ring
        )
    if HEADER_SIZE + length > len(data):
        raise PayloadCorrupt(
            f"payload length {length} at position {position} exceeds the slot", ring=ring
        )
    body = data[HEADER_SIZE : HEADER_SIZE + length]
    if zlib.crc32(body) != crc:
        raise PayloadCorrupt(f"payload checksum mismatch at position {position}", ring=ring)
    try:
        item = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise PayloadCorrupt(
            f"payload at position {position} is not valid msgpack: {exc}", ring=ring
        ) from exc
    if not isinstance(item, dict):
        raise PayloadCorrupt(f"payload at position {position} is not a map", ring=ring)
    return item


def peek(data: bytes) -> tuple[int, int, bool]:
    """(body length, position, crc ok) of a slot's bytes, without raising; for inspection."""
    if len(data) < HEADER_SIZE:
        return 0, 0, False
    length, _fmt, _r1, crc, _r2, pos = _HEADER.unpack_from(data)
    body = data[HEADER_SIZE : HEADER_SIZE + length]
    return length, pos, len(body) == length and zlib.crc32(body) == crc
