"""Garbage, oversized, malformed and half-open connections on the control port and the three
ring handshake ports neither crash nor stall the controller: a normal request completes while
they are still held open, and nothing in the controller's log is an unhandled exception."""

from __future__ import annotations

import os
import socket
import struct
from pathlib import Path

import msgpack
import pytest

from launcher import LocalGroup, group_config, submit

pytestmark = pytest.mark.integration  # starts processes or servers

SILENT_PER_PORT = 24


def _send(port: int, data: bytes, *, shut_wr: bool = False) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    if data:
        s.sendall(data)
    if shut_wr:
        s.shutdown(socket.SHUT_WR)
    return s


def _frame(obj: object) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return struct.pack("<I", len(body)) + body


def hostile(port: int) -> tuple[list[socket.socket], list[socket.socket]]:
    """Every kind of bad connection once, plus a crowd of silent ones; all kept open.
    Returns (those the controller must answer and close, those it must wait out)."""
    weird_maps = [
        {"proto": "diffring-ring", "version": 1, "ring": "request", "client_nonce": b"n",
         "mac": 5, "layout": [1, 2], "role": {"x": 1}, "transport": ["tcp"]},
        {"ring": "control", "client_nonce": "not-bytes", "mac": None},
        {"ring": 7, "client_nonce": b"x" * 32, "mac": b"y" * 32},
        {"ring": "control", "client_nonce": b"x" * 32, "mac": 5},
        {"proto": "diffring-ring", "version": 1, "ring": "phase1", "client_nonce": b"x" * 32,
         "mac": 5},
        [1, 2, 3],
        "a string",
    ]
    answered = [
        _send(port, os.urandom(64 << 10)),                   # garbage
        _send(port, struct.pack("<I", 0xFFFFFFFF) + b"x" * 100),  # oversized frame
        _send(port, b"", shut_wr=True),                      # half-closed at once
        _send(port, _frame({"a": 1})[:-1] + b"\xc1"),        # invalid msgpack byte
    ]
    answered += [_send(port, _frame(m)) for m in weird_maps]
    # A map whose key is an array: msgpack itself refuses it (unhashable key).
    answered.append(_send(port, struct.pack("<I", 4) + b"\x81\x91\x01\x02"))
    waited = [
        _send(port, struct.pack("<I", 1000) + b"y" * 10),    # half a frame, then nothing
        _send(port, b"\x00\x00"),                            # half a length header
    ]
    waited += [_send(port, b"") for _ in range(SILENT_PER_PORT)]  # connect, say nothing
    return answered, waited


def wait_closed(s: socket.socket, timeout: float = 120) -> None:
    """Until the controller has dealt with ``s``: it closed it (after its refusal, if any)."""
    s.settimeout(timeout)
    try:
        while s.recv(65536):
            pass
    except ConnectionResetError:
        pass  # closed with our garbage unread: a reset


def test_hostile_connections_do_not_crash_or_stall_the_controller(
    tiny_models: Path, tmp_path: Path
) -> None:
    pipeline = "qwen_t2i"
    cfg = group_config(pipeline, str(tiny_models / pipeline), tmp_path)
    d = cfg["disagg_config"]
    ports = [d["control_port"], d["rdma_request_handshake_port"],
             d["rdma_phase1_handshake_port"], d["rdma_phase2_handshake_port"]]
    held: list[socket.socket] = []
    with LocalGroup(cfg, tmp_path) as group:
        group.start("controller")
        group.wait_http()
        group.start("encoder")
        group.start("transformer")
        group.wait_workers({"encoder": 1, "transformer": 1}, timeout=180)
        try:
            answered = []
            for port in ports:
                bad, silent = hostile(port)
                held += bad + silent
                answered += bad
            for s in answered:  # the controller has chewed on all of it
                wait_closed(s)
            # A worker that joins now (new connections on its ports), then a normal request.
            group.start("decoder")
            group.wait_workers({"encoder": 1, "transformer": 1, "decoder": 1}, timeout=180)
            body = {"prompt": "still serving", "height": 32, "width": 32, "infer_steps": 2}
            st = submit(group.url, "image", body, timeout=300)
            assert st["status"] == "completed", st
            group.check_alive()
        finally:
            for s in held:
                s.close()
        log = group.services[0].log()
    assert "Traceback" not in log and "exception was never retrieved" not in log, log[-4000:]
    assert "Unhandled exception" not in log
