"""How a worker whose input ring was empty waits for work: on the doorbell, with back-off.

Waiting on the doorbell (:class:`workers.control.DoorbellClient`) instead of polling the
ring, an idle worker costs the controller one wait per ``IDLE_WAIT_S`` and wakes within a
round trip of a push.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from contracts.errors import ControlRefused
from rings.ring import Ring
from workers.control import DoorbellClient

log = logging.getLogger("diffring.worker")

IDLE_BACKOFF_MAX_S = 0.05
"""Longest pause after a wake-up that found nothing to claim (see :meth:`IdleWait.wait`)."""
IDLE_WAIT_S = 5.0
"""Longest doorbell wait: an idle worker polls its ring at least this often, so a wake-up
that never came (the controller rings within its sweep interval anyway) costs at most this."""


class IdleWait:
    """The pull loop's wait between an empty claim and the next one."""

    def __init__(self, doorbell: DoorbellClient, wake: threading.Event, name: str) -> None:
        self._doorbell = doorbell
        self._wake = wake
        """Set when the worker drains or closes: ends a back-off pause at once."""
        self._name = name
        self._false_wakes = 0
        self._no_doorbell = False

    def reset(self) -> None:
        """A step found something to do: the next wait starts without back-off."""
        self._false_wakes = 0

    def interrupt(self) -> None:
        """End a doorbell wait in progress at once (safe from a signal handler)."""
        self._doorbell.interrupt()

    def wait(self, ring: Ring, running: Callable[[], bool]) -> None:
        """Wait on the doorbell until the controller says ``ring`` has work (or
        ``IDLE_WAIT_S`` passes).

        A wake-up is a hint: the next step claims through the ring and may find nothing
        (another worker was faster, or the published item sits behind one still being
        written). After such a false wake-up the worker pauses, doubling up to
        ``IDLE_BACKOFF_MAX_S``, so a ring that keeps reporting work it cannot hand out is
        not hammered.
        """
        if self._false_wakes:
            self._wake.wait(min(0.001 * 2 ** (self._false_wakes - 1), IDLE_BACKOFF_MAX_S))
            if not running():
                return
        if self._no_doorbell:
            # Polling, backing off up to IDLE_BACKOFF_MAX_S: the controller has no doorbell.
            self._false_wakes = min(self._false_wakes + 1, 16)
            return
        try:
            woke = self._doorbell.wait(ring.name, IDLE_WAIT_S, ring.pop_ticket)
        except ControlRefused as exc:
            log.warning("worker %s: no doorbell (%s); polling the ring instead", self._name, exc)
            self._no_doorbell = True
            return
        if woke is None:  # interrupted: draining or stopping
            return
        self._false_wakes = min(self._false_wakes + 1, 16) if woke else 0
