"""Entry points of the controller process (``--service controller``) and the baseline."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Mapping

from rings.config import ServiceConfig

log = logging.getLogger("diffring.controller")


def run_async(main: Callable[[asyncio.Event], Awaitable[None]]) -> int:
    """Run ``main(stop_event)`` on uvloop (if installed); SIGINT/SIGTERM set the event."""

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    try:
        import uvloop

        uvloop.run(runner())
    except ImportError:
        asyncio.run(runner())
    return 0


def run_controller(cfg: ServiceConfig, token: str, env: Mapping[str, str]) -> int:
    from controller.rings_host import ControllerRings

    async def main(stop: asyncio.Event) -> None:
        rings = ControllerRings(cfg.disagg_config, token)
        await rings.start()
        log.info("controller ready: rings %s", rings.ports())
        try:
            await stop.wait()
        finally:
            log.info("controller shutting down")
            await rings.close()

    return run_async(main)


def run_all(cfg: ServiceConfig, token: str, env: Mapping[str, str]) -> int:
    raise NotImplementedError("--service all arrives with the end-to-end pipeline")
