"""Where an ``image_path`` that is not base64 may come from, as LightX2V's clients send it: an
``http(s)://`` URL, fetched from an allowed host with a size and a time limit, or a file
under the configured input folder, never outside it. Both are off by default
(``server.image_url_hosts`` empty, ``server.input_dir`` unset): such a value is then refused
with 422 naming the setting that would allow it.

The value is read as base64 first, whatever it starts with (the base64 of every JPEG starts
with ``/9j/``): only a value that is not base64 is taken for a URL or a path. What is fetched
or read is checked and decoded like any image (:func:`controller.http.schemas.decode_image`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from contracts.config import ServerConfig
from controller.http.schemas import http_error

_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.\-]*://")
_SHORT = 4096
"""Longer values are taken for base64 as they are (no path or URL is this long)."""


def _is_base64(value: str) -> bool:
    compact = "".join(value.split())
    try:
        base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


async def resolve(value: str, server: ServerConfig,
                  off_loop: Callable[..., Any]) -> str:
    """``value`` as base64 (or a ``data:`` URL): as it is when it is one, else the bytes of
    the URL or file it names, when the configuration allows it (422 / 413 otherwise).
    ``off_loop(fn, *args)``: runs blocking work (a file read) off the event loop."""
    text = value.strip()
    if text.startswith("data:") or len(text) > _SHORT or _is_base64(text):
        return value
    if _URL.match(text) and server.image_url_hosts:
        data = await fetch(text, server)
    elif not _URL.match(text) and server.input_dir is not None:
        data = await off_loop(read_input, text, server)
    else:  # decode_image refuses it, naming the setting that would allow it
        return value
    return base64.b64encode(data).decode("ascii")


async def fetch(url: str, server: ServerConfig) -> bytes:
    """The body of ``url``: http(s) only, a host of ``server.image_url_hosts``, no
    redirects, at most ``server.max_image_bytes``, within ``server.image_fetch_timeout_s``."""
    import httpx

    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise http_error(422, f"image_path scheme {parts.scheme!r} is not allowed; send the "
                              "image as base64, a data: URL or an http(s) URL")
    host = (parts.hostname or "").lower()
    if host not in server.image_url_hosts:
        raise http_error(422, f"image_path host {host!r} is not in server.image_url_hosts "
                              f"({', '.join(server.image_url_hosts)})")
    limit = server.max_image_bytes
    timeout = server.image_fetch_timeout_s
    out = bytearray()
    try:
        async with asyncio.timeout(timeout), httpx.AsyncClient(
                trust_env=False, follow_redirects=False, timeout=timeout) as client, \
                client.stream("GET", url) as response:
            if response.is_redirect:
                raise http_error(422, f"image_path {url} redirects (HTTP "
                                      f"{response.status_code}); give the image's own URL")
            if response.status_code != 200:
                raise http_error(422, f"image_path {url} answered HTTP {response.status_code}")
            declared = response.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise http_error(413, f"image_path {url} is {declared} bytes, over the "
                                      f"{limit} bytes of server.max_image_bytes")
            async for chunk in response.aiter_bytes():
                out += chunk
                if len(out) > limit:
                    raise http_error(413, f"image_path {url} sent more than the {limit} "
                                          "bytes of server.max_image_bytes")
    except (TimeoutError, httpx.TimeoutException):
        raise http_error(422, f"image_path {url} did not arrive within {timeout:g} s "
                              "(server.image_fetch_timeout_s)") from None
    except httpx.HTTPError as exc:
        raise http_error(422, f"image_path {url} could not be fetched: "
                              f"{type(exc).__name__}: {exc}") from None
    return bytes(out)


def read_input(path: str, server: ServerConfig) -> bytes:
    """The file ``path`` names under ``server.input_dir`` (relative to it, or absolute inside
    it; links resolved first, so none leads out), at most ``server.max_image_bytes``."""
    assert server.input_dir is not None
    root = Path(server.input_dir).resolve()
    candidate = Path(path).expanduser()
    target = (candidate if candidate.is_absolute() else root / candidate).resolve()
    if not target.is_relative_to(root):
        raise http_error(422, f"image_path {path!r} is outside the input folder "
                              f"(server.input_dir {root}); only files under it are read")
    if not target.is_file():
        raise http_error(422, f"image_path {path!r}: no such file under the input folder "
                              f"{root}")
    size = target.stat().st_size
    if size > server.max_image_bytes:
        raise http_error(413, f"image_path {path!r} is {size} bytes, over the "
                              f"{server.max_image_bytes} bytes of server.max_image_bytes")
    return target.read_bytes()
