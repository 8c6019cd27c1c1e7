"""The seed's per-stage API ports, for LightX2V's request scripts as they are.

With ``server.lightx2v_ports`` set (``{"encoder": 8002, "transformer": 8003, "decoder":
8006}``, the seed's table by default when the launcher opens them), the controller answers
on each of those ports too. A ``POST /v1/tasks/{video,image}/`` there is one POST of
LightX2V's three-POST flow (:mod:`controller.http.lightx2v_flows` pairs them): the Decoder's
opens the flow and answers with the task id, the Transformer's is counted, the Encoder's
makes the task through the front door, like any other request. ``GET
/v1/tasks/{id}/status`` of a flow not yet a task answers from the flow (pending, or failed
with why); every other route, and the status of a task, is the front door's own. An Encoder
POST that no flow waits for is a task of its own, so the encoder's port may be the front
door's (LightX2V's clients post there; so do diffring's).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from controller.http.auth import api_key_guard
from controller.http.bodies import BodyLimit
from controller.http.frontdoor import FrontDoor
from controller.http.lightx2v_flows import Flow, FlowTable, Refused, clean
from controller.http.schemas import ImageTaskRequest, VideoTaskRequest


class LightX2VEdge:
    """The flows of one controller, and the application of each of its stage ports."""

    def __init__(self, front: FrontDoor, front_app: Any, window_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.front = front
        self.front_app = front_app
        self.flows = FlowTable(window_s)
        self.clock = clock

    def app(self, role: str, body_limit: int) -> FastAPI:
        """The application of ``role``'s port: the flow's POST and status, the front door's
        application for everything else."""
        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
        router = APIRouter(dependencies=api_key_guard(self.front.server.api_key))

        async def post(kind: str, request: Request) -> Response:
            return await self.post(role, kind, request)

        for kind in ("video", "image"):
            router.add_api_route(f"/v1/tasks/{kind}/", _bind(post, kind), methods=["POST"])

        async def status(task_id: str) -> Response:
            found = self.flows.status(task_id, self.clock())
            if found is None:  # a task: the front door answers
                return await self._front_status(task_id)
            return JSONResponse(found)

        router.add_api_route("/v1/tasks/{task_id}/status", status, methods=["GET"])
        app.include_router(router)
        app.mount("/", self.front_app)
        app.add_middleware(BodyLimit, max_bytes=body_limit)
        return app

    async def post(self, role: str, kind: str, request: Request) -> Response:
        try:
            payload = json.loads(await request.body() or b"{}")
        except ValueError as exc:
            return _error(422, f"the body is not JSON: {exc}")
        if not isinstance(payload, dict):
            return _error(422, "the body must be a JSON object")
        now = self.clock()
        try:
            if role == "decoder":
                _check_fields(kind, payload)
                return _created(self.flows.decoder_post(kind, payload, now))
            if role == "transformer":
                if payload:
                    _check_fields(kind, payload)
                return _created(self.flows.transformer_post(kind, payload, now))
            flow = self.flows.encoder_post(kind, payload, now)
        except Refused as exc:
            return _error(exc.status, exc.detail)
        body = dict(payload) if flow is None else {**payload, "task_id": flow.task_id}
        try:
            model = (VideoTaskRequest if kind == "video" else ImageTaskRequest)(**body)
            task = await self.front.create_task(model, kind)
        except ValidationError as exc:
            return self._failed(flow, 422, _validation(exc))
        except HTTPException as exc:  # the front door's refusal: the flow fails with it
            return self._failed(flow, exc.status_code, str(exc.detail),
                                None if exc.headers is None else dict(exc.headers))
        except BaseException as exc:
            if flow is not None:  # its poll says so, rather than waiting out the window
                self.flows.fail(flow, f"internal error ({type(exc).__name__}: {exc})",
                                self.clock())
            raise
        if flow is not None:
            self.flows.made(flow)
        return JSONResponse(self.front.created(task))

    def _failed(self, flow: Flow | None, status: int, detail: str,
                headers: dict[str, str] | None = None) -> Response:
        if flow is not None:
            self.flows.fail(flow, detail, self.clock())
        return _error(status, detail, headers)

    async def _front_status(self, task_id: str) -> Response:
        try:
            return JSONResponse(self.front.status(await self.front.get(task_id)))
        except HTTPException as exc:
            return _error(exc.status_code, str(exc.detail))


def _bind(fn: Callable[[str, Request], Any], kind: str) -> Callable[[Request], Any]:
    async def handler(request: Request) -> Response:
        result: Response = await fn(kind, request)
        return result
    return handler


def _check_fields(kind: str, payload: dict[str, Any]) -> None:
    """A partial payload (the Decoder's, the Transformer's) checked field by field as the
    Encoder's will be, so that a bad one is refused at its first POST."""
    probe = {**clean(payload), "prompt": payload.get("prompt") or "check"}
    try:
        (VideoTaskRequest if kind == "video" else ImageTaskRequest)(**probe)
    except ValidationError as exc:
        raise Refused(422, _validation(exc)) from None


def _validation(exc: ValidationError) -> str:
    problems = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()))
        problems.append(f"unknown field {loc!r}" if err.get("type") == "extra_forbidden"
                        else f"{loc}: {err.get('msg')}")
    return "; ".join(problems)


def _created(flow: Flow) -> Response:
    return JSONResponse({"task_id": flow.task_id, "task_status": "pending",
                         "save_result_path": flow.decoder.get("save_result_path", "")})


def _error(status: int, detail: str, headers: dict[str, str] | None = None) -> Response:
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)
