"""The API docs pages, ``/docs`` (Swagger UI) and ``/redoc`` (ReDoc), served from files
installed with the project instead of a CDN: GPU clusters are often air-gapped, and FastAPI's
own pages load their JavaScript from one (a blank page there).

The bundles come from the ``fastapi-offline`` package, which ships Swagger UI's and ReDoc's
built files (and their licences' notices) as package data; the HTML is FastAPI's own, pointed
at them. Like the OpenAPI document, the pages are open even with an API key: the key guards
the API, and Swagger UI offers to send it.
"""

from __future__ import annotations

import functools
from importlib.resources import files

from fastapi import APIRouter, FastAPI
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles

ASSETS = "/docs/static"
"""Where the bundles are served."""
_OAUTH2_REDIRECT = "/docs/oauth2-redirect"
_REDOC_LOGO = "https://cdn.redoc.ly/redoc/logo-mini.svg"
_BLANK_GIF = "data:image/gif;base64,R0lGODlhAQABAAAAACH5BAEKAAEALAAAAAABAAEAAAICTAEAOw=="


def _assets_dir() -> str:
    return str(files("fastapi_offline") / "static")


@functools.cache
def _redoc_js() -> bytes:
    """ReDoc's bundle with its one remote asset, the "API docs by Redocly" logo (an image
    it loads from its CDN whatever the options), replaced by a blank image: offline, the
    page must not reach for the network at all. Patched here rather than shipped patched:
    the installed bundle stays the package's own, and a newer one without the logo is
    served as it is (the replacement then changes nothing)."""
    data = (files("fastapi_offline") / "static" / "redoc.standalone.js").read_bytes()
    return data.replace(_REDOC_LOGO.encode(), _BLANK_GIF.encode())


def add_docs(app: FastAPI) -> None:
    """Serve ``/docs`` and ``/redoc`` on ``app`` (built with ``docs_url=None`` and
    ``redoc_url=None``) from the installed bundles."""
    title = app.title
    openapi_url = app.openapi_url or "/openapi.json"
    router = APIRouter(include_in_schema=False)

    @router.get("/docs")
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url, title=f"{title} - Swagger UI",
            oauth2_redirect_url=_OAUTH2_REDIRECT,
            swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS}/favicon.png",
            # No badge that asks swagger.io to validate the document.
            swagger_ui_parameters={"validatorUrl": None},
        )

    @router.get(_OAUTH2_REDIRECT)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @router.get(f"{ASSETS}/redoc.standalone.js")
    async def redoc_js() -> Response:
        return Response(_redoc_js(), media_type="text/javascript")

    @router.get("/redoc")
    async def redoc() -> HTMLResponse:
        return get_redoc_html(
            openapi_url=openapi_url, title=f"{title} - ReDoc",
            redoc_js_url=f"{ASSETS}/redoc.standalone.js",
            redoc_favicon_url=f"{ASSETS}/favicon.png", with_google_fonts=False,
        )

    app.include_router(router)
    app.mount(ASSETS, StaticFiles(directory=_assets_dir()), name="docs-static")
