"""One worker's life in its process: start, run until drained, close (what
:func:`workers.main.run_worker` runs, and rank 0 of a transformer group).

SIGTERM / SIGINT are recorded, never raised into whatever runs (:mod:`workers.startup`):
before the worker is ready they stop its start-up at the next boundary (exit status 0,
"stopped before it was ready"); once it runs they drain it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from contracts.config import ServiceConfig
from contracts.errors import DiffringError, StageError
from contracts.roles import Role
from workers.startup import StartupAborted, StopSignal

if TYPE_CHECKING:
    from workers.worker import StageWorker

log = logging.getLogger("diffring.worker")


def run_stage_worker(role: Role, cfg: ServiceConfig, token: str, env: Mapping[str, str],
                     make: Callable[..., StageWorker] | None = None) -> int:
    """Run one worker until it is drained. ``make(cfg, token, env)`` builds it (default: the
    role's class)."""
    worker: StageWorker | None = None
    ready = False
    stop = StopSignal()
    # Installed before the model stack is imported, which alone takes seconds.
    stop.install()
    log.info("%s worker starting (pid %d): SIGTERM / SIGINT stop it cleanly", role, os.getpid())

    def on_stop() -> None:
        # From the relay thread: wakes the start-up's waits; once the worker runs, it
        # finishes the claimed task and claims nothing new.
        assert worker is not None
        if ready:
            log.info("worker %s: signal %s, draining", worker.name, stop.signum)
        worker.drain()

    try:
        from workers.roles import WORKERS

        stop.boundary("startup.imported")
        worker = (make or WORKERS[Role(role)])(cfg, token, env)
        stop.on_stop(on_stop)
        try:
            worker.start(stop)
        except (DiffringError, StartupAborted):
            raise
        except Exception as exc:  # model stack errors at load are start-up failures
            raise StageError(f"{role} worker failed to start: {exc}") from exc
        stop.boundary("startup.ready")
        ready = True
        worker.run()
    except Exception as exc:
        if not ready and stop.asked:
            # StartupAborted, or whatever a library made of it on the way out: either way a
            # stop was asked for before the worker was ready. Nothing claimed, nothing to
            # drain.
            why = exc if isinstance(exc, StartupAborted) else stop.describe()
            log.info("%s worker stopped before it was ready (%s)", role, why)
            return 0
        if isinstance(exc, DiffringError) and worker is not None:
            worker.report_fatal(str(exc))
        raise
    finally:
        if worker is not None:
            worker.close()
            log.info("worker %s stopped after %d task(s)", worker.name, worker.tasks_done)
    return 0
