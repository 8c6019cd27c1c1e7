"""Entry point of a worker process (``--service encoder|transformer|decoder``)."""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable, Mapping
from types import FrameType
from typing import TYPE_CHECKING

from contracts.config import ServiceConfig
from contracts.errors import DiffringError, StageError
from contracts.roles import Role

if TYPE_CHECKING:
    from workers.worker import StageWorker

log = logging.getLogger("diffring.worker")


class StartupAborted(Exception):
    """SIGTERM / SIGINT arrived before the worker was ready."""


def run_worker(role: Role, cfg: ServiceConfig, token: str, env: Mapping[str, str],
               make: Callable[..., StageWorker] | None = None) -> int:
    """Run one worker until it is drained. ``make(cfg, token, env)`` builds it (default: the
    role's class); a transformer whose layout spans devices runs as a group instead
    (:mod:`workers.group.supervisor`)."""
    if make is None and role is Role.TRANSFORMER and cfg.transformer.layout.size > 1:
        from workers.group.supervisor import run_group

        return run_group(cfg, token, env)
    worker: StageWorker | None = None
    starting = True

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if starting or worker is None:
            # Still importing, loading the model or connecting: nothing claimed, nothing
            # to drain.
            raise StartupAborted(f"signal {signum} during start-up")
        # Only flip the state: the loop finishes the claimed task and exits.
        log.info("worker %s: signal %d, draining", worker.name, signum)
        worker.drain()

    # Installed before the model stack is imported, which alone takes seconds.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        from workers.roles import WORKERS

        worker = (make or WORKERS[Role(role)])(cfg, token, env)
        try:
            worker.start()
        except (DiffringError, StartupAborted):
            raise
        except Exception as exc:  # model stack errors at load are start-up failures
            raise StageError(f"{role} worker failed to start: {exc}") from exc
        starting = False
        worker.run()
    except StartupAborted as exc:
        log.info("%s worker stopped before it was ready (%s)", role, exc)
        return 0
    except DiffringError as exc:
        if worker is not None:
            worker.report_fatal(str(exc))
        raise
    finally:
        if worker is not None:
            worker.close()
            log.info("worker %s stopped after %d task(s)", worker.name, worker.tasks_done)
    return 0
