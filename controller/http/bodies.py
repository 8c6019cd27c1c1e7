"""Request bodies at the front door: refused when too large before they are read, and
large JSON ones parsed off the event loop that also serves the ring verbs."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import HTTPException
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

OFF_LOOP_BYTES = 64 << 10
"""JSON bodies from this size on are parsed on :data:`_parsers` (a 1 MiB body holding a
base64 image takes milliseconds to parse; 200 of them arriving together would otherwise
keep the loop from the ring verbs for a second)."""
_parsers = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="json-body")


class OffLoopJSONRoute(APIRoute):
    """A route whose large JSON body is parsed on a worker thread before FastAPI reads it.

    FastAPI reads a JSON body through ``Request.json()``, which parses on the loop and
    caches the result in ``request._json``; this fills that cache from a thread first (a
    Starlette detail, covered by ``tests/integration/test_off_loop.py``). ``json.loads``
    holds the GIL while it runs, but the loop runs between bodies instead of after all of
    them. A body that does not parse is left to FastAPI, which answers it as usual.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def parse_then_handle(request: Request) -> Response:
            if request.headers.get("content-type", "").startswith("application/json"):
                body = await request.body()
                if len(body) >= OFF_LOOP_BYTES:
                    loop = asyncio.get_running_loop()
                    try:
                        parsed = await loop.run_in_executor(_parsers, json.loads, body)
                    except ValueError:
                        pass  # FastAPI parses it again and answers 422 with the position
                    else:
                        request._json = parsed  # what Request.json() returns from now on
            return await handler(request)

        return parse_then_handle


class BodyLimit:
    """Refuse request bodies over ``max_bytes`` with 413 before they are read into memory
    (by their Content-Length, or while a chunked body streams in)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            try:
                too_large = int(length) > self.max_bytes
            except ValueError:
                await _reply(send, 400, "Content-Length is not a number")
                return
            if too_large:
                await _reply(send, 413, self._message())
                return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI passes an HTTPException from reading the body through.
                    raise HTTPException(status_code=413, detail=self._message())
            return message

        await self.app(scope, counted, send)

    def _message(self) -> str:
        return (
            f"request body exceeds {self.max_bytes} bytes; send a smaller input image "
            "(see server.max_image_bytes)"
        )


async def _reply(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
