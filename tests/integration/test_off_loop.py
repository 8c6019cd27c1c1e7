"""The controller's blocking work runs off the event loop that serves the ring verbs and the
control channel: result-file writes, input-image decoding, store writes. Each test blocks
the slow step on purpose until the loop has shown it keeps running meanwhile (a step run on
the loop would block the very ticks that release it)."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import io
import os
import threading
from collections.abc import Awaitable
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import httpx
import pytest

from contracts.config import ServerConfig
from controller.app import LocalQueue
from controller.http import decoding as decoding_mod
from controller.http.decoding import ImageDecoder
from controller.http.frontdoor import FrontDoor
from controller.http.webapp import build_app
from controller.ownership import results as results_mod
from controller.ownership.coordinator import Coordinator
from controller.tasks.store_check import completions
from controller.tasks.tasks import Stage, Task
from tests.support.coordinators import make_coordinator

pytestmark = pytest.mark.integration  # starts processes or servers

TICKS = 5
"""Loop wake-ups to see while the slow step is blocked before releasing it."""


def make(tmp_path: Path, pipeline: str = "qwen_t2i") -> Coordinator:
    return make_coordinator(tmp_path, LocalQueue(16, 4096), pipeline=pipeline, max_pending=16)


class Slow:
    """A blocking step that waits, once started, until the loop releases it."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.gate = threading.Event()

    def block(self) -> None:
        self.started.set()
        # A step run on the loop thread never sees the gate: it goes on after this, having
        # stopped every tick meanwhile.
        self.gate.wait(30)


async def ticks_while_blocked(work: Awaitable[Any], slow: Slow) -> tuple[Any, int]:
    """Run ``work``; count the loop's wake-ups while ``slow`` is blocked, and release it
    after :data:`TICKS` of them."""
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while not slow.gate.is_set():
            await asyncio.sleep(0.005)
            if slow.started.is_set():
                ticks += 1
                if ticks >= TICKS:
                    slow.gate.set()

    tick = asyncio.create_task(ticker())
    result = await work
    slow.gate.set()
    await tick
    return result, ticks


def to_decoding(co: Coordinator, tid: str) -> Any:
    workers = [co.on_register(r, r, 1, co.config.pipeline, "") for r in
               ("encoder", "transformer", "decoder")]
    co.submit(Task(task_id=tid, kind="image", pipeline=co.config.pipeline,
                   request={"task": co.config.pipeline, "prompt": "x"}, save_result_path=""))
    for w in workers:
        assert co.on_claim(w, tid, 1)[0]
        if w is not workers[-1]:
            co.on_handoff(w, tid, 1)
    return workers[-1]


def test_slow_result_write_does_not_stall_the_loop(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    real = results_mod.write_result
    slow = Slow()

    def slow_write(path: Path, data: bytes) -> None:
        slow.block()  # a slow disk, or a large MP4
        real(path, data)

    monkeypatch.setattr(results_mod, "write_result", slow_write)
    co = make(tmp_path)
    dec = to_decoding(co, "w")

    async def main() -> tuple[Any, int]:
        return await ticks_while_blocked(
            co.on_complete(dec, "w", 1, "png", "image/png", b"PNG"), slow)

    accepted, ticks = asyncio.run(main())
    assert accepted and (tmp_path / "w.png").read_bytes() == b"PNG"
    assert ticks >= TICKS, "the loop stood still while the result was written"
    co.close()


def test_concurrent_completions_of_one_task_write_once(tmp_path: Path) -> None:
    """A zombie's late completion racing the live one: one wins, its bytes are the file,
    the store records one completion."""
    co = make(tmp_path)
    dec = to_decoding(co, "race")

    async def main() -> list[bool]:
        return list(await asyncio.gather(
            co.on_complete(dec, "race", 1, "png", "image/png", b"first"),
            co.on_complete(dec, "race", 1, "png", "image/png", b"second"),
        ))

    outcome = asyncio.run(main())
    assert outcome == [True, False]
    assert (tmp_path / "race.png").read_bytes() == b"first"
    task = co.table.get("race")
    assert task is not None and task.stage == Stage.COMPLETED
    co.close()
    assert completions(tmp_path / ".journal")["race"] == ("completed", 1)


def test_cancel_while_the_result_is_written_leaves_no_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = results_mod.write_result
    co = make(tmp_path)
    dec = to_decoding(co, "c")
    task = co.table.get("c")
    assert task is not None

    def write_then_cancelled(path: Path, data: bytes) -> None:
        real(path, data)
        co.table.cancelled(task, "cancelled meanwhile")  # what the loop could do meanwhile

    monkeypatch.setattr(results_mod, "write_result", write_then_cancelled)
    assert asyncio.run(co.on_complete(dec, "c", 1, "png", "image/png", b"x")) is False
    assert not (tmp_path / "c.png").exists() and task.stage == Stage.CANCELLED
    co.close()


def test_image_decoding_does_not_stall_the_loop(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from PIL import Image

    real = decoding_mod.decode_image
    slow = Slow()

    def slow_decode(*args: Any) -> bytes:
        slow.block()  # a large image
        return real(*args)

    # Threads here so the patch applies; in production the same job runs in processes.
    monkeypatch.setattr(decoding_mod, "decode_image", slow_decode)
    pool = concurrent.futures.ThreadPoolExecutor(2)
    co = make(tmp_path, "qwen_i2i")
    front = FrontDoor(co, status_extra=lambda: {}, service="controller", server=ServerConfig(),
                      decoder=ImageDecoder(pool))
    buf = io.BytesIO()
    Image.new("RGB", (32, 32)).save(buf, format="PNG")
    body = {"prompt": "p", "image_path": base64.b64encode(buf.getvalue()).decode()}

    async def main() -> tuple[Any, int]:
        transport = httpx.ASGITransport(app=build_app(front))
        async with httpx.AsyncClient(transport=transport, base_url="http://front") as client:
            return await ticks_while_blocked(client.post("/v1/tasks/image/", json=body), slow)

    response, ticks = asyncio.run(main())
    assert response.status_code == 200, response.text
    assert ticks >= TICKS, "the loop stood still while the image was decoded"
    front.close()
    co.close()
    pool.shutdown()


def test_images_decode_in_other_processes_that_may_die() -> None:
    """The production decoder: another process does the work, and one that dies (a crash
    or the kernel's OOM killer) costs that request a 422, not the controller."""
    from fastapi import HTTPException
    from PIL import Image

    decoder = ImageDecoder()
    decoder.start()
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="PNG")
    image = base64.b64encode(buf.getvalue()).decode()

    class Broken(concurrent.futures.Executor):
        def submit(self, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
            fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
            fut.set_exception(BrokenProcessPool("a decoding process died"))
            return fut

    async def main() -> None:
        assert await decoder.run(os.getpid) != os.getpid()
        with pytest.raises(BrokenProcessPool):
            await decoder.run(os._exit, 9)  # the process dies mid-job
        assert await decoder.decode(image, 1 << 20, 1000) == buf.getvalue()  # new ones
        with pytest.raises(HTTPException) as err:
            await decoder.decode(image, 1 << 20, 10)
        assert err.value.status_code == 413
        with pytest.raises(HTTPException) as err:  # a request whose decoder died: 422
            await ImageDecoder(Broken()).decode(image, 1 << 20, 1000)
        assert err.value.status_code == 422 and "crashed" in str(err.value.detail)

    asyncio.run(main())


def test_large_json_bodies_are_parsed_off_the_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Many 1 MB bodies arriving together, parsed one after the other on the loop, would
    hold it for all their parse times in a row: each is parsed on a worker thread, and what
    FastAPI validates is that parse."""
    import json
    import threading

    real = json.loads
    parsed_on: list[str] = []

    def recording_loads(data: Any, *args: Any, **kwargs: Any) -> Any:
        if len(data) > (1 << 20):
            parsed_on.append(threading.current_thread().name)
        return real(data, *args, **kwargs)

    monkeypatch.setattr(json, "loads", recording_loads)
    co = make(tmp_path, "qwen_t2i")
    front = FrontDoor(co, status_extra=lambda: {}, service="controller", server=ServerConfig())
    body = json.dumps({"prompt": "p", "image_path": "A" * (2 << 20), "task_id": "big"})

    async def main() -> list[Any]:
        transport = httpx.ASGITransport(app=build_app(front))
        async with httpx.AsyncClient(transport=transport, base_url="http://front") as client:
            return list(await asyncio.gather(*(
                client.post(kind, content=body, headers={"content-type": "application/json"})
                for kind in ("/v1/tasks/video/", "/v1/tasks/image/"))))

    video, image = asyncio.run(main())
    assert video.status_code == 400 and "serves qwen_t2i" in video.text  # parsed, validated
    assert image.status_code == 422 and "takes no input image" in image.text
    assert len(parsed_on) == 2 and all(n.startswith("json-body") for n in parsed_on), parsed_on
    front.close()
    co.close()
