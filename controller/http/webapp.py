"""The front door's FastAPI application, assembled: the
:class:`~controller.http.frontdoor.FrontDoor` and its route modules (the task API, events,
OpenAI, status page), the API-key guard, the error bodies and the body limit.

This module imports the route modules; they import the front door and never this module, so
the front door's modules form no cycle.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from contracts.pipelines import task_spec
from controller.http import routes, routes_events, routes_openai, routes_ui
from controller.http.auth import api_key_guard
from controller.http.bodies import BodyLimit
from controller.http.docs import add_docs
from controller.http.frontdoor import FrontDoor
from controller.http.openai_api import OpenAIDoor

log = logging.getLogger("diffring.frontdoor")


async def _validation_error(_req: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    problems = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        if err.get("type") == "extra_forbidden":
            problems.append(f"unknown field {loc!r}")
        else:
            problems.append(f"{loc}: {err.get('msg')}")
    return JSONResponse(status_code=422, content={"detail": "; ".join(problems)})


async def _http_error(req: Request, exc: Exception) -> Response:
    """Starlette's own errors (no such route, a method not allowed): OpenAI's shape under
    the OpenAI paths, so its client raises its own exceptions; FastAPI's elsewhere."""
    assert isinstance(exc, StarletteHTTPException)
    shaped = routes_openai.openai_http_error(req, exc)
    return shaped if shaped is not None else await http_exception_handler(req, exc)


async def _unexpected(_req: Request, exc: Exception) -> JSONResponse:
    log.exception("front door: unexpected error")
    return JSONResponse(
        status_code=500,
        content={"detail": f"internal error ({type(exc).__name__}: {exc}); the "
                           "controller log has the details"},
    )


def build_app(front: FrontDoor) -> FastAPI:
    """The FastAPI application of ``front``: its routes find it as ``app.state.front``
    (the OpenAI routes their :class:`~controller.http.openai_api.OpenAIDoor` as
    ``app.state.openai``)."""
    app = FastAPI(
        title="diffring",
        description=f"Disaggregated diffusion serving — this controller serves "
        f"{front.pipeline}.",
        version="0.1.0",
        docs_url=None,  # served from the installed bundles instead (controller.http.docs)
        redoc_url=None,
    )
    app.state.front = front
    app.state.openai = OpenAIDoor(front)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
    guard = api_key_guard(front.server.api_key)
    for module in (routes, routes_events, routes_openai, routes_ui):
        app.include_router(module.router, dependencies=guard)
    # Open with or without a key: /health, and the status page's HTML (its data is guarded).
    app.include_router(routes.open_router)
    app.include_router(routes_ui.page_router)
    app.mount("/ui/static", StaticFiles(directory=routes_ui.UI_DIR), name="ui-static")
    add_docs(app)
    # Whole request bodies are read into memory: refuse what cannot be a valid request
    # before that.
    app.add_middleware(BodyLimit, max_bytes=body_limit(front))
    return app


def body_limit(front: FrontDoor) -> int:
    """The largest request body ``front`` reads: the largest images it may carry,
    base64-encoded, plus room for the other fields."""
    images = front.server.max_input_images if task_spec(front.pipeline).multi_image else 1
    return images * ((front.server.max_image_bytes + 2) // 3 * 4) + (2 << 20)
