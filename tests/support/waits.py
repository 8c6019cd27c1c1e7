"""Waiting for an event a test means (a port that listens, a line in a log, a condition),
never for a fixed time: each wait has a generous bound, a failure bound on a loaded 2-core
machine, not a measure of anything."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable
from typing import Any


def wait_for(ok: Callable[[], bool], what: str, timeout: float = 300) -> None:
    """Until ``ok()``; an AssertionError naming ``what`` if ``timeout`` passes first."""
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {timeout:g} s")
        time.sleep(0.05)


def wait_port(port: int, proc: subprocess.Popen[Any] | None = None, timeout: float = 120
              ) -> None:
    """Until something listens on ``port`` (a generous bound: a process starting on a loaded
    2-core machine may take tens of seconds); raise if ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


def wait_log(svc: Any, text: str, timeout: float = 120) -> None:
    """Wait until ``text`` is in the log of ``svc`` (a started service: ``log()`` and
    ``proc``); raise, with the log, if the process exits first or ``timeout`` passes (a
    generous bound: this waits for an event, it does not time one)."""
    deadline = time.monotonic() + timeout
    while text not in svc.log():
        if svc.proc.poll() is not None:
            raise AssertionError(f"exited with {svc.proc.returncode} before logging "
                                 f"{text!r}:\n{svc.log()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {text!r} after {timeout:g} s:\n{svc.log()[-3000:]}")
        time.sleep(0.05)
