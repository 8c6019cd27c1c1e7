"""Wire formats of the ring handshake port (tcp transport, and the rdma setup exchange).

Every message is a frame: ``u32 little-endian body length`` + body. The first three frames
of a connection are the handshake, msgpack maps:

  1. host -> peer   HELLO   {proto, version, nonce}
  2. peer -> host   JOIN    {proto, version, ring, layout | None, transport, role,
                             peer_name, client_nonce, mac, + transport extras}
        mac = HMAC-SHA256(token, b"join" + nonce + client_nonce + ring)
  3. host -> peer   WELCOME {ok: True, peer_id, layout, region_size, mac, + extras}
        mac = HMAC-SHA256(token, b"welcome" + client_nonce + nonce + ring)
     or             REFUSE  {ok: False, error}  and the host closes the connection.

Both sides prove they hold the cluster token; the token itself never crosses the wire.
After the handshake a tcp peer sends verb requests and the host answers each in order:

  request  = u16 count, then per verb: u8 code, u64 offset, then
               READ u32 nbytes | WRITE u32 nbytes + bytes | CAS u64 expected, u64 new
               | FAA u64 delta (two's complement)
  response = u8 status; status 0: per verb READ u32 n + bytes | WRITE nothing
                                          | CAS/FAA u64 old value
             status != 0: u8 error kind, utf-8 message (no verb of the batch ran)
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from typing import Any

import msgpack

from rings.errors import VerbAlignmentError, VerbRangeError, VerbsError
from rings.verbs import CAS, FAA, READ, U64, WRITE, Op

PROTO = "diffring-ring"
PROTO_VERSION = 1
MAX_FRAME = 64 << 20
# Handshake frames are small; a peer that sends a huge one before authenticating is refused.
MAX_HANDSHAKE_FRAME = 64 << 10
HANDSHAKE_TIMEOUT_S = 10.0

LEN = struct.Struct("<I")
_COUNT = struct.Struct("<H")
_HEAD = struct.Struct("<BQ")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_U64X2 = struct.Struct("<QQ")

ERR_RANGE = 1
ERR_ALIGN = 2
ERR_OTHER = 3
ERR_PERMISSION = 4
_ERR_TYPES: dict[int, type[VerbsError]] = {
    ERR_RANGE: VerbRangeError,
    ERR_ALIGN: VerbAlignmentError,
    ERR_OTHER: VerbsError,
    ERR_PERMISSION: VerbsError,
}


def mac(token: str, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(token.encode(), label + b"".join(parts), hashlib.sha256).digest()


def pack_msg(obj: dict[str, Any]) -> bytes:
    body: bytes = msgpack.packb(obj, use_bin_type=True)
    return LEN.pack(len(body)) + body


def unpack_msg(body: bytes) -> dict[str, Any]:
    obj = msgpack.unpackb(body, raw=False)
    if not isinstance(obj, dict):
        raise ValueError("handshake message is not a map")
    return obj


def encode_request(ops: Sequence[Op]) -> bytes:
    parts: list[bytes] = [b"", _COUNT.pack(len(ops))]
    for op in ops:
        code, offset = op[0], op[1]
        if not 0 <= offset <= U64:
            raise VerbRangeError(f"offset {offset} is outside any region", offset=offset)
        parts.append(_HEAD.pack(code, offset))
        if code == READ:
            parts.append(_U32.pack(op[2]))
        elif code == WRITE:
            parts.append(_U32.pack(len(op[2])))
            parts.append(op[2])
        elif code == CAS:
            parts.append(_U64X2.pack(op[2] & U64, op[3] & U64))
        elif code == FAA:
            parts.append(_U64.pack(op[2] & U64))
        else:
            raise VerbsError(f"unknown verb code {code!r}")
    body_len = sum(len(p) for p in parts)
    parts[0] = LEN.pack(body_len)
    return b"".join(parts)


def decode_request(body: bytes | memoryview) -> list[Op]:
    """Parse a request body; raises ValueError on malformed input (caller drops the peer)."""
    (count,) = _COUNT.unpack_from(body, 0)
    pos = 2
    ops: list[Op] = []
    for _ in range(count):
        code, offset = _HEAD.unpack_from(body, pos)
        pos += 9
        if code == READ:
            (n,) = _U32.unpack_from(body, pos)
            pos += 4
            ops.append((READ, offset, n))
        elif code == WRITE:
            (n,) = _U32.unpack_from(body, pos)
            pos += 4
            if pos + n > len(body):
                raise ValueError("write data runs past the frame")
            ops.append((WRITE, offset, bytes(body[pos : pos + n])))
            pos += n
        elif code == CAS:
            exp, new = _U64X2.unpack_from(body, pos)
            pos += 16
            ops.append((CAS, offset, exp, new))
        elif code == FAA:
            (delta,) = _U64.unpack_from(body, pos)
            pos += 8
            ops.append((FAA, offset, delta))
        else:
            raise ValueError(f"unknown verb code {code}")
    if pos != len(body):
        raise ValueError("trailing bytes after the verbs")
    return ops


def encode_response(ops: Sequence[Op], results: Sequence[Any]) -> bytes:
    parts: list[bytes] = [b"", b"\0"]
    for op, res in zip(ops, results, strict=True):
        code = op[0]
        if code == READ:
            parts.append(_U32.pack(len(res)))
            parts.append(res)
        elif code != WRITE:
            parts.append(_U64.pack(res))
    body_len = sum(len(p) for p in parts)
    parts[0] = LEN.pack(body_len)
    return b"".join(parts)


def encode_error(kind: int, message: str) -> bytes:
    body = bytes([1, kind]) + message.encode()
    return LEN.pack(len(body)) + body


def error_kind(exc: VerbsError) -> int:
    if isinstance(exc, VerbAlignmentError):
        return ERR_ALIGN
    if isinstance(exc, VerbRangeError):
        return ERR_RANGE
    return ERR_OTHER


def decode_response(body: bytes, ops: Sequence[Op]) -> list[Any]:
    if body[0] != 0:
        kind = body[1] if len(body) > 1 else ERR_OTHER
        raise _ERR_TYPES.get(kind, VerbsError)(body[2:].decode(errors="replace"))
    out: list[Any] = []
    pos = 1
    for op in ops:
        code = op[0]
        if code == READ:
            (n,) = _U32.unpack_from(body, pos)
            pos += 4
            out.append(body[pos : pos + n])
            pos += n
        elif code == WRITE:
            out.append(None)
        else:
            (v,) = _U64.unpack_from(body, pos)
            pos += 8
            out.append(v)
    return out
