"""The decoder's background media encoder: bounded, off the critical path, and the task's
completion reported only after its file is fully written (the lease is held until then).

In-process, with a fake control channel and a fake stage whose media encoding waits on an
event, so every ordering below is forced, not timed.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from contracts.config import ServiceConfig
from contracts.errors import StageError
from contracts.messages import Op
from tests.support.fakes import FakeControl
from workers.encode_pool import EncodePool
from workers.models import Artifact, PendingMedia
from workers.roles import DecoderWorker
from workers.worker import Idle, Job, State

REQUEST = {"task": "wan_t2v", "prompt": "x", "height": 32, "width": 32, "num_frames": 5,
           "fps": 8}


class Control(FakeControl):
    """Also notes what is on disk (the decoder's own copy, in ``out``) when the controller
    hears of a completion."""

    def __init__(self, out: Path) -> None:
        super().__init__({Op.COMPLETE: self._read_file})
        self.out = out
        self.files_at_complete: list[bytes] = []

    def _read_file(self, fields: dict[str, Any]) -> dict[str, Any]:
        local = self.out / f"{fields['task_id']}.{fields['extension']}"
        self.files_at_complete.append(local.read_bytes())
        return {}


class FakeStage:
    def __init__(self) -> None:
        self.release = threading.Event()
        self.fail = False
        self.encoded: list[str] = []

    @contextlib.contextmanager
    def guarded(self, what: str) -> Iterator[None]:  # no GPU memory to watch
        yield

    def decode_pixels(self, req: Any, inputs: Any) -> np.ndarray:
        return np.full((5, 32, 32, 3), 7, np.uint8)

    def decode_media(self, req: Any, inputs: Any, should_stop: Any = None) -> PendingMedia:
        pixels = self.decode_pixels(req, inputs)  # a decoder that does not stream
        return PendingMedia(lambda: self.encode_media(req, pixels))

    def encode_media(self, req: Any, pixels: np.ndarray) -> Artifact:
        assert self.release.wait(30)
        if self.fail:
            raise StageError("encoder exploded")
        self.encoded.append(req.prompt)
        return Artifact(b"MP4" * 1000, "video/mp4", "mp4", pixels, fps=8)


@pytest.fixture
def decoder(tmp_path: Path) -> Any:
    cfg = ServiceConfig(output_dir=str(tmp_path), encode_queue=1)
    worker = DecoderWorker(cfg, "token", {})
    worker.link.control = Control(tmp_path)
    worker.stage = FakeStage()
    worker.encoder_pool = EncodePool(cfg.encode_queue)
    worker.fetch_inputs = lambda job: {}  # type: ignore[method-assign]
    yield worker
    worker.stage.release.set()
    worker.encoder_pool.close(timeout=30)


def run_step(worker: DecoderWorker, task_id: str) -> Job:
    job = Job(task_id, 1, {"request": REQUEST})
    worker.claim = lambda: job  # type: ignore[method-assign]
    assert worker.step()
    return job


def test_completion_waits_for_the_file(decoder: Any, tmp_path: Path) -> None:
    run_step(decoder, "t1")  # returns while the MP4 is still being encoded
    assert Op.COMPLETE not in decoder.link.control.ops()
    assert not (tmp_path / "t1.mp4").exists()
    assert decoder.encoder_pool.held == 1
    decoder.stage.release.set()
    assert decoder.encoder_pool.join(timeout=30)
    assert decoder.link.control.ops() == [Op.COMPLETE]
    _, fields = decoder.link.control.calls[0]
    assert fields["task_id"] == "t1" and fields["data"] == b"MP4" * 1000
    # The file was complete (and in place, not a .part) when the completion went out.
    assert decoder.link.control.files_at_complete == [b"MP4" * 1000]
    assert not list(tmp_path.glob("*.part"))


def test_full_pool_stops_claiming(decoder: Any) -> None:
    """While the pool is full the decoder claims nothing: it waits for room (the ring is not
    touched: in_ring is None here, so a claim would fail), and gives up when draining."""
    run_step(decoder, "t1")
    assert not decoder.encoder_pool.has_room()
    decoder.state = State.RUNNING
    claimed: list[Any] = []
    decoder.link.in_ring = None

    def real_claim() -> None:
        try:
            claimed.append(DecoderWorker.claim(decoder))
        except AssertionError:  # reached the ring: only after room was made
            claimed.append("ring")

    looked = threading.Event()
    wait_for_room = decoder.encoder_pool.wait_for_room

    def watched(timeout: float) -> bool:
        room: bool = wait_for_room(timeout)
        if not room:
            looked.set()
        return room

    decoder.encoder_pool.wait_for_room = watched
    waiter = threading.Thread(target=real_claim)
    waiter.start()
    assert looked.wait(30)  # it looked for room, found none, and waits on
    assert waiter.is_alive() and claimed == []
    decoder.stage.release.set()
    waiter.join(30)
    assert claimed == ["ring"]
    # Full again, and draining: the claim returns without touching the ring.
    decoder.stage.release.clear()
    run_step(decoder, "t2")
    decoder.state = State.DRAINING
    assert DecoderWorker.claim(decoder) is Idle.EMPTY
    decoder.stage.release.set()
    assert decoder.encoder_pool.join(timeout=30)


def test_background_failure_is_reported(decoder: Any) -> None:
    decoder.stage.fail = True
    run_step(decoder, "bad")
    decoder.stage.release.set()
    assert decoder.encoder_pool.join(timeout=30)
    assert decoder.link.control.ops() == [Op.FAIL]
    _, fields = decoder.link.control.calls[0]
    assert fields["task_id"] == "bad" and "encoder exploded" in fields["error"]


def test_drain_reports_what_is_in_flight(decoder: Any) -> None:
    """run() returns only after the background results were reported."""
    run_step(decoder, "t1")
    decoder.state = State.DRAINING
    threading.Timer(0.3, decoder.stage.release.set).start()
    t0 = time.monotonic()
    decoder.run()  # the loop exits at once (draining); the pool is joined
    assert time.monotonic() - t0 >= 0.25
    assert decoder.link.control.ops() == [Op.COMPLETE]


def test_foreground_when_disabled(tmp_path: Path) -> None:
    cfg = ServiceConfig(output_dir=str(tmp_path), encode_queue=0)
    worker = DecoderWorker(cfg, "token", {})
    worker.link.control = Control(tmp_path)
    worker.stage = FakeStage()
    worker.stage.release.set()
    worker.fetch_inputs = lambda job: {}  # type: ignore[method-assign]
    run_step(worker, "t2")
    assert worker.link.control.ops() == [Op.COMPLETE]  # reported by the step itself


def test_encode_pool_is_bounded() -> None:
    pool = EncodePool(2)
    gate = threading.Event()
    done: list[int] = []
    for i in range(2):
        pool.submit(lambda i=i: (gate.wait(30), done.append(i)))
    assert pool.held == 2 and not pool.has_room()
    entered = threading.Event()
    acquire = pool._slots.acquire

    def watched(*args: Any, **kwargs: Any) -> bool:
        entered.set()
        return acquire(*args, **kwargs)

    pool._slots.acquire = watched  # type: ignore[method-assign]

    def submit_third() -> None:
        pool.submit(lambda: done.append(2))
        done.append(-1)  # submit() returned

    third = threading.Thread(target=submit_third)
    third.start()
    assert entered.wait(30)
    assert third.is_alive() and done == []  # waits for room: 0 and 1 wait on the gate
    gate.set()
    third.join(30)
    assert pool.join(timeout=30)
    # One thread, in order; the third was queued only once the first had made room.
    assert [d for d in done if d >= 0] == [0, 1, 2] and done.index(-1) > done.index(0)
    pool.close()
    with pytest.raises(ValueError):
        EncodePool(0)
