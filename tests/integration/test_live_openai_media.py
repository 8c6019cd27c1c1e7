"""OpenAI's image edits and video jobs driven by the real ``openai`` package against live
groups: Qwen Edit (images.edit), Wan T2V (videos.create / retrieve / poll / download_content
/ delete); Wan I2V needs no workers (a controller alone shows the input reference reaching
the task). One group per class, started and stopped by pid."""

from __future__ import annotations

import base64
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from launcher import LocalGroup, wait_task
from tests.support.groups import start_group
from tests.support.http import openai_client, png

warnings.filterwarnings("ignore", category=DeprecationWarning, module="openai")
pytestmark = [  # starts processes or servers
    pytest.mark.integration, pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]
SMALL = {"infer_steps": 2}


# -- OpenAI image edits (I2I) -----------------------------------------------------------------
class TestEdits:
    @pytest.fixture(scope="class")
    def i2i(self, tiny_models: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[LocalGroup]:
        with start_group("qwen_i2i", tiny_models, tmp_path_factory.mktemp("live-i2i")) as g:
            yield g

    def test_images_edit(self, i2i: LocalGroup, input_png: bytes) -> None:
        group = i2i
        oc = openai_client(group.url)
        r = oc.images.edit(image=("in.png", input_png, "image/png"), prompt="make it blue",
                           size="32x32", extra_body={"seed": 1, **SMALL})
        data = r.data or []
        assert len(data) == 1 and png(base64.b64decode(data[0].b64_json or "")).size == (32, 32)
        with pytest.raises(openai.BadRequestError) as bad:
            oc.images.edit(image=("in.png", input_png, "image/png"), prompt="x",
                           mask=("m.png", input_png, "image/png"))
        assert bad.value.body["param"] == "mask"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as bad:
            oc.images.edit(image=("in.png", b"not an image", "image/png"), prompt="x")
        assert "image does not decode" in bad.value.message
        with pytest.raises(openai.BadRequestError) as bad:
            oc.images.generate(prompt="x")
        assert "/v1/images/edits" in bad.value.message


# -- OpenAI video jobs (T2V; I2V on a controller alone) -----------------------------------------
class TestVideos:
    @pytest.fixture(scope="class")
    def t2v(self, tiny_models: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[LocalGroup]:
        with start_group("wan_t2v", tiny_models, tmp_path_factory.mktemp("live-t2v")) as g:
            yield g

    def test_video_job_lifecycle(self, t2v: LocalGroup) -> None:
        group = t2v
        oc = openai_client(group.url)
        job = oc.videos.create(prompt="a tiny wave", size="32x32", seconds="1",  # type: ignore[arg-type]
                               extra_body={"fps": 4, "seed": 5, **SMALL})
        assert job.object == "video" and job.status in ("queued", "in_progress")
        assert job.id.startswith("video_") and job.created_at > 0 and job.size == "32x32"
        done = oc.videos.poll(job.id, poll_interval_ms=200)
        assert done.status == "completed" and done.progress == 100, done
        assert done.seconds == "1" and done.model == "wan_t2v" and done.completed_at
        # The job is an ordinary task: the task API sees it (5 frames = 1 s at 4 fps).
        st = httpx.get(f"{group.url}/v1/tasks/{job.id}/status").json()
        assert st["status"] == "completed"
        mp4 = oc.videos.download_content(job.id).content
        assert mp4[4:8] == b"ftyp"
        poster = oc.videos.download_content(job.id, variant="thumbnail").content
        assert png(poster).size == (32, 32)
        gone = oc.videos.delete(job.id)
        assert gone.deleted and gone.id == job.id and gone.object == "video.deleted"
        with pytest.raises(openai.NotFoundError):
            oc.videos.retrieve(job.id)
        with pytest.raises(openai.NotFoundError):
            oc.videos.download_content(job.id)

    def test_delete_cancels_a_running_job(self, t2v: LocalGroup) -> None:
        group = t2v
        oc = openai_client(group.url)
        job = oc.videos.create(prompt="a long one", size="32x32",  # type: ignore[arg-type]
                               extra_body={"num_frames": 5, "fps": 4, "infer_steps": 400})
        deadline = time.monotonic() + 120
        while oc.videos.retrieve(job.id).status != "in_progress":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        with pytest.raises(openai.NotFoundError) as early:
            oc.videos.download_content(job.id)
        assert "no content yet" in early.value.message
        assert oc.videos.delete(job.id).deleted
        st = wait_task(group.url, job.id, timeout=120)
        assert st["status"] == "cancelled" and st["step"] < 400

    def test_video_errors(self, t2v: LocalGroup, input_png: bytes) -> None:
        group = t2v
        oc = openai_client(group.url)
        with pytest.raises(openai.BadRequestError) as bad:
            oc.videos.create(prompt="x", input_reference=("in.png", input_png, "image/png"))
        assert bad.value.body["param"] == "input_reference"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as bad:
            oc.videos.create(prompt="x", seconds="4",  # type: ignore[arg-type]
                             extra_body={"num_frames": 5})
        assert "seconds or num_frames" in bad.value.message
        with pytest.raises(openai.NotFoundError):
            oc.videos.retrieve("video_nope")

    def test_i2v_input_reference_reaches_the_task(self, tiny_models: Path, input_png: bytes,
                                                  tmp_path: Path) -> None:
        with start_group("wan_i2v", tiny_models, tmp_path, workers=()) as group:
            oc = openai_client(group.url)
            job = oc.videos.create(prompt="it moves", size="32x32", seconds="1",  # type: ignore[arg-type]
                                   input_reference=("in.png", input_png, "image/png"),
                                   extra_body={"fps": 4})
            assert job.status == "queued"
            st = httpx.get(f"{group.url}/v1/tasks/{job.id}/status").json()
            assert st["stage"] == "queued"
            with pytest.raises(openai.BadRequestError) as bad:
                oc.videos.create(prompt="x")
            assert "needs an input image" in bad.value.message
            data_url = "data:image/png;base64," + base64.b64encode(input_png).decode()
            r = httpx.post(f"{group.url}/v1/videos", json={
                "prompt": "as JSON", "size": "32x32", "num_frames": 5,
                "input_reference": {"image_url": data_url}}, timeout=30)
            assert r.status_code == 200 and r.json()["status"] == "queued", r.text
            for vid in (job.id, r.json()["id"]):
                assert oc.videos.delete(vid).deleted
