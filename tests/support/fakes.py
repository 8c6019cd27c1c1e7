"""In-process fakes of the two seams unit tests cross, each behind the product's Protocol:

- :class:`FakeControl`, a worker's control channel (``workers.control.ControlChannel``):
  it records every call and answers as a controller that grants everything would;
- :class:`FakeTransport`, a transfer engine (``tensorplane.transport.Transport``): it copies
  bytes between memory registered in this process, so a producer's pool and a consumer's
  pool (real :class:`~tensorplane.pool.StagingPool` objects) hand tensors over in one
  process, without Mooncake's servers.

They live with the tests, not in the product: no service runs on them, and a fake in the
shipped packages is one a config could select by mistake. mypy checks them against the
Protocols (``tests/support`` is in its ``files``).
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import msgspec

from contracts import messages
from contracts.errors import ConnectionLost, ControlRefused
from contracts.messages import OP, ControlMessage, Op, Reply
from tensorplane.errors import EngineError, TransferFailed

if TYPE_CHECKING:
    from tensorplane.transport import Transport
    from workers.control import ControlChannel

R = TypeVar("R", bound=Reply)

Answer = Mapping[str, Any] | Callable[[dict[str, Any]], Mapping[str, Any]]
"""What a :class:`FakeControl` answers to an op: fields (over the default answer), or a
function of the call's fields that returns them."""

REPLIES: dict[Op, dict[str, Any]] = {
    Op.PREFLIGHT: {"checked": []},
    Op.REGISTER: {"worker_id": 1, "heartbeat_interval_s": 1.0, "lease_timeout_s": 15.0,
                  "checkpoints": False},
    Op.HEARTBEAT: {"cancel": [], "drop_staged": [], "yield": []},
    Op.CLAIM: {"proceed": True, "reason": "ok", "defer": False},
    Op.PROGRESS: {"cancel": False, "yield": False},
    Op.COMPLETE: {"accepted": True},
    Op.CHECKPOINT: {"accepted": True},
}
"""The controller's answer to each op (``controller/control.py``) when it grants everything:
claims proceed, results and checkpoints are accepted, nothing is cancelled, dropped or asked
to yield. The other ops answer only ``ok``."""


class FakeControl:
    """A worker's control channel in this process: every call is recorded (in order, from
    any thread) and answered from :data:`REPLIES`, changed per op by :attr:`answers`; an
    answer with ``ok`` false is refused with :class:`ControlRefused`, as the real channel
    refuses it. It starts connected (a channel already open); after :meth:`close`, calls
    raise :class:`ConnectionLost` until :meth:`connect`."""

    where = "fake-controller:0"

    def __init__(self, answers: Mapping[Op, Answer] | None = None) -> None:
        self.calls: list[tuple[Op, dict[str, Any]]] = []
        self.answers: dict[Op, Answer] = dict(answers or {})
        self.role: str | None = None
        self._connected = True
        self._lock = threading.Lock()

    @property
    def connected(self) -> bool:
        return self._connected

    def connect(self, role: str) -> None:
        self.role = role
        self._connected = True

    def call(self, msg: ControlMessage, reply: type[R]) -> R:
        op = OP[type(msg)]
        fields = msgspec.structs.asdict(msg)  # every field, defaults too
        with self._lock:
            if not self._connected:
                raise ConnectionLost(f"control channel to {self.where} is closed")
            self.calls.append((op, fields))
        answer = self.answers.get(op, {})
        got = {"ok": True, **REPLIES.get(op, {}),
               **(answer(fields) if callable(answer) else answer)}
        if not got["ok"]:
            raise ControlRefused(f"controller refused {op.value}: {got.get('error')}")
        return messages.decode_reply(got, reply)

    def close(self) -> None:
        self._connected = False

    def ops(self) -> list[Op]:
        """The ops called so far, in order."""
        with self._lock:
            return [op for op, _ in self.calls]

    def sent(self, op: Op) -> list[dict[str, Any]]:
        """The fields of every call of ``op`` so far, in order."""
        with self._lock:
            return [fields for o, fields in self.calls if o == op]


class FakeTransport:
    """A transfer engine whose peers are the other :class:`FakeTransport` objects of this
    process: :meth:`read` and :meth:`write` copy bytes (``ctypes.memmove``) between regions
    registered here and regions registered by the peer named by its session, after the
    checks Mooncake makes (both ranges inside registered memory, a live peer, a positive
    size); a copy that fails them raises :class:`TransferFailed` naming the task, tensor and
    peer, as Mooncake's does. A transport closed (:meth:`close`) is a dead peer. Copies are
    synchronous: nothing is ever left ``pending``."""

    _peers: ClassVar[dict[str, FakeTransport]] = {}
    _names: ClassVar[itertools.count[int]] = itertools.count(1)
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self) -> None:
        self._session = f"fake-segment-{next(self._names)}"
        self._regions: dict[int, int] = {}
        self.copies: list[tuple[str, str, int]] = []
        """Every copy made: (``read`` or ``write``, peer, bytes)."""
        with self._lock:
            self._peers[self._session] = self

    @property
    def session_id(self) -> str:
        return self._session

    def register(self, ptr: int, nbytes: int) -> None:
        if nbytes <= 0:
            raise EngineError(f"cannot register {nbytes} bytes at {ptr:#x}")
        with self._lock:
            if any(ptr < p + n and p < ptr + nbytes for p, n in self._regions.items()):
                raise EngineError(f"register({ptr:#x}, {nbytes}) overlaps a registered region")
            self._regions[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        with self._lock:
            if self._regions.pop(ptr, None) is None:
                raise EngineError(f"unregister({ptr:#x}): not a registered region")

    def read(self, peer_session: str, local_addr: int, remote_addr: int, nbytes: int, *,
             timeout_s: float | None = None, task_id: str | None = None,
             tensor: str | None = None) -> None:
        self._copy("read", peer_session, local_addr, remote_addr, nbytes, task_id, tensor)

    def write(self, peer_session: str, local_addr: int, remote_addr: int, nbytes: int, *,
              timeout_s: float | None = None, task_id: str | None = None,
              tensor: str | None = None) -> None:
        self._copy("write", peer_session, local_addr, remote_addr, nbytes, task_id, tensor)

    def close(self) -> None:
        """Gone, as a process that exited: its memory is no longer registered, and peers'
        copies from or to it fail."""
        with self._lock:
            self._peers.pop(self._session, None)
            self._regions.clear()

    def _copy(self, op: str, peer_session: str, local: int, remote: int, nbytes: int,
              task_id: str | None, tensor: str | None) -> None:
        def fail(message: str, rc: int | None = None) -> TransferFailed:
            return TransferFailed(f"fake {op} of {nbytes} bytes {message}", nbytes=nbytes,
                                  rc=rc, task_id=task_id, tensor=tensor, peer=peer_session)

        if nbytes <= 0:
            raise fail("refused: size must be positive")
        with self._lock:
            peer = self._peers.get(peer_session)
            if peer is None or self._session not in self._peers:
                raise fail("returned -1 (peer dead or unknown)", rc=-1)
            if not _inside(self._regions, local, nbytes):
                raise fail(f"returned -1 (local {local:#x} outside registered memory)", rc=-1)
            if not _inside(peer._regions, remote, nbytes):
                raise fail(f"returned -1 (remote {remote:#x} outside the peer's registered "
                           "memory)", rc=-1)
            src, dst = (remote, local) if op == "read" else (local, remote)
            ctypes.memmove(dst, src, nbytes)
            self.copies.append((op, peer_session, nbytes))


def _inside(regions: Mapping[int, int], addr: int, nbytes: int) -> bool:
    return any(p <= addr and addr + nbytes <= p + n for p, n in regions.items())


if TYPE_CHECKING:  # mypy holds each fake to its Protocol
    _control: ControlChannel = FakeControl()
    _transport: Transport = FakeTransport()
