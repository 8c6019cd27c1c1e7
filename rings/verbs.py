"""The verbs interface: the seam between the ring algorithm and the transports.

A peer touches a ring region only with four one-sided verbs, exactly what an RDMA RC queue
pair offers: READ, WRITE, 8-byte compare-and-swap and 8-byte fetch-and-add. ``batch`` posts
several *independent* verbs together and returns when all completed, in one round trip, as
RDMA posts a list of work requests; verbs of one batch take effect in the order given.

Every backend implements :class:`Verbs` in a module of its own (in-process :class:`LocalVerbs`
here, :mod:`rings.tcp`, :mod:`rings.rdma`) and takes its options as the helpers at the end of
this module say; :mod:`rings.transports` picks one by name. Nothing here imports a backend.
"""

from __future__ import annotations

import inspect
import struct
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from rings.errors import (
    ConfigError,
    VerbAlignmentError,
    VerbRangeError,
    VerbsError,
)
from rings.layout import RingLayout

READ = 1
WRITE = 2
CAS = 3
FAA = 4

# An op is a plain tuple, because a ring operation builds several per round trip and tuples
# are the cheapest thing Python builds:
#   (READ, offset, nbytes) -> bytes
#   (WRITE, offset, data) -> None
#   (CAS, offset, expected, new) -> old value
#   (FAA, offset, delta) -> old value
Op = tuple[Any, ...]

U64 = (1 << 64) - 1
_Q = struct.Struct("<Q")


def check_op(op: Op, size: int, writable_from: int = 0) -> None:
    """Validate one op against a region of ``size`` bytes; raise the matching VerbsError.

    ``writable_from``: offsets below it are read-only for this peer (the immutable header).
    """
    code, offset = op[0], op[1]
    if code == READ or code == WRITE:
        n = op[2] if code == READ else len(op[2])
        if offset < 0 or n < 0 or offset + n > size:
            raise VerbRangeError(
                f"{'read' if code == READ else 'write'} of {n} bytes at offset {offset} is "
                f"outside the region (size {size})",
                offset=offset,
            )
        if code == WRITE and offset < writable_from:
            raise VerbRangeError(
                f"write at offset {offset} touches the read-only header "
                f"(writable from {writable_from})",
                offset=offset,
            )
    elif code == CAS or code == FAA:
        name = "compare_and_swap" if code == CAS else "fetch_and_add"
        if offset % 8:
            raise VerbAlignmentError(
                f"{name} at offset {offset} is not 8-byte aligned", offset=offset
            )
        if offset < 0 or offset + 8 > size:
            raise VerbRangeError(
                f"{name} at offset {offset} is outside the region (size {size})", offset=offset
            )
        if offset < writable_from:
            raise VerbRangeError(
                f"{name} at offset {offset} touches the read-only header", offset=offset
            )
        for v in op[2:]:
            if not isinstance(v, int) or not -(1 << 63) <= v <= U64:
                raise VerbsError(f"{name} operand {v!r} is not a 64-bit integer", offset=offset)
    else:
        raise VerbsError(f"unknown verb code {code!r}", offset=offset)


def execute_ops(buf: bytearray, ops: Sequence[Op]) -> list[Any]:
    """Execute already-validated ops on ``buf`` in order (the caller serialises calls)."""
    out: list[Any] = []
    for op in ops:
        code, offset = op[0], op[1]
        if code == READ:
            out.append(bytes(buf[offset : offset + op[2]]))
        elif code == WRITE:
            data = op[2]
            buf[offset : offset + len(data)] = data
            out.append(None)
        elif code == CAS:
            (old,) = _Q.unpack_from(buf, offset)
            if old == op[2] & U64:
                _Q.pack_into(buf, offset, op[3] & U64)
            out.append(old)
        else:  # FAA
            (old,) = _Q.unpack_from(buf, offset)
            _Q.pack_into(buf, offset, (old + op[2]) & U64)
            out.append(old)
    return out


class Verbs(ABC):
    """One peer's access to one ring region."""

    layout: RingLayout
    """The layout agreed at handshake (validated against the region's header)."""
    peer_id: int
    """Holder id the host assigned to this peer; written into the stamps it claims."""
    read_only: bool = False

    @abstractmethod
    def batch(self, ops: Sequence[Op]) -> list[Any]:
        """Post independent verbs together; one round trip; results in order."""

    def read(self, offset: int, nbytes: int) -> bytes:
        result: bytes = self.batch([(READ, offset, nbytes)])[0]
        return result

    def write(self, offset: int, data: bytes) -> None:
        self.batch([(WRITE, offset, bytes(data))])

    def compare_and_swap(self, offset: int, expected: int, new: int) -> int:
        old: int = self.batch([(CAS, offset, expected, new)])[0]
        return old

    def fetch_and_add(self, offset: int, delta: int) -> int:
        old: int = self.batch([(FAA, offset, delta)])[0]
        return old

    def close(self) -> None:  # noqa: B027 - optional for backends without resources
        """Release the connection; further verbs fail."""

    def __enter__(self) -> Verbs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Region:
    """A ring region in this process's memory; verbs on it are serialised by a lock.

    The lock makes every batch atomic with respect to every other batch in the process
    (the tcp server's and the host's own), which is what makes the tcp transport's atomics
    linearizable.
    """

    def __init__(self, layout: RingLayout) -> None:
        self.layout = layout
        self.buf = layout.initial_region()
        self.lock = threading.Lock()

    @property
    def size(self) -> int:
        return len(self.buf)

    def execute(self, ops: Sequence[Op], writable_from: int = 0) -> list[Any]:
        for op in ops:
            check_op(op, len(self.buf), writable_from)
        with self.lock:
            return execute_ops(self.buf, ops)


class LocalVerbs(Verbs):
    """In-process access to a :class:`Region` (unit tests, and the host's own pushes)."""

    def __init__(self, region: Region, peer_id: int) -> None:
        self.region = region
        self.layout = region.layout
        self.peer_id = peer_id
        self._closed = False

    def batch(self, ops: Sequence[Op]) -> list[Any]:
        if self._closed:
            raise VerbsError("local verbs used after close")
        return self.region.execute(ops)

    def close(self) -> None:
        self._closed = True


RDMA_ONLY_OPTIONS = ("device_name", "ib_port", "gid_index", "self_test")
"""Options only the rdma transport uses. Callers pass them to whichever transport they get
(a service's ``disagg_config`` names them; ``auto`` falls back to tcp with the same options), so the
tcp transport accepts and ignores them."""


def transport_options(factory: Callable[..., Any]) -> tuple[str, ...]:
    """The options a transport's ``connect`` takes: its keyword-only parameters with defaults
    (``layout``, ``ring`` and ``token`` have none: they are required, not options)."""
    return tuple(
        p.name
        for p in inspect.signature(factory).parameters.values()
        if p.kind is p.KEYWORD_ONLY and p.default is not p.empty
    )


def refuse_unknown_options(
    transport: str,
    given: Iterable[str],
    accepted: Sequence[str],
    ignored: Sequence[str] = (),
) -> None:
    """Raise ConfigError naming each option in ``given`` that is neither ``accepted`` nor
    ``ignored`` (a misspelt option must not silently fall back to its default)."""
    unknown = [k for k in given if k not in accepted and k not in ignored]
    if not unknown:
        return
    also = f" (and {', '.join(ignored)}, which only rdma uses)" if ignored else ""
    raise ConfigError(
        f"unknown {transport} transport option{'s' if len(unknown) > 1 else ''} "
        f"{', '.join(map(repr, unknown))}: check the spelling; the {transport} transport "
        f"accepts {', '.join(accepted)}{also}"
    )
