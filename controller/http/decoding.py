"""Input images are checked and decoded in worker processes, not in the controller's.

Why processes and not threads: the CPU-heavy parts hold the GIL (base64 decoding of a
1 MiB image alone takes several milliseconds without releasing it), and in a thread they
still stall the event loop that serves the ring verbs and the control channel. And a
hostile image that crashes or exhausts a decoder then takes down a worker process — the
pool starts a new one and the request gets 422 — never the controller.

One pool per controller process, started lazily (``spawn``: the controller has threads, and
the children need nothing of its state), shared by its front doors.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from fastapi import HTTPException

from controller.http.schemas import decode_image, http_error

log = logging.getLogger("diffring.controller.decoding")

WORKERS = 2
"""Decoding processes; also bounds how many decoded images are in memory at once."""

_lock = threading.Lock()
_pool: concurrent.futures.ProcessPoolExecutor | None = None


def _shared_pool() -> concurrent.futures.ProcessPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = concurrent.futures.ProcessPoolExecutor(
                WORKERS, mp_context=multiprocessing.get_context("spawn")
            )
        return _pool


def _replace_broken(broken: concurrent.futures.Executor) -> None:
    global _pool
    with _lock:
        if _pool is broken:
            _pool = None
    broken.shutdown(wait=False, cancel_futures=True)


def _warm() -> None:
    """Runs in a decoding process: importing this module imported the decoder; the pause
    makes the pool start a process per call (it starts one only when none is idle)."""
    time.sleep(0.2)


def _job(value: str, max_bytes: int, max_pixels: int) -> bytes | tuple[int, str]:
    """Runs in a decoding process: the image bytes, or (status, reason) to answer with (an
    HTTPException is not sent across processes)."""
    try:
        return decode_image(value, max_bytes, max_pixels)
    except HTTPException as exc:
        return exc.status_code, str(exc.detail)


class ImageDecoder:
    """``await decode(...)``: the checked image bytes, or an HTTP error (413 / 422)."""

    def __init__(self, executor: concurrent.futures.Executor | None = None) -> None:
        self._executor = executor  # None: the shared process pool (tests may pass threads)

    def start(self) -> None:
        """Start the processes and import the decoding code in them now, rather than while
        the first images wait (a spawn and its imports take a second or more)."""
        if self._executor is None:
            pool = _shared_pool()
            for fut in [pool.submit(_warm) for _ in range(WORKERS)]:
                fut.result()

    async def run(self, fn: Any, *args: Any) -> Any:
        executor = self._executor or _shared_pool()
        try:
            return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)
        except BrokenProcessPool:
            log.warning("an image decoding process died (crashed or out of memory); "
                        "starting new ones")
            _replace_broken(executor)
            raise

    async def decode(self, value: str, max_bytes: int, max_pixels: int) -> bytes:
        try:
            out = await self.run(_job, value, max_bytes, max_pixels)
        except BrokenProcessPool:
            raise http_error(
                422, "image_path could not be decoded: its decoder crashed or ran out of "
                "memory; send a smaller or a standard PNG / JPEG image"
            ) from None
        if isinstance(out, tuple):
            raise http_error(out[0], out[1])
        data: bytes = out
        return data
