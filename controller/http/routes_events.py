"""Server-sent event streams of task progress (:mod:`controller.http.events` has the event names).

``GET /v1/tasks/{id}/events`` starts with the task's current status, then sends every stage
change, denoising step and the terminal event (completion carries the result URL), and
ends when the task is over. ``GET /v1/events`` sends the events of every task and does not
end by itself (the status page listens to it).

Streams are served by ``sse-starlette`` (keep-alive comments every :data:`PING_S` seconds,
client disconnects noticed), fed by the front door's :class:`~controller.http.events.EventHub`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from sse_starlette import EventSourceResponse

from controller.http.events import TERMINAL_EVENTS, Subscriber, terminal_event
from controller.http.routes import Front
from controller.tasks.tasks import TERMINAL

PING_S = 15.0
router = APIRouter()


def _absolute(base: str, data: dict[str, Any]) -> dict[str, Any]:
    """Event data with its URLs made absolute, so clients can fetch them as they are."""
    out = dict(data)
    for key in ("result_url", "thumbnail_url"):
        if isinstance(out.get(key), str) and out[key].startswith("/"):
            out[key] = base + out[key]
    return out


def _sse(seq: int, name: str, data: dict[str, Any], base: str) -> dict[str, Any]:
    event = {"event": name, "data": json.dumps(_absolute(base, data))}
    if seq:
        event["id"] = str(seq)
    return event


async def _drain(sub: Subscriber, base: str, stop_at_terminal: bool
                 ) -> AsyncIterator[dict[str, Any]]:
    async for seq, name, data in sub.events():
        yield _sse(seq, name, data, base)
        if name == "lagged" or (stop_at_terminal and name in TERMINAL_EVENTS):
            return


@router.get(
    "/v1/tasks/{task_id}/events",
    response_class=EventSourceResponse,
    responses={200: {"content": {"text/event-stream": {}}}},
)
async def task_events(task_id: str, request: Request, front: Front) -> EventSourceResponse:
    task = await front.get(task_id)  # 404 before the stream starts
    hub = front.events
    base = str(request.base_url).rstrip("/")
    # Subscribe and take the snapshot together (no await in between): every buffered event
    # is then newer than the snapshot.
    sub = hub.subscribe(task_id)
    snapshot = front.status(task)
    snapshot["result_url"] = f"/v1/tasks/{task_id}/result" if task.result_path else None
    closing = terminal_event(task) if task.stage in TERMINAL else None

    async def stream() -> AsyncIterator[dict[str, Any]]:
        try:
            yield _sse(0, "status", snapshot, base)
            if closing is not None:
                yield _sse(0, closing[0], closing[1], base)
                return
            async for event in _drain(sub, base, stop_at_terminal=True):
                yield event
        finally:
            hub.unsubscribe(sub)

    return EventSourceResponse(stream(), ping=PING_S)


@router.get(
    "/v1/events",
    response_class=EventSourceResponse,
    responses={200: {"content": {"text/event-stream": {}}}},
)
async def all_events(request: Request, front: Front) -> EventSourceResponse:
    hub = front.events
    base = str(request.base_url).rstrip("/")
    sub = hub.subscribe(None)

    async def stream() -> AsyncIterator[dict[str, Any]]:
        try:
            async for event in _drain(sub, base, stop_at_terminal=False):
                yield event
        finally:
            hub.unsubscribe(sub)

    return EventSourceResponse(stream(), ping=PING_S)
