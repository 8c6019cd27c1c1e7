"""The front door in-process (no workers, no rings): status that tells the truth (waiting
for a DiT or a decoder is pending, with a queue position), the queue by role and the counts
by stage, the list newest first, and the API's edges (steps and sizes per pipeline, a result
file two live tasks would share, the OpenAI routes' 4xx shape, videos.list, no retried
failures) and the API docs served from installed files."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from contracts.config import ServerConfig
from contracts.roles import Role
from controller.app import LocalQueue
from controller.http.events import task_event
from controller.http.frontdoor import FrontDoor
from controller.http.webapp import build_app
from controller.tasks.tasks import Stage, Task
from tests.support.coordinators import make_coordinator

# The openai package marks the video calls deprecated (the hosted API's schedule).
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
SMALL = {"height": 32, "width": 32, "infer_steps": 2}


def open_client(tmp_path: Path, pipeline: str) -> Iterator[TestClient]:
    co = make_coordinator(tmp_path, LocalQueue(64, 4096), pipeline=pipeline, max_pending=64)
    front = FrontDoor(co, status_extra=lambda: {}, service="controller", server=ServerConfig())
    with TestClient(build_app(front)) as c:
        c.front = front  # type: ignore[attr-defined]
        yield c
    front.close()


@pytest.fixture
def t2i(tmp_path: Path) -> Iterator[TestClient]:
    yield from open_client(tmp_path, "qwen_t2i")


@pytest.fixture
def t2v(tmp_path: Path) -> Iterator[TestClient]:
    yield from open_client(tmp_path, "wan_t2v")


def task(c: TestClient, task_id: str) -> Task:
    t = c.front.co.table.get(task_id)  # type: ignore[attr-defined]
    assert t is not None
    return t


def post(c: TestClient, kind: str = "image", **body: Any) -> httpx.Response:
    return c.post(f"/v1/tasks/{kind}/", json={"prompt": "p", **SMALL, **body})


def claim(c: TestClient, task_id: str, role: Role, worker_id: int) -> None:
    t = task(c, task_id)
    ok, why = c.front.co.table.claim(  # type: ignore[attr-defined]
        task_id, t.attempt, role, f"{role.value}-{worker_id}", worker_id, time.monotonic() + 60)
    assert ok, why


def status(c: TestClient, task_id: str) -> dict[str, Any]:
    st: dict[str, Any] = c.get(f"/v1/tasks/{task_id}/status").json()
    return st


# -- status that tells the truth ---------------------------------------------------------------
def test_a_task_waiting_for_the_dit_is_pending_with_its_place(t2i: TestClient) -> None:
    """Three tasks encoded, one DiT: one is processing, two wait for the transformer at
    places 1 and 2 (it used to read three "processing", queue_position null)."""
    table = t2i.front.co.table  # type: ignore[attr-defined]
    for i in range(4):
        assert post(t2i, task_id=f"s{i}").status_code == 200
    for i in range(3):  # s0..s2 encoded, handed to the phase1 ring; s3 still queued
        claim(t2i, f"s{i}", Role.ENCODER, 1)
        table.handoff(task(t2i, f"s{i}"), Role.ENCODER)
    claim(t2i, "s0", Role.TRANSFORMER, 2)  # the one DiT takes s0

    st = status(t2i, "s0")
    assert (st["status"], st["stage"], st["waiting_for"], st["queue_position"]) == (
        "processing", "denoising", None, None)
    for place, tid in enumerate(("s1", "s2"), 1):
        st = status(t2i, tid)
        assert (st["status"], st["stage"], st["waiting_for"], st["queue_position"]) == (
            "pending", "phase1", "transformer", place)
    st = status(t2i, "s3")
    assert (st["status"], st["waiting_for"], st["queue_position"]) == ("pending", "encoder", 1)
    # The events say it too (what `diffring submit`'s progress lines print).
    assert task_event("stage", task(t2i, "s1"))["waiting_for"] == "transformer"
    assert task_event("progress", task(t2i, "s0"))["waiting_for"] is None

    q = t2i.get("/v1/tasks/queue/status").json()
    assert q["running"] == ["s0"] and q["processing"] == 1 and q["pending"] == 3
    assert q["waiting"] == {"encoder": ["s3"], "transformer": ["s1", "s2"], "decoder": []}
    assert q["running_by_role"] == {"encoder": [], "transformer": ["s0"], "decoder": []}
    assert q["stages"]["phase1"] == 2 and q["stages"]["denoising"] == 1
    service = t2i.get("/v1/service/status").json()
    assert service["counts"]["pending"] == 3 and service["counts"]["processing"] == 1
    assert service["stages"] == q["stages"]

    # Past the DiT, a task waits for a decoder: pending again, first in the decoders' queue.
    table.handoff(task(t2i, "s0"), Role.TRANSFORMER)
    st = status(t2i, "s0")
    assert (st["status"], st["stage"], st["waiting_for"], st["queue_position"]) == (
        "pending", "phase2", "decoder", 1)


def test_a_higher_priority_task_is_ahead_in_its_queue(t2i: TestClient) -> None:
    assert post(t2i, task_id="low-1", priority="low").status_code == 200
    assert post(t2i, task_id="high-1", priority="high").status_code == 200
    assert post(t2i, task_id="norm-1").status_code == 200
    # release_ahead holds tasks in "accepted" past the ring's first few: those are ordered
    # by class; the ones already in the ring keep the ring's order ahead of them.
    ids = t2i.get("/v1/tasks/queue/status").json()["waiting"]["encoder"]
    in_ring = [i for i in ids if task(t2i, i).stage == Stage.QUEUED]
    held = [i for i in ids if task(t2i, i).stage == Stage.ACCEPTED]
    assert ids == in_ring + held
    ranks = {"low-1": 0, "norm-1": 1, "high-1": 2}
    assert [ranks[i] for i in held] == sorted((ranks[i] for i in held), reverse=True)


def test_the_list_is_newest_first_unless_asked(t2i: TestClient) -> None:
    for i in range(4):
        assert post(t2i, task_id=f"n{i}").status_code == 200
    newest = t2i.get("/v1/tasks/", params={"limit": 2}).json()
    assert newest["order"] == "newest" and [t["task_id"] for t in newest["tasks"]] == ["n3", "n2"]
    oldest = t2i.get("/v1/tasks/", params={"limit": 2, "order": "oldest"}).json()
    assert [t["task_id"] for t in oldest["tasks"]] == ["n0", "n1"]
    assert [t["queue_position"] for t in oldest["tasks"]] == [1, 2]
    assert t2i.get("/v1/tasks/", params={"order": "sideways"}).status_code == 422


# -- the API's edges ----------------------------------------------------------------------------
def test_steps_the_scheduler_cannot_run_are_refused_at_the_door(t2i: TestClient) -> None:
    """Qwen-Image's scheduler makes NaN timesteps from one step: refused with 422 on the
    task API, 400 in OpenAI's shape (never a 500, which the openai client would retry)."""
    r = post(t2i, infer_steps=1)
    assert r.status_code == 422 and "infer_steps must be at least 2" in r.json()["detail"]
    assert post(t2i, infer_steps=2).status_code == 200
    oc = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=t2i,
                       max_retries=2)
    with pytest.raises(openai.BadRequestError) as err:
        oc.images.generate(prompt="p", size="32x32", extra_body={"infer_steps": 1})
    assert "infer_steps must be at least 2" in err.value.message
    assert len(t2i.front.co.table) == 1  # type: ignore[attr-defined]  # no task was made


def test_sizes_past_the_pipeline_are_refused(t2v: TestClient) -> None:
    r = post(t2v, "video", height=4096, width=4096, target_video_length=5)
    assert r.status_code == 422 and "4096" in r.json()["detail"]
    r = post(t2v, "video", height=1920, width=1920, target_video_length=5)
    assert r.status_code == 422 and "megapixels" in r.json()["detail"]
    assert post(t2v, "video", height=720, width=1280, target_video_length=5).status_code == 200


def test_a_result_file_two_live_tasks_would_share_is_refused(t2i: TestClient) -> None:
    assert post(t2i, task_id="w1", save_result_path="same.png").status_code == 200
    r = post(t2i, task_id="w2", save_result_path="same.png")
    assert r.status_code == 409 and "w1" in r.json()["detail"]
    assert t2i.delete("/v1/tasks/w1").json()["stop_status"] == "success"
    assert post(t2i, task_id="w3", save_result_path="same.png").status_code == 200


def test_videos_list_and_unknown_methods_in_openai_shape(t2v: TestClient) -> None:
    oc = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=t2v,
                       max_retries=0)
    for i in range(3):
        assert post(t2v, "video", task_id=f"v{i}", target_video_length=5).status_code == 200
    first = oc.videos.list(limit=2)
    assert [v.id for v in first.data] == ["v2", "v1"] and first.has_more
    assert [v.status for v in first.data] == ["queued", "queued"]
    assert [v.id for v in oc.videos.list(limit=2, after="v1").data] == ["v0"]
    assert [v.id for v in oc.videos.list(order="asc").data] == ["v0", "v1", "v2"]
    assert [v.id for v in oc.videos.list()] == ["v2", "v1", "v0"]  # the client's own paging
    oc.videos.delete("v1")
    assert [v.id for v in oc.videos.list().data] == ["v2", "v0"]
    r = t2v.put("/v1/videos")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    r = t2v.get("/v1/images/nowhere")
    assert r.status_code == 404 and "message" in r.json()["error"]
    assert t2v.put("/v1/tasks/video/").json()["detail"]  # the task API keeps its own shape


def test_a_failed_image_task_is_not_retried_by_the_openai_client(t2i: TestClient) -> None:
    """A task that fails in a worker answers 500 with ``x-should-retry: false``: the client
    raises at once instead of posting it twice more."""
    front: FrontDoor = t2i.front  # type: ignore[attr-defined]
    table = front.co.table
    real = front.co.submit

    def fail_at_once(t: Task) -> None:
        real(t)
        table.failed(t, "the DiT ran out of memory", "worker_error")

    front.co.submit = fail_at_once  # type: ignore[method-assign]
    oc = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=t2i,
                       max_retries=2)
    with pytest.raises(openai.InternalServerError) as err:
        oc.images.generate(prompt="p", size="32x32", extra_body={"infer_steps": 2})
    assert err.value.response.headers["x-should-retry"] == "false"
    assert table.counts()["failed"] == 1  # one task, not three


# -- the API docs, from installed files -----------------------------------------------------------
@pytest.mark.parametrize("path", ["/docs", "/redoc"])
def test_api_docs_name_only_local_assets(t2i: TestClient, path: str) -> None:
    html = t2i.get(path).text
    urls = re.findall(r"""(?:src|href|url)\s*[=:]\s*['"]([^'"]+)['"]""", html)
    assert urls and all(u.startswith("/") for u in urls), urls
    assert "cdn" not in html and "googleapis" not in html
    for url in urls:
        if url != "/openapi.json":
            r = t2i.get(url)
            assert r.status_code == 200 and len(r.content) > 1000, url
