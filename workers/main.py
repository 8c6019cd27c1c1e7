"""Entry point of a worker process (``--service encoder|transformer|decoder``)."""

from __future__ import annotations

import logging
import signal
from collections.abc import Mapping
from types import FrameType

from rings.config import ServiceConfig
from rings.errors import DiffringError, StageError

log = logging.getLogger("diffring.worker")


class StartupAborted(Exception):
    """SIGTERM / SIGINT arrived before the worker was ready."""


def run_worker(role: str, cfg: ServiceConfig, token: str, env: Mapping[str, str]) -> int:
    from workers.worker import WORKERS

    worker = WORKERS[role](cfg, token, env)
    starting = True

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if starting:
            # Still loading the model or connecting: nothing claimed, nothing to drain.
            raise StartupAborted(f"signal {signum} during start-up")
        # Only flip the state: the loop finishes the claimed task and exits.
        log.info("worker %s: signal %d, draining", worker.name, signum)
        worker.drain()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        try:
            worker.start()
        except (DiffringError, StartupAborted):
            raise
        except Exception as exc:  # model stack errors at load are start-up failures
            raise StageError(f"{role} worker failed to start: {exc}") from exc
        starting = False
        worker.run()
    except StartupAborted as exc:
        log.info("worker %s stopped before it was ready (%s)", worker.name, exc)
        return 0
    except DiffringError as exc:
        worker.report_fatal(str(exc))
        raise
    finally:
        worker.close()
        log.info("worker %s stopped after %d task(s)", worker.name, worker.tasks_done)
    return 0
