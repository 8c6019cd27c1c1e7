"""Named fault points: kill or fail a process at an exact step, on demand.

A fault that cannot be reproduced is not fixed, so the code paths where a process can die or
fail with a task in flight carry a named *fault point* (:data:`POINTS`). Each is a call

    faults.hit("worker.after_pop")

that costs one global bool test while no fault is armed (the default: :data:`ON` is False and
``hit`` returns at once). A process arms faults once, at its entry point, from the
``DIFFRING_FAULTS`` environment variable or the ``faults`` config key (``run_service.py``
calls :func:`configure`); nothing below the entry point reads the environment.

Spec: comma-separated entries ``point:action[:when]``::

    DIFFRING_FAULTS=worker.after_pop:exit
    DIFFRING_FAULTS=transfer.read:raise:every=20,control.drop:raise:nth=3

actions
    ``exit``      SIGKILL this process at once (no cleanup, no goodbye: a crash)
    ``raise``     raise the error the call site names (the project error that step would
                  raise for real: a failed Mooncake read raises ``TransferFailed``, a dropped
                  control connection ``ConnectionLost``, a stage ``StageError``; elsewhere
                  :class:`~contracts.errors.FaultInjected`)
    ``hang``      stop at the point for good (a wedged process: heartbeats of other threads
                  go on; SIGKILL ends it)
    ``stop``      SIGSTOP this process (a frozen one: no thread runs, no socket closes;
                  SIGKILL or SIGCONT ends it)
    ``sleep=S``   pause S seconds, then go on
    ``hold=PATH`` stay at the point while the file PATH exists, then go on (a gate a test
                  opens by deleting the file, at the event it waits for; PATH holds no ``:``
                  or ``,``)
    ``signal=SIG`` raise signal SIG (``TERM``, ``INT``) in this thread and go on: it arrives
                  at exactly this step (on the main thread its handler has run when the
                  point returns)

when (default: every hit)
    ``once``      the first hit only (same as ``nth=1``)
    ``nth=K``     the K-th hit only
    ``every=K``   every K-th hit
    ``p=F``       each hit with probability F
    ``while=PATH`` every hit while the file PATH exists (a fault a test clears by deleting
                  the file; PATH holds no ``:`` or ``,``)

rank (transformer groups)
    ``point@R:action[:when]`` arms the entry in rank R of a transformer group only, and in
    the group's first start only (a restarted group runs clean, so that a test sees the
    group recover): ``group.step@1:exit:nth=2`` kills rank 1 before its second step.
    Entries without ``@R`` are armed in every rank, every time.

Every firing is logged (``fault point ... fired``) before it acts, and counted
(:func:`fired`).
"""

from __future__ import annotations

import errno
import logging
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from contracts.errors import ConfigError, FaultInjected


def no_space(message: str) -> OSError:
    """The error of a full disk, for fault points at a file write (``raise``)."""
    return OSError(errno.ENOSPC, f"No space left on device ({message})")

log = logging.getLogger("diffring.faults")

POINTS: Final[dict[str, str]] = {
    "worker.load": "a worker is about to load its model stage, after its transport preflight "
    "and before it registers (raise: ModelLoadError, a model that fails to load)",
    "worker.loop": "a registered worker's pull loop, before each claim (raise: FaultInjected, "
    "which no step catches: a fatal error, reported to the controller before the exit)",
    "worker.after_pop": "a worker took an item from its input ring (the slot is freed) and has "
    "not sent its claim yet: no lease exists",
    "worker.after_claim": "the controller granted the claim (the lease runs); nothing fetched",
    "worker.stage": "the role's model stage is about to run (raise: StageError, a failure the "
    "task causes)",
    "worker.before_publish": "the stage computed its outputs; nothing staged or published yet",
    "worker.after_publish": "the outputs are in the next ring (decoder: the result file is "
    "written); the handoff / completion message is not sent yet",
    "transfer.pull": "during a Mooncake pull: a tensor arrived, the producer is not released",
    "transfer.read": "a Mooncake read (raise: TransferFailed, as a failed read)",
    "keep.release": "a keeper (the controller keeping a DiT's checkpoint) read and verified "
    "every tensor of it and is about to write the producer's release words, one write each "
    "(nth=K: the K-th checkpoint the controller pulled)",
    "decoder.result_write": "the decoder wrote the result's temporary file, not yet renamed",
    "decoder.before_write": "the decoder is about to write a result file (raise: OSError "
    "ENOSPC, a full disk: the result is held and the write retried)",
    "controller.result_write": "the controller is about to write a result file a decoder "
    "sent (raise: OSError ENOSPC, a full disk: the decoder holds the result and retries)",
    "controller.ports": "the controller opened its ports (front door, metric port and "
    "control channel first, then the rings and its Mooncake engine); its front door and "
    "metrics do not answer yet",
    "control.drop": "a control-channel call (raise: the connection drops before the request "
    "is sent: ConnectionLost)",
    # Start-up boundaries of a worker (workers/startup.py): where a stop asked for during
    # start-up is acted on. ``signal=TERM`` delivers one at exactly that step.
    "startup.imported": "a worker process imported its role's code (the model stack is "
    "imported by the model load); nothing is built yet",
    "startup.transport": "the worker's Mooncake engine and staging pool are up; the "
    "controller is not reached yet",
    "startup.connected": "the controller connected back to the worker's Mooncake address; "
    "the model is not loaded yet",
    "startup.retry_wait": "start-up (or a reconnect) is about to wait for an absent "
    "controller before trying again",
    "startup.component": "one model component (tokenizer, text encoder, DiT, VAE, ...) is "
    "loaded, the next one is not",
    "startup.model": "the model stage is loaded (and warmed up); the worker has not joined "
    "the rings",
    "startup.ready": "the worker joined the rings and registered; its pull loop has not "
    "started",
    "dit.step": "a DiT worker at a step boundary: a denoising step is done (and its "
    "checkpoint, if one is due, captured), the next one not started (nth=K: after the K-th "
    "step this process ran); in a transformer group, rank 0 only",
    "dit.checkpointed": "a DiT worker's checkpoint reached the controller (acknowledged); "
    "nth=K: after the K-th one this process sent; in a transformer group, rank 0 only",
    "group.step": "every rank of a transformer group, before each denoising step, after the "
    "group agreed to go on (raise: FaultInjected in that rank alone)",
}
"""Every fault point compiled into the code, with where exactly it sits."""

ACTIONS: Final = ("exit", "raise", "hang", "stop", "sleep", "hold", "signal")
SIGNALS: Final = {"TERM": signal.SIGTERM, "INT": signal.SIGINT}
"""Signals the ``signal=`` action may send (the stop signals)."""

ON = False
"""True once :func:`configure` armed at least one fault: the only cost of a disarmed point."""


@dataclass
class Fault:
    """One armed fault point."""

    point: str
    action: str
    seconds: float = 0.0
    signum: int = 0
    gate: str | None = None
    """``hold``: the file whose existence keeps the point held."""
    nth: int | None = None
    every: int | None = None
    probability: float | None = None
    while_path: str | None = None
    rank: int | None = None
    """Armed in this rank of a transformer group only (``point@R``); None: everywhere."""
    hits: int = 0
    fired: int = 0

    def due(self, rng: random.Random) -> bool:
        self.hits += 1
        if self.nth is not None:
            return self.hits == self.nth
        if self.every is not None:
            return self.hits % self.every == 0
        if self.probability is not None:
            return rng.random() < self.probability
        if self.while_path is not None:
            return os.path.exists(self.while_path)
        return True


_armed: dict[str, Fault] = {}
_lock = threading.Lock()
_rng = random.Random()
# A process forked from one that imported this module (the chaos soak's fork server) would
# otherwise draw the same ``p=F`` sequence as its siblings: every worker failing, say, its
# 8th read. Each process draws its own.
os.register_at_fork(after_in_child=_rng.seed)


def parse(spec: str | None) -> dict[str, Fault]:
    """Parse a fault spec (keyed ``point`` or ``point@R``); a ConfigError names the bad entry
    and what is allowed."""
    out: dict[str, Fault] = {}
    for entry in (spec or "").split(","):
        entry = entry.strip()
        if not entry:
            continue
        parts = entry.split(":")
        if len(parts) not in (2, 3):
            raise ConfigError(
                f"fault {entry!r}: expected point:action[:when], e.g. worker.after_pop:exit"
            )
        point, action = parts[0], parts[1]
        point, at, rank = point.partition("@")
        if point not in POINTS:
            raise ConfigError(
                f"fault {entry!r}: unknown fault point {point!r} (known: {', '.join(POINTS)})"
            )
        fault = Fault(point, action)
        if at:
            fault.rank = int(_number(entry, rank, int, 0))
        if action.startswith("sleep="):
            fault.action, fault.seconds = "sleep", _number(entry, action[6:], float, 0)
        elif action.startswith("hold=") and len(action) > 5:
            fault.action, fault.gate = "hold", action[5:]
        elif action.startswith("signal="):
            if action[7:] not in SIGNALS:
                raise ConfigError(
                    f"fault {entry!r}: signal must be one of {', '.join(SIGNALS)}"
                )
            fault.action, fault.signum = "signal", SIGNALS[action[7:]]
        elif action not in ACTIONS or action in ("sleep", "signal", "hold"):
            raise ConfigError(
                f"fault {entry!r}: unknown action {action!r} (exit, raise, hang, stop, sleep=S, "
                "hold=PATH, signal=TERM|INT)"
            )
        if len(parts) == 3:
            when = parts[2]
            if when == "once":
                fault.nth = 1
            elif when.startswith("nth="):
                fault.nth = int(_number(entry, when[4:], int, 1))
            elif when.startswith("every="):
                fault.every = int(_number(entry, when[6:], int, 1))
            elif when.startswith("p="):
                fault.probability = _number(entry, when[2:], float, 0)
                if fault.probability > 1:
                    raise ConfigError(f"fault {entry!r}: p must be in 0..1")
            elif when.startswith("while=") and len(when) > 6:
                fault.while_path = when[6:]
            else:
                raise ConfigError(
                    f"fault {entry!r}: unknown condition {when!r} (once, nth=K, every=K, p=F, "
                    "while=PATH)"
                )
        key = point if fault.rank is None else f"{point}@{fault.rank}"
        if key in out:
            raise ConfigError(f"fault point {key!r} is armed twice")
        out[key] = fault
    return out


def _number(entry: str, text: str, kind: type[int] | type[float], least: float) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise ConfigError(f"fault {entry!r}: {text!r} is not a number") from None
    if value < least:
        raise ConfigError(f"fault {entry!r}: {text!r} must be at least {least:g}")
    return value


def configure(spec: str | None, rank: int | None = None, first_start: bool = True) -> None:
    """Arm the faults of ``spec`` in this process (replacing any armed before). ``rank``: this
    process is that rank of a transformer group (``first_start``: in the group's first start),
    which arms its ``point@R`` entries; elsewhere they stay disarmed."""
    global ON
    parsed: dict[str, Fault] = {}
    # A rank's own entry wins over the same point armed everywhere.
    for f in sorted(parse(spec).values(), key=lambda f: f.rank is not None):
        if f.rank is None or (f.rank == rank and first_start):
            parsed[f.point] = f
    with _lock:
        _armed.clear()
        _armed.update(parsed)
        ON = bool(parsed)
    for fault in parsed.values():
        log.warning("fault point %s armed: %s", fault.point, fault.action)


def fired() -> dict[str, int]:
    """How often each armed point fired in this process."""
    with _lock:
        return {name: f.fired for name, f in _armed.items()}


def hit(point: str, error: Callable[[str], BaseException] = FaultInjected) -> None:
    """Pass fault point ``point``; act if it is armed and due. ``error`` builds the exception
    that ``raise`` throws (the one the real failure at this step would be)."""
    if not ON:
        return
    with _lock:
        fault = _armed.get(point)
        if fault is None or not fault.due(_rng):
            return
        fault.fired += 1
        n = fault.hits
    message = f"fault point {point} fired (action {fault.action}, hit {n})"
    log.warning("%s", message)
    if fault.action == "exit":
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # SIGKILL is delivered before this returns
    elif fault.action == "raise":
        raise error(message)
    elif fault.action == "hang":
        while True:
            time.sleep(3600)
    elif fault.action == "stop":
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault.action == "sleep":
        time.sleep(fault.seconds)
    elif fault.action == "hold":
        # Polled rather than watched (inotify): a test's gate, held for moments, where a
        # 20 ms poll costs nothing and needs no extra dependency.
        assert fault.gate is not None
        while os.path.exists(fault.gate):
            time.sleep(0.02)
        log.warning("fault point %s released (%s is gone)", point, fault.gate)
    elif fault.action == "signal":
        # raise(3), not kill(2): delivered to this thread, and on the main thread Python runs
        # its handler before raise_signal returns.
        signal.raise_signal(fault.signum)
