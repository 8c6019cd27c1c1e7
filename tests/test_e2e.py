"""End to end: HTTP in, separate encoder / transformer / decoder processes, files out.

Every group is started and stopped here by pid (controller.group.LocalGroup).
"""

from __future__ import annotations

import base64
import io
import os
import shutil
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from controller.group import LocalGroup, group_config, submit, wait_task
from tests.conftest import wait_log

pytestmark = pytest.mark.integration  # starts processes or servers

REQUESTS: dict[str, dict[str, Any]] = {
    "wan_t2v": {"height": 32, "width": 32, "target_video_length": 5, "infer_steps": 2,
                "target_fps": 8},
    "wan_i2v": {"height": 32, "width": 32, "target_video_length": 5, "infer_steps": 2,
                "target_fps": 8},
    "qwen_t2i": {"height": 32, "width": 48, "infer_steps": 2},
    "qwen_i2i": {"height": 32, "width": 32, "infer_steps": 2},
}
KIND = {"wan_t2v": "video", "wan_i2v": "video", "qwen_t2i": "image", "qwen_i2i": "image"}


def body(pipeline: str, image: bytes | None, seed: int = 7, **extra: Any) -> dict[str, Any]:
    out = {"prompt": f"a tiny test of {pipeline}", "seed": seed, **REQUESTS[pipeline], **extra}
    if pipeline in ("wan_i2v", "qwen_i2i"):
        assert image is not None
        out["image_path"] = base64.b64encode(image).decode()
    return out


def pixels(data: bytes, extension: str) -> np.ndarray:
    if extension == "png":
        from PIL import Image

        return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    from workers.models.media import read_mp4

    return read_mp4(data)


def fetch(url: str, task_id: str) -> bytes:
    r = httpx.get(f"{url}/v1/tasks/{task_id}/result", timeout=30)
    assert r.status_code == 200, r.text
    return r.content


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path


def start_group(pipeline: str, tiny_models: Path, workdir: Path, **overrides: Any) -> LocalGroup:
    return LocalGroup(group_config(pipeline, str(tiny_models / pipeline), workdir, **overrides),
                      workdir)


@pytest.fixture(scope="module")
def baselines(tiny_models: Path, input_png: bytes, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[dict[str, bytes]]:
    """Results of ``--service all`` for each pipeline (one baseline process per pipeline)."""
    out: dict[str, bytes] = {}
    for pipeline in REQUESTS:
        wd = tmp_path_factory.mktemp(f"all-{pipeline}")
        group = start_group(pipeline, tiny_models, wd)
        try:
            group.start("all")
            group.wait_http(timeout=180)
            st = submit(group.url, KIND[pipeline], body(pipeline, input_png), timeout=300)
            assert st["status"] == "completed", st
            out[pipeline] = fetch(group.url, st["task_id"])
        finally:
            group.stop()
    yield out


@pytest.mark.parametrize("pipeline", list(REQUESTS))
def test_disaggregated_equals_baseline(pipeline: str, tiny_models: Path, input_png: bytes,
                                       workdir: Path, baselines: dict[str, bytes]) -> None:
    with start_group(pipeline, tiny_models, workdir) as group:
        group.start_all()
        st = submit(group.url, KIND[pipeline], body(pipeline, input_png), timeout=300)
        assert st["status"] == "completed", st
        assert st["attempt"] == 1
        assert list(st["stage_times"]) == ["queued", "encoding", "phase1", "denoising",
                                           "phase2", "decoding", "completed"]
        data = fetch(group.url, st["task_id"])
    ext = "mp4" if KIND[pipeline] == "video" else "png"
    got, want = pixels(data, ext), pixels(baselines[pipeline], ext)
    assert got.shape == want.shape
    assert np.array_equal(got, want), f"max abs diff {np.abs(got.astype(int) - want).max()}"
    assert data == baselines[pipeline]  # same frames, same encoder settings: same bytes


def test_many_to_many(tiny_models: Path, workdir: Path) -> None:
    """2 encoders, 3 transformers, 2 decoders, 12 concurrent requests: each completes once."""
    from contracts.request import GenerationRequest
    from workers.models import LocalPipeline

    pipeline, n = "qwen_t2i", 12
    ref = LocalPipeline(tiny_models / pipeline, pipeline)
    ref.load()
    with start_group(pipeline, tiny_models, workdir) as group:
        group.start_all(encoders=2, transformers=3, decoders=2)

        def one(seed: int) -> tuple[int, dict[str, Any], bytes]:
            st = submit(group.url, "image", body(pipeline, None, seed=seed,
                                                 task_id=f"mn-{seed}"), timeout=240)
            return seed, st, fetch(group.url, st["task_id"]) if st["status"] == "completed" \
                else b""

        with ThreadPoolExecutor(n) as pool:
            results = list(pool.map(one, range(100, 100 + n)))
        status = httpx.get(f"{group.url}/v1/service/status", timeout=10).json()
        ctl_log = group.services[0].log()
    assert status["counts"]["completed"] == n
    # Every model stage's heartbeats carry its GPU memory figures (zeros on a CPU).
    for role in ("encoder", "transformer", "decoder"):
        for w in status["workers"][role]:
            assert set(w["stats"]) == {"resident_bytes", "last_peak_bytes", "max_peak_bytes"}
    workers_used = set()
    for seed, st, data in results:
        assert st["status"] == "completed" and st["attempt"] == 1, st
        assert ctl_log.count(f"task mn-{seed} stage=completed") == 1
        workers_used.add(st["worker"])
        req = GenerationRequest.from_dict({"task": pipeline, "prompt": body(pipeline, None)
                                           ["prompt"], "seed": seed, "height": 32, "width": 48,
                                           "infer_steps": 2})
        assert np.array_equal(pixels(data, "png"), ref.run(req).frames), seed
    assert len(workers_used) == 2  # both decoders served


def test_dead_producer_fails_task_clearly_and_workers_keep_serving(
        tiny_models: Path, workdir: Path) -> None:
    """The encoder dies after publishing Phase1: the transformer's pull fails with an error
    naming task, tensor and peer; the task goes back in play and completes on attempt 2."""
    pipeline = "wan_t2v"
    with start_group(pipeline, tiny_models, workdir) as group:
        group.start("controller")
        group.wait_http()
        encoder = group.start("encoder")
        group.start("decoder")
        group.wait_workers({"encoder": 1, "decoder": 1})
        r = httpx.post(f"{group.url}/v1/tasks/video/",
                       json=body(pipeline, None, task_id="orphan"), timeout=30)
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 120
        while httpx.get(f"{group.url}/v1/tasks/orphan/status").json()["stage"] != "phase1":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(encoder.proc.pid, signal.SIGKILL)
        encoder.proc.wait()
        transformer = group.start("transformer")
        group.start("encoder")
        st = wait_task(group.url, "orphan", timeout=300)
        assert st["status"] == "completed" and st["attempt"] == 2, st
        log = transformer.log()
        assert "task orphan" in log and "failed (TransferFailed)" in log
        failure = next(line for line in log.splitlines() if "failed (TransferFailed)" in line)
        assert "tensor 'prompt_embeds'" in failure or "tensor '" in failure
        assert "peer 127.0.0.1:" in failure
        # And the group keeps serving.
        again = submit(group.url, "video", body(pipeline, None, seed=8), timeout=300)
        assert again["status"] == "completed" and again["attempt"] == 1


def test_killed_transformer_task_is_requeued(tiny_models: Path, workdir: Path) -> None:
    """A transformer SIGKILLed mid-denoise loses nothing: the task completes elsewhere."""
    pipeline = "qwen_t2i"
    with start_group(pipeline, tiny_models, workdir) as group:
        group.start_all(transformers=1)
        r = httpx.post(f"{group.url}/v1/tasks/image/",
                       json=body(pipeline, None, task_id="long", infer_steps=100), timeout=30)
        assert r.status_code == 200
        victim = next(s for s in group.services if s.role == "transformer")
        deadline = time.monotonic() + 120
        while True:
            st = httpx.get(f"{group.url}/v1/tasks/long/status").json()
            if st["stage"] == "denoising" and st["step"] >= 3:
                break
            assert time.monotonic() < deadline, st
            time.sleep(0.05)
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait()
        group.start("transformer")
        st = wait_task(group.url, "long", timeout=600)
    assert st["status"] == "completed" and st["attempt"] == 2, st
    assert "gone: control connection dropped" in group.services[0].log()


def test_missing_component_fails_at_startup(tiny_models: Path, workdir: Path) -> None:
    broken = workdir / "broken"
    shutil.copytree(tiny_models / "wan_t2v", broken)
    shutil.rmtree(broken / "transformer")
    group = LocalGroup(group_config("wan_t2v", str(broken), workdir), workdir)
    try:
        svc = group.start("transformer")
        assert svc.proc.wait(120) == 2
        log = svc.log()
        assert str(broken) in log and "'transformer'" in log
    finally:
        group.stop()


def test_wrong_pipeline_request_is_refused(tiny_models: Path, workdir: Path) -> None:
    with start_group("qwen_t2i", tiny_models, workdir) as group:
        group.start("controller")
        group.wait_http()
        r = httpx.post(f"{group.url}/v1/tasks/video/", json={"prompt": "x"}, timeout=10)
        assert r.status_code == 400
        assert "serves qwen_t2i" in r.json()["detail"]


def test_controller_restart_loses_no_task(tiny_models: Path, workdir: Path) -> None:
    """SIGKILL the controller mid-task: the journal brings every task back, the workers
    reconnect by themselves, the unfinished task completes, the finished one stays served."""
    pipeline = "qwen_t2i"
    with start_group(pipeline, tiny_models, workdir) as group:
        group.start_all()
        before = submit(group.url, "image", body(pipeline, None, seed=1, task_id="before"))
        assert before["status"] == "completed"
        first = fetch(group.url, "before")
        r = httpx.post(f"{group.url}/v1/tasks/image/",
                       json=body(pipeline, None, task_id="during", infer_steps=100), timeout=30)
        assert r.status_code == 200
        deadline = time.monotonic() + 120
        while httpx.get(f"{group.url}/v1/tasks/during/status").json()["step"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        old = group.services[0]
        os.kill(old.proc.pid, signal.SIGKILL)
        old.proc.wait()
        group.services.remove(old)  # reaped: no longer part of the group
        group.start("controller")
        group.wait_http()
        group.wait_workers({"encoder": 1, "transformer": 1, "decoder": 1}, timeout=120)
        st = wait_task(group.url, "during", timeout=600)
        assert st["status"] == "completed" and st["attempt"] == 2, st
        assert httpx.get(f"{group.url}/v1/tasks/before/status").json()["status"] == "completed"
        assert fetch(group.url, "before") == first


@pytest.mark.parametrize("phase", ["worker starting (pid", "controller unreachable"])
def test_sigterm_during_startup_stops_the_worker(tiny_models: Path, workdir: Path,
                                                 phase: str) -> None:
    """While importing the model stack (the handler is in place, the imports begin) or while
    waiting for an absent controller, a SIGTERM stops the worker promptly and cleanly (a
    lost one: the worker goes on retrying for reconnect_timeout_s, then fails)."""
    group = start_group("wan_t2v", tiny_models, workdir)
    try:
        svc = group.start("transformer")
        wait_log(svc, phase, timeout=300)
        svc.proc.send_signal(signal.SIGTERM)
        assert svc.proc.wait(90) == 0, svc.log()[-2000:]
        assert "stopped before it was ready" in svc.log()
    finally:
        group.stop()


def test_transformer_registers_after_its_warm_up(tiny_models: Path, workdir: Path) -> None:
    """With warmup_shapes the transformer runs them before it joins: the controller lists it
    only once the warm-up (the compile, with compile on) is done."""
    with start_group("wan_t2v", tiny_models, workdir, warmup_shapes=["32x32x5"]) as group:
        group.start("controller")
        group.wait_http()
        dit = group.start("transformer")
        group.wait_workers({"transformer": 1})
        log = dit.log()
    warm = log.index("warm-up of 32x32x5 took")
    assert warm < log.index("ready: pipeline=wan_t2v")


# -- Qwen-Image-Edit-2511 (QwenImageEditPlusPipeline) with one and two input images ----------
PLUS = "qwen_i2i_plus"
PLUS_BODY: dict[str, Any] = {"prompt": "a tiny test of qwen_i2i_plus", "negative_prompt": "blur",
                             "seed": 7, "height": 32, "width": 32, "infer_steps": 2}
_PLUS_REFERENCE: dict[int, np.ndarray] = {}


def plus_reference(tiny_models: Path, images: list[bytes]) -> np.ndarray:
    """diffusers' QwenImageEditPlusPipeline on the tiny Edit-2511 folder, uint8 pixels."""
    from contracts.request import GenerationRequest
    from tests.test_models import diffusers_reference
    from workers.models.media import to_uint8

    if len(images) not in _PLUS_REFERENCE:
        req = GenerationRequest(task=PLUS, **PLUS_BODY)
        _PLUS_REFERENCE[len(images)] = to_uint8(
            diffusers_reference(tiny_models, req, images, "float32"))
    return _PLUS_REFERENCE[len(images)]


def b64_images(images: list[bytes]) -> str | list[str]:
    """One image as the string it has always been, several as the list form."""
    encoded = [base64.b64encode(i).decode() for i in images]
    return encoded[0] if len(encoded) == 1 else encoded


@pytest.mark.parametrize("service", ["disaggregated", "baseline"])
def test_edit_plus_equals_diffusers_with_one_and_two_images(
        service: str, tiny_models: Path, input_png: bytes, input_png_2: bytes,
        workdir: Path) -> None:
    """The Edit-2511 folder served by a 1/1/1 group (loopback) and by ``--service all``
    gives QwenImageEditPlusPipeline's pixels with one and with two pictures."""
    cases = {1: [input_png], 2: [input_png, input_png_2]}
    got = {}
    with start_group(PLUS, tiny_models, workdir) as group:
        if service == "baseline":
            group.start("all")
            group.wait_http(timeout=180)
        else:
            group.start_all()
        for n, images in cases.items():
            st = submit(group.url, "image", {**PLUS_BODY, "image_path": b64_images(images)},
                        timeout=600)
            assert st["status"] == "completed", st
            got[n] = pixels(fetch(group.url, st["task_id"]), "png")
    for n, images in cases.items():
        want = plus_reference(tiny_models, images)
        assert np.array_equal(got[n], want), f"{n} image(s): max abs diff " \
            f"{np.abs(got[n].astype(int) - want).max()}"
    assert not np.array_equal(got[1], got[2])  # the second picture counts


def test_edit_plus_images_are_kept_for_a_retry(tiny_models: Path, input_png: bytes,
                                               input_png_2: bytes, workdir: Path) -> None:
    """The encoder dies right after it pulled a two-picture task's images (SIGKILL at the
    stage): the controller stages the pack it kept again for attempt 2, on another encoder,
    and the result is still diffusers' (nothing of the pack was lost or reordered)."""
    images = [input_png, input_png_2]
    with start_group(PLUS, tiny_models, workdir) as group:
        group.start("controller")
        group.wait_http()
        doomed = group.start("encoder", {"faults": "worker.stage:exit"})
        group.start("transformer")
        group.start("decoder")
        group.wait_workers({"encoder": 1, "transformer": 1, "decoder": 1})
        r = httpx.post(f"{group.url}/v1/tasks/image/", timeout=30,
                       json={**PLUS_BODY, "image_path": b64_images(images), "task_id": "kept"})
        assert r.status_code == 200, r.text
        assert doomed.proc.wait(300) != 0  # killed at its fault point
        group.start("encoder")
        st = wait_task(group.url, "kept", timeout=600)
        assert st["status"] == "completed" and st["attempt"] == 2, st
        got = pixels(fetch(group.url, "kept"), "png")
    assert np.array_equal(got, plus_reference(tiny_models, images))
