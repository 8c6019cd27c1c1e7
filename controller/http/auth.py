"""The front door's optional API key."""

# No ``from __future__ import annotations`` here: FastAPI reads the dependency's annotation
# at definition time, and it names a local (the scheme) that a string could not resolve.

import hmac
import urllib.parse
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Security
from fastapi.security import APIKeyCookie, HTTPAuthorizationCredentials, HTTPBearer

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
