"""The front door's guards: the optional API key and the request-body size limit."""

# No ``from __future__ import annotations`` here: FastAPI reads the dependency's annotation
# at definition time, and it names a local (the scheme) that a string could not resolve.

import hmac
import json
import urllib.parse
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Security
from fastapi.security import APIKeyCookie, HTTPAuthorizationCredentials, HTTPBearer
from starlette.types import ASGIApp, Message, Receive, Scope, Send

COOKIE = "diffring_api_key"
"""The status page keeps the key in this cookie (a browser's EventSource cannot send an
Authorization header); it sets it itself, SameSite=Strict, when the page gets a 401."""


def api_key_guard(key: str | None) -> list[Any]:
    """Route dependencies that demand ``Authorization: Bearer <key>`` (none without a key);
    the status page's cookie is taken too.

    Declared through FastAPI's security classes, so the OpenAPI schema names the schemes and
    the docs page offers to send the key.
    """
    if key is None:
        return []
    bearer = HTTPBearer(
        auto_error=False,  # our own 401 with a message, whatever the FastAPI version says
        scheme_name="apiKey",
        description="The front door's API key (server.api_key or DIFFRING_API_KEY)",
    )
    cookie = APIKeyCookie(name=COOKIE, auto_error=False, scheme_name="apiKeyCookie",
                          description="The same key, as the status page sends it")
    expected = key.encode()

    async def require_key(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)],
        from_cookie: Annotated[str | None, Security(cookie)],
    ) -> None:
        if credentials is not None:
            given = credentials.credentials.encode("utf-8", "surrogateescape")
        else:
            given = urllib.parse.unquote(from_cookie or "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(given, expected):  # constant time: no timing oracle
            raise HTTPException(
                status_code=401,
                detail="missing or wrong API key: send the header "
                "'Authorization: Bearer <key>' with this front door's key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return [Depends(require_key)]


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
