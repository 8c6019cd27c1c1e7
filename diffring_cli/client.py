"""A front-door client over HTTP: post a task, follow it, fetch its result.

Progress comes from the task's server-sent events (``GET /v1/tasks/{id}/events``, read with
``httpx-sse``): the bar moves on every denoising step and the stage name is its description.
A stream that drops before the task is over (a controller restart) is opened again — its
first event is the task's current status, so nothing is missed — and a controller without
the events route is polled instead. Used by ``diffring submit`` and the request scripts
(``scripts/post/post_*.py``). Talks HTTP only: it imports nothing of the services.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from httpx_sse import SSEError, connect_sse

MAX_IMAGE_BYTES = 32 << 20  # the front door's limit (controller/http/schemas.py)
TERMINAL = ("completed", "failed", "cancelled")
RECONNECT_S = 0.5


class RequestFailed(Exception):
    """The server refused or failed the task; the message is the server's."""


def encode_image(path: Path, flag: str = "--image") -> str:
    """An input image file as base64 (what ``image_path`` takes)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise RequestFailed(f"cannot read {flag} {path}: {exc.strerror}") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise RequestFailed(f"{flag} {path} is {len(data)} bytes; the limit is {MAX_IMAGE_BYTES}")
    return base64.b64encode(data).decode("ascii")


def detail(r: httpx.Response) -> str:
    try:
        body = r.json()
        message = body.get("detail") if isinstance(body, dict) else None
    except (ValueError, AttributeError):
        message = None
    return f"HTTP {r.status_code}: {message if message is not None else r.text.strip()}"


def submit(client: httpx.Client, kind: str, body: dict[str, Any]) -> str:
    """POST /v1/tasks/{kind}/; the task id."""
    r = client.post(f"/v1/tasks/{kind}/", json=body)
    if r.status_code != 200:
        raise RequestFailed(f"the controller refused the task: {detail(r)}")
    task_id: str = r.json()["task_id"]
    return task_id


def answer(r: httpx.Response, what: str) -> dict[str, Any]:
    """The JSON body of a 200; else :class:`RequestFailed` naming ``what`` was asked."""
    if r.status_code != 200:
        raise RequestFailed(f"{what}: {detail(r)}")
    out: dict[str, Any] = r.json()
    return out


def status(client: httpx.Client, task_id: str) -> dict[str, Any]:
    return answer(client.get(f"/v1/tasks/{task_id}/status"), f"status of task {task_id}")


SMALL_REQUESTS: dict[str, dict[str, Any]] = {
    "wan_t2v": {"height": 32, "width": 32, "target_video_length": 9, "infer_steps": 4,
                "target_fps": 8},
    "wan_i2v": {"height": 32, "width": 32, "target_video_length": 9, "infer_steps": 4,
                "target_fps": 8},
    "qwen_t2i": {"height": 64, "width": 64, "infer_steps": 4},
    "qwen_i2i": {"height": 32, "width": 32, "infer_steps": 4},
    "qwen_i2i_plus": {"height": 32, "width": 32, "infer_steps": 4},
    "synthetic": {"height": 64, "width": 64, "infer_steps": 4},
}
# Wan2.2: A14B's 3 steps cross its boundary (both experts run); TI2V-5B's VAE compresses 16x.
for _task, _side in (("a14b_t2v", 32), ("a14b_i2v", 32), ("5b_t2v", 64), ("5b_i2v", 64)):
    SMALL_REQUESTS[f"wan22_{_task}"] = {"height": _side, "width": _side,
                                        "target_video_length": 9, "infer_steps": 3,
                                        "target_fps": 8}
"""A small request per pipeline (``--small``; the demo's): a few steps at a tiny size, done in
seconds on the tiny random-weight models of ``python -m modelkit.tiny`` on a CPU. The
defaults (50 steps, 480x832x81 for Wan) take over 20 minutes there."""

LINE_EVERY_S = 5.0
"""Without a terminal, a denoising step is written at most this often (stage changes, the
first and the last step always)."""


class Progress:
    """A tqdm bar over the denoising steps, the stage name its description; without a
    terminal on stderr (a pipe, a log file, a CI job), plain lines instead: one per stage
    change and a denoising step every :data:`LINE_EVERY_S` seconds, so a long request is
    never silent."""

    def __init__(self, task_id: str, quiet: bool) -> None:
        from tqdm import tqdm

        self.lines = not quiet and not sys.stderr.isatty()
        self.bar = tqdm(
            total=None,
            desc="queued",
            unit="step",
            disable=True if quiet or self.lines else None,
            file=sys.stderr,
            dynamic_ncols=True,
        )
        self.task_id = task_id
        self.attempt = 1
        self.stage = "queued"
        self.updates = 0
        self.said: tuple[str, int] | None = None
        self.said_at = 0.0

    def update(self, st: dict[str, Any]) -> None:
        if self.lines:
            self._line(st)
            return
        self._bar(st)

    def _line(self, st: dict[str, Any]) -> None:
        stage = str(st.get("stage") or st.get("status") or "?")
        step, steps = int(st.get("step") or 0), int(st.get("steps") or 0)
        attempt = int(st.get("attempt") or 1)
        now = time.monotonic()
        if self.said is not None and self.said[0] == stage and attempt == self.attempt:
            if stage != "denoising" or step == self.said[1]:
                return
            if step not in (1, steps) and now - self.said_at < LINE_EVERY_S:
                return
        self.attempt = attempt
        self.said, self.said_at = (stage, step), now
        if stage == "denoising" and steps:
            what = f"denoising step {step}/{steps}"
        else:
            what = stage
        waiting = st.get("waiting_for")
        if waiting:
            pos = st.get("queue_position")
            what += f", waiting for {waiting}" + (f" (position {pos})" if pos else "")
        if attempt > 1:
            what += f" (attempt {attempt})"
        print(f"task {self.task_id}: {what}", file=sys.stderr, flush=True)

    def _bar(self, st: dict[str, Any]) -> None:
        self.updates += 1
        stage = str(st.get("stage") or st.get("status") or "?")
        steps = int(st.get("steps") or 0)
        step = int(st.get("step") or 0)
        attempt = int(st.get("attempt") or 1)
        if attempt != self.attempt:  # requeued: the steps start over on another worker
            self.attempt = attempt
            self.bar.write(f"task {self.task_id} was requeued (attempt {attempt})")
            self.bar.reset(total=steps or None)
        elif stage == "denoising" and self.stage != "denoising":
            self.bar.reset(total=steps or None)  # the step rate counts from here
        self.stage = stage
        if steps and self.bar.total != steps:
            self.bar.total = steps
        if stage in ("phase2", "decoding", "completed") and self.bar.total:
            step = int(self.bar.total)
        if step != self.bar.n:
            self.bar.n = step
        pos = st.get("queue_position")
        self.bar.set_postfix_str(f"queue position {pos}" if pos else "", refresh=False)
        desc = stage if attempt == 1 else f"{stage} (attempt {attempt})"
        self.bar.set_description_str(desc, refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


class NoEvents(Exception):
    """The controller has no events route (an older one): poll instead."""


def events(client: httpx.Client, task_id: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(name, data) of one connection to the task's event stream, until it ends."""
    with connect_sse(client, "GET", f"/v1/tasks/{task_id}/events") as source:
        r = source.response
        if r.status_code == 404 and "no task" not in r.read().decode(errors="replace"):
            raise NoEvents()
        if r.status_code != 200:
            r.read()
            raise RequestFailed(f"events of task {task_id}: {detail(r)}")
        for sse in source.iter_sse():
            if sse.event and sse.data:
                yield sse.event, json.loads(sse.data)


def follow(client: httpx.Client, task_id: str, timeout: float, quiet: bool = False,
           poll_interval: float = 0.5) -> dict[str, Any]:
    """Show the task's progress until it is over; its final state (status fields, plus
    ``result_url`` when completed)."""
    progress = Progress(task_id, quiet)
    deadline = time.monotonic() + timeout
    state: dict[str, Any] = {"task_id": task_id}
    try:
        while True:
            try:
                for name, data in events(client, task_id):
                    state.update(data)
                    progress.update(state)
                    if name in TERMINAL:
                        return state
                    if time.monotonic() > deadline:
                        break
            except NoEvents:
                return _poll(client, task_id, deadline, poll_interval, progress, timeout)
            except (httpx.TransportError, SSEError):
                pass  # the stream dropped: the status below says whether to reconnect
            if time.monotonic() > deadline:
                raise RequestFailed(
                    f"task {task_id} still {state.get('stage')} after {timeout:g} s; it goes "
                    f"on on the server: GET /v1/tasks/{task_id}/status"
                )
            time.sleep(RECONNECT_S)
            try:
                st = status(client, task_id)
            except httpx.TransportError:
                continue  # the controller is restarting: try the stream again
            state.update(st)
            progress.update(state)
            if st.get("status") in TERMINAL:
                return state
    finally:
        progress.close()


def _poll(client: httpx.Client, task_id: str, deadline: float, interval: float,
          progress: Progress, timeout: float) -> dict[str, Any]:
    while True:
        st = status(client, task_id)
        progress.update(st)
        if st.get("status") in TERMINAL:
            return st
        if time.monotonic() > deadline:
            raise RequestFailed(
                f"task {task_id} still {st.get('stage')} after {timeout:g} s; it goes on "
                f"on the server: GET /v1/tasks/{task_id}/status"
            )
        time.sleep(interval)


def download(client: httpx.Client, task_id: str, out: Path | None) -> Path:
    """Save the result (default ``<task_id>.png`` / ``.mp4`` here); never half-written."""
    with client.stream("GET", f"/v1/tasks/{task_id}/result") as r:
        if r.status_code != 200:
            r.read()
            raise RequestFailed(f"result of task {task_id}: {detail(r)}")
        if out is None:
            ext = ".mp4" if "video" in r.headers.get("content-type", "") else ".png"
            out = Path(f"{task_id}{ext}")
        out.parent.mkdir(parents=True, exist_ok=True)
        part = out.with_name(out.name + ".part")
        with part.open("wb") as f:
            for chunk in r.iter_bytes():
                f.write(chunk)
        os.replace(part, out)
    return out.resolve()


def connect(url: str, api_key: str | None = None) -> httpx.Client:
    """A client of the front door at ``url``; ``api_key``: the front door's, if it has one
    (sent as ``Authorization: Bearer``)."""
    http_timeout = httpx.Timeout(30.0, read=120.0)  # events ping every 15 s
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.Client(base_url=url.rstrip("/"), timeout=http_timeout, trust_env=False,
                        headers=headers)


def served_pipeline(client: httpx.Client) -> str:
    """The pipeline the controller serves (``GET /v1/service/status``)."""
    return str(answer(client.get("/v1/service/status"), "service status")["pipeline"])


def cancel(client: httpx.Client, task_id: str) -> dict[str, Any]:
    """``DELETE /v1/tasks/{id}``: ``{stop_status, reason}``."""
    out = answer(client.delete(f"/v1/tasks/{task_id}"), f"cancel task {task_id}")
    if out.get("stop_status") == "error":
        raise RequestFailed(str(out.get("reason")))
    return out


def list_tasks(client: httpx.Client, **params: Any) -> dict[str, Any]:
    """``GET /v1/tasks/`` with ``params`` (status, offset, limit, order)."""
    return answer(client.get("/v1/tasks/", params={k: v for k, v in params.items()
                                                    if v is not None}), "task list")


def run_task(url: str, kind: str, body: dict[str, Any], out: Path | None, timeout: float,
             quiet: bool = False, poll_interval: float = 0.5, api_key: str | None = None
             ) -> Path:
    """Post, follow, download: the path of the result file."""
    with connect(url, api_key) as client:
        task_id = submit(client, kind, body)
        print(f"task {task_id} accepted by {url}", file=sys.stderr, flush=True)
        try:
            st = follow(client, task_id, timeout, quiet, poll_interval)
        except KeyboardInterrupt:
            print(
                f"\ninterrupted; task {task_id} goes on on the server. Cancel it with:\n"
                f"  curl -X DELETE {url.rstrip('/')}/v1/tasks/{task_id}",
                file=sys.stderr,
            )
            raise
        if st.get("status") != "completed":
            kind_ = f" ({st['error_type']})" if st.get("error_type") else ""
            raise RequestFailed(
                f"task {task_id} {st.get('status')} at stage {st.get('stage')}{kind_}: "
                f"{st.get('error') or 'no error message'}"
            )
        return download(client, task_id, out)
