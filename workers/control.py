"""The worker's end of the control channel (message layouts: :mod:`contracts.messages`).

One TCP connection per worker, authenticated like the ring ports. Calls are synchronous
request/reply and thread-safe (the pull loop and the heartbeat thread share it).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from contracts import faults
from contracts.errors import ConnectionLost, ControlRefused
from contracts.messages import CONTROL_RING, Op
from rings import wire
from rings.tcp import handshake, open_socket, recv_frame

log = logging.getLogger("diffring.worker.control")


class ControlClient:
    def __init__(self, host: str, port: int, token: str, *, timeout: float = 60.0) -> None:
        self.host = host
        self.port = port
        self.token = token
        self.timeout = timeout
        self._sock: Any = None
        self._lock = threading.Lock()
        self._seq = 0

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"

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
                extras={"worker_role": role},
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
        self._sock = sock

    def call(self, op: Op, **fields: Any) -> dict[str, Any]:
        with self._lock:
            if self._sock is None:
                raise ConnectionLost(f"control channel to {self.where} is closed")
            if faults.ON:
                try:
                    faults.hit("control.drop", ConnectionLost)
                except ConnectionLost as exc:
                    self._close_locked()  # a real drop: the controller sees the connection go
                    raise ConnectionLost(
                        f"control channel to the controller at {self.where} lost: {exc}"
                    ) from exc
            self._seq += 1
            msg = {"op": op.value, "seq": self._seq, **fields}
            try:
                self._sock.sendall(wire.pack_msg(msg))
                reply = wire.unpack_msg(recv_frame(self._sock))
            except (OSError, ConnectionLost, ValueError) as exc:
                self._close_locked()
                raise ConnectionLost(
                    f"control channel to the controller at {self.where} lost: {exc}"
                ) from exc
        if not reply.get("ok"):
            raise ControlRefused(f"controller refused {op.value}: {reply.get('error')}")
        return reply

    def _close_locked(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def close(self) -> None:
        with self._lock:
            self._close_locked()
