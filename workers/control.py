"""The worker's end of the control channel (message layouts: :mod:`contracts.messages`).

One TCP connection per worker, authenticated like the ring ports. Calls are request/reply and
thread-safe: the pull loop, the heartbeat, progress and checkpoint threads share the
connection, and several calls may be in flight at once. Each answer names the ``seq`` of its
request, and a reader thread hands it to the call waiting for it, so a call the controller
answers late -- a ``checkpoint``, answered once the controller has pulled its tensors --
holds up no heartbeat or progress report meanwhile. (A controller of an older build answers
in order, one at a time: the calls then simply queue at its end.) A second connection, the
doorbell (:class:`DoorbellClient`), is where the idle pull loop waits for work without
polling its ring.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Protocol, TypeVar

from contracts import faults, messages
from contracts.errors import ConnectionLost, ControlRefused
from contracts.messages import (
    CONTROL_RING,
    CONTROL_VERSION,
    DOORBELL_CHANNEL,
    OP,
    ControlMessage,
    Reply,
    Wait,
    WaitReply,
)
from rings import wire
from rings.handshake import handshake, open_socket, recv_frame

log = logging.getLogger("diffring.worker.control")

R = TypeVar("R", bound=Reply)

REPLY_SLACK_S = 2.0
"""How long past its timeout a doorbell wait may stay unanswered before the worker polls its
ring anyway (and keeps waiting for the answer)."""


class ControlChannel(Protocol):
    """What a worker needs of its control channel: request / reply calls to the controller
    (``call`` raises :class:`ConnectionLost` when the channel is gone and
    :class:`ControlRefused` when the controller says no), opened for a role and closed.
    :class:`ControlClient` is the one over TCP; the unit tests have an in-process one
    (``tests/support/fakes.py``)."""

    @property
    def where(self) -> str:
        """The controller's address, for messages."""
        ...

    @property
    def connected(self) -> bool:
        """Open, as far as this end knows (a call finds out otherwise)."""
        ...

    def connect(self, role: str) -> None: ...

    def call(self, msg: ControlMessage, reply: type[R]) -> R:
        """Send ``msg`` (:mod:`contracts.messages`) and return the controller's answer, of
        the type ``reply``."""
        ...

    def close(self) -> None: ...


class _Connection:
    """One control connection: its socket and the calls waiting for an answer on it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.waiting: dict[int, Future[dict[str, Any]]] = {}
        self.lost: BaseException | None = None


class ControlClient:
    """The control channel over TCP (:class:`ControlChannel`). ``timeout``: how long a call
    waits for its answer (and a send or a started frame may take) before the connection is
    given up as lost."""

    def __init__(self, host: str, port: int, token: str, *, timeout: float = 60.0) -> None:
        self.host = host
        self.port = port
        self.token = token
        self.timeout = timeout
        self._conn: _Connection | None = None
        self._send = threading.Lock()  # one request on the wire at a time, whole
        self._lock = threading.Lock()  # the connection in use and the calls waiting on it
        self._seq = 0

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def connected(self) -> bool:
        """Connected, as far as this end knows (a call finds out otherwise)."""
        return self._conn is not None

    def connect(self, role: str) -> None:
        sock = open_socket(self.host, self.port, self.timeout)
        try:
            handshake(
                sock,
                ring=CONTROL_RING,
                layout=None,
                token=self.token,
                transport="control",
                role="peer",
                extras={"worker_role": role, "control_version": CONTROL_VERSION},
            )
        except OSError as exc:  # reset mid-handshake: a controller dying or starting
            sock.close()
            raise ConnectionLost(
                f"control channel to {self.where} lost during the handshake: {exc}"
            ) from exc
        except BaseException:
            sock.close()
            raise
        sock.settimeout(self.timeout)
        conn = _Connection(sock)
        with self._lock:
            self._conn = conn
        threading.Thread(target=self._read, args=(conn,), name="control-answers",
                         daemon=True).start()

    def call(self, msg: ControlMessage, reply: type[R]) -> R:
        op = OP[type(msg)]
        answer: Future[dict[str, Any]] = Future()
        with self._send:
            conn = self._conn
            if conn is None:
                raise ConnectionLost(f"control channel to {self.where} is closed")
            if faults.ON:
                try:
                    faults.hit("control.drop", ConnectionLost)
                except ConnectionLost as exc:
                    self._drop(conn, exc)  # a real drop: the controller sees the connection go
                    raise self._lost(exc) from exc
            self._seq += 1
            seq = self._seq
            with self._lock:
                if conn.lost is not None:  # its reader found it gone just now
                    raise self._lost(conn.lost)
                conn.waiting[seq] = answer
            try:
                conn.sock.sendall(wire.pack_msg({**messages.encode(msg), "seq": seq}))
            except OSError as exc:
                self._drop(conn, exc)
        try:
            got = answer.result(self.timeout)
        except FutureTimeout:
            self._drop(conn, TimeoutError(f"no answer to {op.value} within {self.timeout:g} s"))
            got = answer.result(self.timeout)  # failed by the drop, or answered just now
        if not got.get("ok"):
            raise ControlRefused(f"controller refused {op.value}: {got.get('error')}")
        return messages.decode_reply(got, reply)

    def _lost(self, why: BaseException) -> ConnectionLost:
        return ConnectionLost(f"control channel to the controller at {self.where} lost: {why}")

    def _read(self, conn: _Connection) -> None:
        """The connection's reader thread: each answer to the call waiting for its seq."""
        ready = select.poll()
        ready.register(conn.sock, select.POLLIN)
        try:
            while True:
                # Wait as long as it takes for the next answer (each call has its own
                # timeout); a frame once begun must arrive within the socket's timeout.
                ready.poll()
                reply = wire.unpack_msg(recv_frame(conn.sock))
                with self._lock:
                    answer = conn.waiting.pop(reply.get("seq"), None)  # type: ignore[arg-type]
                if answer is None:  # (a call gives up only with its connection)
                    log.warning("control: an answer to no call (seq %r) ignored",
                                reply.get("seq"))
                else:
                    answer.set_result(reply)
        except (OSError, ConnectionLost, ValueError, TypeError) as exc:
            self._drop(conn, exc)
        finally:
            conn.sock.close()

    def _drop(self, conn: _Connection, why: BaseException) -> None:
        """Give ``conn`` up: every call waiting on it fails with ConnectionLost. Its socket
        is shut down, not closed: its reader thread closes it, once out of its read."""
        with self._lock:
            if conn.lost is None:
                conn.lost = why
            if self._conn is conn:
                self._conn = None
            waiting = list(conn.waiting.values())
            conn.waiting.clear()
        with contextlib.suppress(OSError):
            conn.sock.shutdown(socket.SHUT_RDWR)
        for answer in waiting:
            answer.set_exception(self._lost(conn.lost))

    def close(self) -> None:
        conn = self._conn
        if conn is not None:
            self._drop(conn, ConnectionLost("closed by this worker"))


class DoorbellClient:
    """The worker's doorbell: a second connection to the control port on which the idle
    loop long-polls (``wait``) until its input ring has work (see
    :mod:`controller.doorbell`). Used by the pull loop's thread only; :meth:`interrupt` may
    be called from any thread (or a signal handler) to end a wait at once."""

    def __init__(self, host: str, port: int, token: str, *, timeout: float = 60.0) -> None:
        self.host = host
        self.port = port
        self.token = token
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._seq = 0
        self._owed = False  # a wait was sent and its answer has not arrived yet
        # Self-pipe: a signal handler cannot set a threading.Event safely mid-select, but it
        # can write a byte that select() sees.
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)

    def connect(self, role: str) -> None:
        sock = open_socket(self.host, self.port, self.timeout)
        try:
            handshake(sock, ring=CONTROL_RING, layout=None, token=self.token,
                      transport="control", role="peer",
                      extras={"worker_role": role, "channel": DOORBELL_CHANNEL,
                              "control_version": CONTROL_VERSION})
        except BaseException:
            sock.close()
            raise
        self._sock = sock

    def wait(self, ring: str, timeout_s: float, ticket: int | None = None) -> bool | None:
        """Block until the controller says ``ring`` has work (True), ``timeout_s`` passes
        (False), or :meth:`interrupt` (None: the connection is closed; the worker is
        stopping). ``ticket``: the pop ticket this worker holds on ``ring`` (the controller
        wakes the holder of a published position first).

        The controller answers every wait by ``timeout_s``; one that has not answered
        ``REPLY_SLACK_S`` later is busy, not gone (its connections tell that): this returns
        False, so the worker polls its ring once, and the next call goes on waiting for the
        answer still owed instead of asking again. At most one wait is outstanding."""
        sock = self._sock
        if sock is None:
            raise ConnectionLost(f"doorbell to {self.host}:{self.port} is closed")
        try:
            if not self._owed:
                self._seq += 1
                sock.settimeout(self.timeout)
                sock.sendall(wire.pack_msg({
                    **messages.encode(Wait(ring=ring, timeout_s=timeout_s, ticket=ticket)),
                    "seq": self._seq}))
                self._owed = True
            ready, _, _ = select.select([sock, self._wake_r], [], [],
                                        timeout_s + REPLY_SLACK_S)
            if self._wake_r in ready:
                self._drain_wake()
                self.close()  # a reply is still owed on this connection: drop it
                return None
            if sock not in ready:
                return False
            reply = wire.unpack_msg(recv_frame(sock))
            self._owed = False
        except (OSError, ConnectionLost, ValueError) as exc:
            self.close()
            raise ConnectionLost(f"doorbell to the controller at {self.host}:{self.port} "
                                 f"lost: {exc}") from exc
        if not reply.get("ok"):
            raise ControlRefused(f"controller refused wait: {reply.get('error')}")
        return messages.decode_reply(reply, WaitReply).wake

    def interrupt(self) -> None:
        """End a wait in progress (or the next one) at once. Safe from a signal handler."""
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass  # the pipe is full: a wake-up is already pending

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(64):
                pass
        except OSError:
            pass

    def close(self) -> None:
        self._owed = False
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None
