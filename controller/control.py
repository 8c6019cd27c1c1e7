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
import logging
import secrets
import socket
import struct
from typing import Any

from contracts.errors import ResultWriteBlocked
from contracts.messages import CONTROL_RING, DOORBELL_CHANNEL, Op
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
                msg = wire.unpack_msg(await self._read(reader, MAX_CONTROL_FRAME))
                seq = msg.get("seq")
                try:
                    # The two ops that await (connections, a file write) are not in _dispatch.
                    if msg.get("op") == Op.PREFLIGHT:
                        reply = await connect_back(msg, f"{self.host}:{self.port}")
                    elif msg.get("op") == Op.COMPLETE and worker is not None:
                        reply = await self._complete(msg, worker)
                    elif msg.get("op") == Op.CHECKPOINT and worker is not None:
                        job = asyncio.ensure_future(self._checkpoint(msg, worker, writer))
                        checkpoints.add(job)
                        job.add_done_callback(checkpoints.discard)
                        continue
                    else:
                        reply, worker = self._dispatch(msg, worker)
                    out = {"seq": seq, "ok": True, **reply}
                except (ControlError, KeyError, TypeError, ValueError) as exc:
                    out = {"seq": seq, "ok": False, "error": str(exc) or repr(exc)}
                writer.write(wire.pack_msg(out))
                await writer.drain()
                if msg.get("op") in (Op.BYE, Op.FATAL):
                    reason = (
                        "deregistered"
                        if msg.get("op") == Op.BYE
                        else f"reported a fatal error: {msg.get('error')}"
                    )
                    if worker is None and msg.get("op") == Op.FATAL:
                        log.warning("control: a %s worker (%s) failed before registering: %s",
                                    join.get("worker_role"), join.get("peer_name"),
                                    msg.get("error"))
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
                if msg.get("op") != Op.WAIT:
                    raise ControlError(f"the doorbell channel carries only 'wait', got "
                                       f"{msg.get('op')!r}")
                if self.doorbell is None:
                    raise ControlError("this controller has no doorbell")
                waiting = asyncio.ensure_future(
                    self.doorbell.wait(str(msg["ring"]), float(msg["timeout_s"]), wake,
                                       _ticket(msg.get("ticket")))
                )
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
                out = None if rung else {"seq": seq, "ok": True, "wake": waiting.result()}
            except (ControlError, KeyError, TypeError, ValueError) as exc:
                out = {"seq": seq, "ok": False, "error": str(exc) or repr(exc)}
            if out is not None:
                writer.write(wire.pack_msg(out))
            await writer.drain()

    async def _checkpoint(self, msg: dict[str, Any], worker: WorkerInfo,
                          writer: asyncio.StreamWriter) -> None:
        """Keep a checkpoint (its pull in the worker's lane) and answer it, while the
        connection's handler goes on reading."""
        seq = msg.get("seq")
        try:
            reply = await self.coordinator.on_checkpoint(worker, msg)
            out = {"seq": seq, "ok": True, **reply}
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

    async def _complete(self, msg: dict[str, Any], worker: WorkerInfo) -> dict[str, Any]:
        try:
            accepted = await self.coordinator.on_complete(
                worker,
                str(msg["task_id"]),
                int(msg["attempt"]),
                str(msg["extension"]),
                str(msg["media_type"]),
                bytes(msg["data"]),
            )
        except ResultWriteBlocked as exc:  # the decoder holds the result and retries
            return {"accepted": False, "storage_error": str(exc)}
        return {"accepted": accepted}

    def _dispatch(
        self, msg: dict[str, Any], worker: WorkerInfo | None
    ) -> tuple[dict[str, Any], WorkerInfo | None]:
        co = self.coordinator
        op = msg.get("op")
        if op == Op.DESCRIBE:
            return {"pipeline": co.config.pipeline}, worker
        if op == Op.REGISTER:
            if worker is not None:
                raise ControlError("already registered on this connection")
            worker = co.on_register(
                str(msg["role"]),
                str(msg["name"]),
                int(msg["pid"]),
                str(msg["pipeline"]),
                str(msg.get("segment", "")),
                loras=_names(msg.get("loras")),
                caches=_names(msg.get("caches")),
                fused=_fused(msg.get("fused")),
                recipe=_opt_str(msg.get("recipe")),
                checkpoints=msg.get("checkpoints") is True,
            )
            return {
                "worker_id": worker.worker_id,
                "heartbeat_interval_s": co.config.heartbeat_interval_s,
                "lease_timeout_s": co.config.lease_timeout_s,
                "checkpoints": co.checkpoints is not None,
            }, worker
        if op in (Op.FATAL, Op.BYE):
            return {}, worker  # _serve ends the connection (a worker failing at start too)
        if worker is None:
            raise ControlError(f"{op!r} before register")
        if op == Op.HEARTBEAT:
            if "storage" in msg:  # a decoder: the results it holds, or None
                co.result_writes.report(worker.name, msg["storage"])
            staged = [(str(t), int(a)) for t, a in msg.get("staged", [])]
            worker.stats = _stats(msg.get("stats"))
            tasks = [str(t) for t in msg.get("tasks", [])]
            cancel, unwanted = co.on_heartbeat(worker, tasks, staged)
            return {"cancel": cancel, "drop_staged": [[t, a] for t, a in unwanted],
                    # For workers of an older build, which read only task ids (and free
                    # every attempt of each, the current one too).
                    "drop": sorted({t for t, _a in unwanted}),
                    "yield": co.priorities.asked(tasks)}, worker
        if op == Op.CLAIM:
            ok, why = co.on_claim(worker, str(msg["task_id"]), int(msg["attempt"]))
            return {"proceed": ok, "reason": why,
                    "defer": not ok and why.startswith(DEFERRED)}, worker
        if op == Op.PROGRESS:
            stop = co.on_progress(
                worker,
                str(msg["task_id"]),
                int(msg["attempt"]),
                int(msg["step"]),
                int(msg["steps"]),
            )
            return {"cancel": stop,
                    "yield": bool(co.priorities.asked([str(msg["task_id"])]))}, worker
        if op == Op.HANDOFF:
            co.on_handoff(worker, str(msg["task_id"]), int(msg["attempt"]))
            return {}, worker
        if op == Op.FAIL:
            co.on_fail(
                worker,
                str(msg["task_id"]),
                int(msg["attempt"]),
                str(msg["error"]),
                str(msg.get("error_type", "error")),
                bool(msg.get("retryable", False)),
                _opt_str(msg.get("fault")),
            )
            return {}, worker
        if op == Op.RESUME:
            return co.on_resume(worker, str(msg["task_id"]), int(msg["attempt"])), worker
        if op == Op.DROPPED:
            attempt = msg.get("attempt")
            co.on_dropped(
                worker,
                str(msg["ring"]),
                str(msg.get("reason", "")),
                _opt_str(msg.get("task_id")),
                attempt if isinstance(attempt, int) and not isinstance(attempt, bool) else None,
            )
            return {}, worker
        raise ControlError(f"unknown control op {op!r}")


def _names(value: Any) -> tuple[str, ...]:
    """A register message's list of names (adapters, cache kinds); absent: none."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"expected a list of names, got {value!r}")
    return tuple(value)


def _fused(value: Any) -> tuple[tuple[str, float], ...]:
    """A register message's fused adapters (``[{name, strength}]``); absent: none."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(
            isinstance(v, dict) and isinstance(v.get("name"), str)
            and isinstance(v.get("strength"), int | float) for v in value):
        raise ValueError(f"expected a list of {{name, strength}}, got {value!r}")
    return tuple((str(v["name"]), float(v["strength"])) for v in value)


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


def _ticket(value: Any) -> int | None:
    """A wait's ``ticket``: a ring position, or None (absent: the worker holds none)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"ticket must be a ring position (int >= 0), got {value!r}")
    return value


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
