"""The control channel server: workers register, heartbeat, claim, report progress and
results (message layouts: :mod:`contracts.messages`).

Same framing and the same token handshake as the ring ports (:mod:`rings.wire`). A worker's
connection is its liveness: when it drops, every lease the worker holds is revoked at once
and its tasks are put back in play.

Messages of one connection are handled in order, one at a time, each answered before the
next is read -- except ``checkpoint``, whose tensors the controller pulls from the worker
(:mod:`controller.tasks.checkpoints`): that one runs as a task of its own and is answered when it
is done, the answer naming its ``seq`` as every answer does. So the connection's handler
never waits on tensor I/O: the worker's heartbeats and progress are answered meanwhile, and
a dropped connection is seen, and acted on, the moment it drops.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import secrets
import socket
import struct
from collections.abc import Callable
from typing import Any

import msgspec

from contracts import messages
from contracts.errors import ResultWriteBlocked
from contracts.messages import (
    CONTROL_RING,
    CONTROL_VERSION,
    DOORBELL_CHANNEL,
    OP,
    BadMessage,
    Bye,
    Checkpoint,
    Claim,
    ClaimReply,
    Complete,
    CompleteReply,
    ControlMessage,
    Describe,
    DescribeReply,
    Dropped,
    Empty,
    Fail,
    Fatal,
    Handoff,
    Heartbeat,
    HeartbeatReply,
    Preflight,
    Progress,
    ProgressReply,
    Register,
    RegisterReply,
    Reply,
    Resume,
    ResumeReply,
    Take,
    TakeReply,
    Wait,
    WaitReply,
)
from contracts.roles import Role
from controller.doorbell import Doorbell
from controller.errors import ControlError
from controller.ownership.coordinator import Coordinator
from controller.ownership.priorities import DEFERRED
from controller.ownership.registry import WorkerInfo
from controller.preflight import connect_back
from rings import wire
from rings.ports import bind_error

log = logging.getLogger("diffring.controller.control")

MAX_CONTROL_FRAME = 512 << 20  # results travel on this channel (a long MP4 can be large)


class ControlServer:
    def __init__(
        self, coordinator: Coordinator, host: str, port: int, token: str,
        doorbell: Doorbell | None = None,
    ) -> None:
        self.coordinator = coordinator
        self.doorbell = doorbell
        self.host = host
        self.port = port
        self.token = token
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._next_conn = 1
        self._handlers: dict[type, Callable[[Any, WorkerInfo], Any]] = {
            Heartbeat: self._heartbeat,
            Claim: self._claim,
            Progress: self._progress,
            Handoff: self._handoff,
            Complete: self._complete,
            Fail: self._fail,
            Resume: self._resume,
            Take: self._take,
            Dropped: self._dropped,
        }
        """The handler of each message a registered worker sends (``checkpoint`` runs as a
        task of its own: :meth:`_serve`); each returns the reply, or a coroutine of it."""

    async def start(self, sock: socket.socket | None = None) -> None:
        """Serve on ``sock`` (the port already bound: :func:`rings.ports.bind_socket`), or
        bind host:port now."""
        if sock is not None:
            self._server = await asyncio.start_server(self._serve, sock=sock)
            self.port = sock.getsockname()[1]
        else:
            try:
                self._server = await asyncio.start_server(self._serve, self.host, self.port)
            except OSError as exc:
                raise bind_error("control channel", self.host, self.port, exc) from exc
        if self.port == 0:
            self.port = self._server.sockets[0].getsockname()[1]
        log.info("control channel on %s:%d", self.host, self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._conns):
            t.cancel()
        for t in list(self._conns):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._server is not None:
            await self._server.wait_closed()

    async def _read(self, reader: asyncio.StreamReader, limit: int, first: bytes = b"") -> bytes:
        """One frame; ``first``: bytes of its length prefix already read."""
        (n,) = wire.LEN.unpack(first + await reader.readexactly(4 - len(first)))
        if n > limit:
            raise ValueError(f"frame of {n} bytes exceeds the limit of {limit}")
        return await reader.readexactly(n)

    async def _handshake(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> dict[str, Any] | None:
        nonce = secrets.token_bytes(32)
        writer.write(
            wire.pack_msg({"proto": wire.PROTO, "version": wire.PROTO_VERSION, "nonce": nonce})
        )
        join = wire.unpack_msg(await self._read(reader, wire.MAX_HANDSHAKE_FRAME))
        cnonce = join.get("client_nonce")
        ring = join.get("ring")
        mac = join.get("mac")
        error = None
        if not isinstance(cnonce, bytes) or ring != CONTROL_RING:
            error = f"this port is the control channel, peer asked for {str(ring)[:64]!r}"
        elif not isinstance(mac, bytes) or not wire.hmac.compare_digest(
            mac, wire.mac(self.token, b"join", nonce, cnonce, ring.encode())
        ):
            error = (
                "authentication failed: the worker did not prove the cluster token "
                "(check that every service is configured with the same token)"
            )
        elif join.get("control_version") != CONTROL_VERSION:
            error = (
                f"this worker speaks control version {join.get('control_version')!r}, the "
                f"controller {CONTROL_VERSION}: run the same build of diffring on both"
            )
        if error is not None:
            writer.write(wire.pack_msg({"ok": False, "error": error}))
            await writer.drain()
            log.warning("control: refused %s: %s", writer.get_extra_info("peername"), error)
            return None
        assert isinstance(cnonce, bytes) and isinstance(ring, str)
        conn_id = self._next_conn
        self._next_conn += 1
        writer.write(
            wire.pack_msg(
                {
                    "ok": True,
                    "peer_id": conn_id,
                    "layout": None,
                    "mac": wire.mac(self.token, b"welcome", cnonce, nonce, ring.encode()),
                }
            )
        )
        await writer.drain()
        return join

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        worker: WorkerInfo | None = None
        reason = "control connection dropped"
        checkpoints: set[asyncio.Task[None]] = set()  # answered when done (module doc)
        try:
            join = await asyncio.wait_for(self._handshake(reader, writer), wire.HANDSHAKE_TIMEOUT_S)
            if join is None:
                return
            if join.get("channel") == DOORBELL_CHANNEL:
                await self._serve_doorbell(reader, writer)
                return
            while True:
                raw = wire.unpack_msg(await self._read(reader, MAX_CONTROL_FRAME))
                seq = raw.get("seq")
                msg: ControlMessage | None = None
                try:
                    msg = messages.decode(raw)
                    if isinstance(msg, Checkpoint) and worker is not None:
                        job = asyncio.ensure_future(self._checkpoint(msg, seq, worker, writer))
                        checkpoints.add(job)
                        job.add_done_callback(checkpoints.discard)
                        continue
                    reply, worker = await self._handle(msg, worker)
                    out = {"seq": seq, "ok": True, **messages.encode(reply)}
                except (BadMessage, ControlError, KeyError, TypeError, ValueError) as exc:
                    out = {"seq": seq, "ok": False, "error": str(exc) or repr(exc)}
                writer.write(wire.pack_msg(out))
                await writer.drain()
                if isinstance(msg, Bye | Fatal):
                    reason = (
                        "deregistered"
                        if isinstance(msg, Bye)
                        else f"reported a fatal error: {msg.error}"
                    )
                    if worker is None and isinstance(msg, Fatal):
                        log.warning("control: a %s worker (%s) failed before registering: %s",
                                    join.get("worker_role"), join.get("peer_name"), msg.error)
                    return
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass
        except (ValueError, struct.error) as exc:
            log.warning("control: dropping a peer after a malformed message: %s", exc)
        except asyncio.CancelledError:
            reason = "controller shutting down"
        except Exception as exc:
            # Whatever a peer sends must not escape as an unhandled error; msgpack alone
            # raises TypeError (unhashable keys) besides ValueError. A registered worker's
            # failure may be ours, so it keeps its traceback.
            if worker is None:
                log.warning("control: dropping %s after a malformed message: %s: %s",
                            writer.get_extra_info("peername"), type(exc).__name__, exc)
            else:
                log.exception("control: dropping worker %s", worker.name)
                reason = f"control connection failed: {type(exc).__name__}: {exc}"
        finally:
            self._conns.discard(task)
            if worker is not None:
                self.coordinator.on_gone(worker, reason)  # its lane drops what it has left
            for job in list(checkpoints):
                job.cancel()
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve_doorbell(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """A worker's doorbell connection: one ``wait`` at a time, each answered when its ring
        has work or its timeout passes (:mod:`controller.doorbell`)."""
        ahead = b""  # the first byte of the worker's next wait, when it came with the answer
        while True:
            msg = wire.unpack_msg(await self._read(reader, wire.MAX_HANDSHAKE_FRAME, ahead))
            ahead = b""
            seq = msg.get("seq")
            out: dict[str, Any] | None
            rung = False

            def wake(seq: Any = seq) -> None:
                # Sent from inside Doorbell.ring: the wake-up leaves before the code that
                # rang it (an HTTP response, a handoff reply) has finished.
                nonlocal rung
                rung = True
                writer.write(wire.pack_msg({"seq": seq, "ok": True, "wake": True}))

            try:
                wait = messages.decode(msg)
                if not isinstance(wait, Wait):
                    raise ControlError(f"the doorbell channel carries only 'wait', got "
                                       f"{msg.get('op')!r}")
                if self.doorbell is None:
                    raise ControlError("this controller has no doorbell")
                if wait.ticket is not None and wait.ticket < 0:
                    raise ValueError(f"ticket must be a ring position (>= 0), got {wait.ticket}")
                waiting = asyncio.ensure_future(
                    self.doorbell.wait(wait.ring, wait.timeout_s, wake, wait.ticket))
                # The worker sends nothing while it waits: anything read now is the
                # connection ending (a stopped worker), and its waiter must go at once,
                # or a wake-up would be spent on it.
                gone = asyncio.ensure_future(reader.read(1))
                await asyncio.wait({waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not waiting.done():
                    waiting.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await waiting
                    return
                gone.cancel()  # and wait for it: only one reader of the stream at a time
                with contextlib.suppress(asyncio.CancelledError):
                    await gone
                if gone.done() and not gone.cancelled():
                    ahead = gone.result()
                    if not ahead:
                        return  # the connection ended in the same instant
                    # Else the worker's next wait: sent as soon as it read a wake-up that this
                    # loop had not yet resumed from (a busy controller); it is kept, not
                    # taken for the connection's end (that dropped the worker's doorbell).
                out = None if rung else {
                    "seq": seq, "ok": True, **messages.encode(WaitReply(wake=waiting.result()))}
            except (BadMessage, ControlError, KeyError, TypeError, ValueError) as exc:
                out = {"seq": seq, "ok": False, "error": str(exc) or repr(exc)}
            if out is not None:
                writer.write(wire.pack_msg(out))
            await writer.drain()

    async def _checkpoint(self, msg: Checkpoint, seq: Any, worker: WorkerInfo,
                          writer: asyncio.StreamWriter) -> None:
        """Keep a checkpoint (its pull in the worker's lane) and answer it, while the
        connection's handler goes on reading."""
        try:
            reply = await self.coordinator.on_checkpoint(worker, msg)
            out = {"seq": seq, "ok": True, **messages.encode(reply)}
        except (ControlError, KeyError, TypeError, ValueError) as exc:
            out = {"seq": seq, "ok": False, "error": str(exc) or repr(exc)}
        except Exception as exc:  # ours, not the peer's: answered, with its traceback here
            log.exception("control: checkpoint of worker %s failed", worker.name)
            out = {"seq": seq, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
        if writer.is_closing():
            return
        writer.write(wire.pack_msg(out))
        with contextlib.suppress(ConnectionError):
            await writer.drain()

    # -- one message: before register, then by a table from message type to handler -------
    async def _handle(self, msg: ControlMessage, worker: WorkerInfo | None
                      ) -> tuple[Reply, WorkerInfo | None]:
        """The reply to ``msg`` from this connection's worker (None: not registered yet),
        and the connection's worker after it."""
        co = self.coordinator
        if isinstance(msg, Preflight):  # before register: the worker's endpoints, checked
            return await connect_back(msg, f"{self.host}:{self.port}"), worker
        if isinstance(msg, Describe):
            return DescribeReply(pipeline=co.config.pipeline), worker
        if isinstance(msg, Register):
            if worker is not None:
                raise ControlError("already registered on this connection")
            worker = co.on_register(
                msg.role, msg.name, msg.pid, msg.pipeline, msg.segment,
                loras=tuple(msg.loras), caches=tuple(msg.caches),
                fused=tuple((f.name, f.strength) for f in msg.fused), recipe=msg.recipe,
                checkpoints=msg.checkpoints, experts=msg.experts)
            return RegisterReply(worker_id=worker.worker_id,
                                 heartbeat_interval_s=co.config.heartbeat_interval_s,
                                 lease_timeout_s=co.config.lease_timeout_s,
                                 checkpoints=co.checkpoints is not None), worker
        if isinstance(msg, Fatal | Bye):
            return Empty(), worker  # _serve ends the connection (a worker failing at start too)
        if worker is None:
            raise ControlError(f"{OP[type(msg)].value!r} before register")
        handler = self._handlers.get(type(msg))
        if handler is None:
            raise ControlError(f"{OP[type(msg)].value!r} is not an op of this channel")
        reply = handler(msg, worker)
        return (await reply if inspect.isawaitable(reply) else reply), worker

    def _heartbeat(self, msg: Heartbeat, worker: WorkerInfo) -> HeartbeatReply:
        co = self.coordinator
        if worker.role == Role.DECODER:  # the results it holds, or None
            co.result_writes.report(
                worker.name, None if msg.storage is None else messages.encode(msg.storage))
        worker.stats = _stats(msg.stats)
        cancel, unwanted = co.on_heartbeat(worker, msg.tasks, msg.staged)
        return HeartbeatReply(cancel=cancel, drop_staged=unwanted,
                              yield_=co.priorities.asked(msg.tasks))

    def _claim(self, msg: Claim, worker: WorkerInfo) -> ClaimReply:
        ok, why = self.coordinator.on_claim(worker, msg.task_id, msg.attempt)
        return ClaimReply(proceed=ok, reason=why, defer=not ok and why.startswith(DEFERRED))

    def _progress(self, msg: Progress, worker: WorkerInfo) -> ProgressReply:
        co = self.coordinator
        stop = co.on_progress(worker, msg.task_id, msg.attempt, msg.step, msg.steps,
                              msg.expert)
        return ProgressReply(cancel=stop, yield_=bool(co.priorities.asked([msg.task_id])))

    def _handoff(self, msg: Handoff, worker: WorkerInfo) -> Empty:
        self.coordinator.on_handoff(worker, msg.task_id, msg.attempt)
        return Empty()

    async def _complete(self, msg: Complete, worker: WorkerInfo) -> CompleteReply:
        try:
            accepted = await self.coordinator.on_complete(
                worker, msg.task_id, msg.attempt, msg.extension, msg.media_type, msg.data)
        except ResultWriteBlocked as exc:  # the decoder holds the result and retries
            return CompleteReply(accepted=False, storage_error=str(exc))
        return CompleteReply(accepted=accepted)

    def _fail(self, msg: Fail, worker: WorkerInfo) -> Empty:
        self.coordinator.on_fail(worker, msg.task_id, msg.attempt, msg.error, msg.error_type,
                                 msg.retryable, msg.fault)
        return Empty()

    def _resume(self, msg: Resume, worker: WorkerInfo) -> ResumeReply:
        kept = self.coordinator.on_resume(worker, msg.task_id, msg.attempt)
        return msgspec.convert(kept, ResumeReply)

    def _take(self, msg: Take, worker: WorkerInfo) -> TakeReply:
        return TakeReply(item=self.coordinator.on_take(worker))

    def _dropped(self, msg: Dropped, worker: WorkerInfo) -> Empty:
        reason = msg.reason if msg.slot is None else f"{msg.reason} (slot {msg.slot})"
        self.coordinator.on_dropped(worker, msg.ring, reason, msg.task_id, msg.attempt)
        return Empty()


def _stats(value: Any) -> dict[str, float]:
    """A worker's reported figures (name -> number), at most 16 of them; anything else is
    ignored rather than trusted into the status page."""
    if not isinstance(value, dict):
        return {}
    out: dict[str, float] = {}
    for key, number in list(value.items())[:16]:
        if isinstance(key, str) and len(key) <= 64 and isinstance(number, int | float) \
                and not isinstance(number, bool):
            out[key] = float(number)
    return out
