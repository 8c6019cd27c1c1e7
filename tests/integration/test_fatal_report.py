"""A worker that fails reports it to the controller exactly once, at start and mid-run.

Real processes: a controller, a decoder that fails at start (its model load,
``worker.load:raise``: before it registered, with no control connection open) and a
transformer that fails in its pull loop once registered (``worker.loop:raise``). Each worker
reaches the control port through a frame-counting proxy of its own, which reads every frame
the worker sends even after the controller has closed its side: a second report is counted,
not lost in a closed socket. Every process started here is stopped here, by pid.
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from launcher import LocalGroup, group_config
from rings import wire
from tests.support.waits import wait_for
from workers.models.families.synthetic import write_config

pytestmark = pytest.mark.integration  # starts processes or servers


class FrameCounter:
    """A TCP proxy in front of the control port that records the op of every frame a worker
    sends. Each direction is passed on until its sender closes; an end closed by one side is
    half-closed on the other, so the worker may still send (and we still count) after the
    controller hung up."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.ops: list[str] = []
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._readers: list[threading.Thread] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return  # closed
            up = socket.create_connection(self.upstream, timeout=30)
            conn.settimeout(None)
            up.settimeout(None)
            reader = threading.Thread(target=self._from_worker, args=(conn, up), daemon=True)
            with self._lock:
                self._socks += [conn, up]
                self._readers.append(reader)
            reader.start()
            threading.Thread(target=self._to_worker, args=(up, conn), daemon=True).start()

    def _from_worker(self, conn: socket.socket, up: socket.socket) -> None:
        while True:
            head = _recv_exact(conn, 4)
            body = _recv_exact(conn, wire.LEN.unpack(head)[0]) if head else b""
            if not head or not body:
                break
            try:
                msg = wire.unpack_msg(body)
            except ValueError:
                msg = {}
            with self._lock:
                if "op" in msg:
                    self.ops.append(str(msg["op"]))
                    if msg["op"] == "fatal":
                        self.errors.append(str(msg.get("error")))
            try:
                up.sendall(head + body)
            except OSError:
                pass  # the controller hung up: keep reading what the worker still sends
        _shut(up)

    def _to_worker(self, up: socket.socket, conn: socket.socket) -> None:
        while True:
            try:
                data = up.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                break
            try:
                conn.sendall(data)
            except OSError:
                break
        _shut(conn)

    def count(self, op: str) -> int:
        with self._lock:
            return self.ops.count(op)

    def settle(self, timeout: float) -> None:
        """Wait until every worker connection has been closed by the worker (all it sent
        is counted)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            readers = list(self._readers)
        for reader in readers:
            reader.join(max(0.0, deadline - time.monotonic()))
            assert not reader.is_alive(), "a worker connection is still open"

    def close(self) -> None:
        self.server.close()
        with self._lock:
            for sock in self._socks:
                sock.close()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        try:
            chunk = sock.recv(n - len(buf))
        except OSError:
            return b""
        if not chunk:
            return b""
        buf += chunk
    return buf


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass


@pytest.mark.timeout(600)
def test_fatal_report_sent_once_at_start_and_mid_run(tmp_path: Path) -> None:
    model = tmp_path / "synthetic"
    write_config(model, encoder_s=0, step_s=0, decoder_s=0)
    cfg = group_config("synthetic", str(model), tmp_path, staging_pool_mb=4)
    control_port = cfg["disagg_config"]["control_port"]
    at_start, mid_run = FrameCounter(control_port), FrameCounter(control_port)
    try:
        with LocalGroup(cfg, tmp_path) as group:
            group.start("controller")
            group.wait_http()
            starting = group.start("decoder", {
                "faults": "worker.load:raise:once",
                "disagg_config": {"control_port": at_start.port}})
            running = group.start("transformer", {
                "faults": "worker.loop:raise:once",  # registered, first turn of the loop
                "disagg_config": {"control_port": mid_run.port}})
            for svc in (starting, running):
                try:
                    code = svc.proc.wait(300)
                except subprocess.TimeoutExpired:
                    raise AssertionError(
                        f"{svc.role} never failed:\n{svc.log()[-3000:]}") from None
                assert code == 2, f"{svc.role} exited {code}:\n{svc.log()[-3000:]}"
            at_start.settle(60)
            mid_run.settle(60)
            assert "register" not in at_start.ops, at_start.ops  # failed before registering
            assert at_start.count("fatal") == 1, at_start.ops
            assert "fault point worker.load fired" in at_start.errors[0]
            assert "register" in mid_run.ops, mid_run.ops
            assert mid_run.count("fatal") == 1, mid_run.ops
            assert "fault point worker.loop fired" in mid_run.errors[0]
            controller = group.services[0]
            wait_for(lambda: "reported a fatal error: fault point worker.loop fired"
                     in controller.log(), "the mid-run report in the controller's log", 60)
            wait_for(lambda: "failed before registering" in controller.log(),
                     "the start-up report in the controller's log", 60)
    finally:
        at_start.close()
        mid_run.close()
