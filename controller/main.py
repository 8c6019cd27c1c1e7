"""Entry point of the controller process (``--service controller``)."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Mapping

from contracts.config import ServiceConfig

log = logging.getLogger("diffring.controller")


def run_async(main: Callable[[asyncio.Event], Awaitable[None]]) -> int:
    """Run ``main(stop_event)`` on uvloop (if installed); SIGINT/SIGTERM set the event."""

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    # Only the import decides between the loops: an ImportError raised by the service itself
    # must propagate, not run the whole service a second time on the other loop.
    try:
        import uvloop
    except ImportError:
        asyncio.run(runner())
    else:
        uvloop.run(runner())
    return 0


def run_controller(cfg: ServiceConfig, token: str, env: Mapping[str, str]) -> int:
    from controller.app import run_controller_async

    return run_async(lambda stop: run_controller_async(cfg, token, env, stop))
