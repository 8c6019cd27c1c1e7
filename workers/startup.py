"""A stop asked for while a worker starts is never lost (SIGTERM / SIGINT).

A worker's start-up takes seconds to minutes: the imports of the model stack, the Mooncake
engine, waiting for the controller, each model component, a warm-up. A signal handler that
raised into whatever ran at that instant would be swallowed by the first library
``except Exception`` on the way (the imports of torch, transformers and diffusers have such
blocks), and the worker would go on starting as if nothing had been asked. So the handler of
:class:`StopSignal` only *records* the request and wakes what waits; start-up looks at the
record at each of its boundaries (:meth:`StopSignal.boundary`: after the imports, after the
transport, after each model component, in every retry wait, once registered) and leaves from
there with :class:`StartupAborted`. Once the worker runs, the same request drains it.

Waking goes through a pipe to a relay thread, not through ``threading.Event.set`` in the
handler: the handler runs on the main thread between two bytecodes, possibly inside
``Event.wait`` while that thread holds the event's lock, where ``set`` would deadlock;
``os.write`` takes no lock.

Each boundary is also a fault point (``startup.*`` in :data:`contracts.faults.POINTS`), so a
test can deliver the signal at exactly that step (action ``signal=TERM``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

from contracts import faults

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StartupAborted(Exception):
    """A stop was asked for (SIGTERM / SIGINT) before the worker was ready; raised only at a
    start-up boundary, by our own code."""


class StopSignal:
    """The stop request of one process: recorded by a signal handler, acted on by the code
    that owns the process's steps."""

    def __init__(self) -> None:
        self.signum: int | None = None
        """The first stop signal received (None: none yet). Written by the handler only."""
        self.requested = threading.Event()
        """Set by the relay thread once a stop signal arrived (for waits)."""
        self._listeners: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._wake_w = -1
        """Write end of the relay's pipe (-1: not installed, and nothing can ask)."""
        self._previous: dict[int, Any] = {}

    @property
    def asked(self) -> bool:
        return self.signum is not None

    def describe(self) -> str:
        name = signal.Signals(self.signum).name if self.signum is not None else "none"
        return f"signal {self.signum} ({name}) during start-up"

    def install(self, signals: Iterable[int] = STOP_SIGNALS) -> None:
        """Handle ``signals`` in this process (call from the main thread)."""
        wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        threading.Thread(
            target=self._relay, args=(wake_r,), name="stop-signal", daemon=True
        ).start()
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def uninstall(self) -> None:
        """Put the previous handlers back (in-process tests); the relay thread ends."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        os.close(self._wake_w)
        self._wake_w = -1

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        # Record and wake, nothing else: no lock taken, nothing raised (module docstring).
        if self.signum is None:
            self.signum = signum
        with contextlib.suppress(BlockingIOError):  # a wake-up is already pending
            os.write(self._wake_w, b"\0")

    def _relay(self, wake_r: int) -> None:
        while True:
            try:
                data = os.read(wake_r, 64)
            except OSError:
                data = b""
            if not data:  # uninstalled
                os.close(wake_r)
                return
            self.requested.set()
            with self._lock:
                listeners = list(self._listeners)
            for fn in listeners:
                fn()

    def on_stop(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` when a stop is asked for (from the relay thread), or at once if it was
        already. ``fn`` must be idempotent: a request arriving meanwhile may call it twice."""
        with self._lock:
            self._listeners.append(fn)
            already = self.asked
        if already:
            fn()

    def boundary(self, point: str) -> None:
        """A start-up boundary, named by its fault point (``startup.*``): leave start-up
        here, with :class:`StartupAborted`, if a stop was asked for."""
        faults.hit(point)
        if self.asked:
            raise StartupAborted(f"{self.describe()}, stopped at {point}")
