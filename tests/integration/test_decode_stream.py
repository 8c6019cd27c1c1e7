"""The streamed Wan decode (issue 33): the MP4 is written on a background thread while the
VAE decodes, latent frame by latent frame, and the result is the serial path's, bit for bit.

Tiny random-weight models (``tiny_models``), random latents of four latent frames (13 video
frames: the decoder's feature cache is carried over three frame boundaries). A worker's
failure paths run the real decoder stage under a fake control channel.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

# Tiny ops on a busy 2-core machine get hundreds of times slower with extra threads.
torch.set_num_threads(1)

from contracts.config import ServiceConfig  # noqa: E402  (after the thread setting)
from contracts.errors import StageCancelled, StageError  # noqa: E402
from contracts.messages import Op  # noqa: E402
from contracts.request import GenerationRequest  # noqa: E402
from contracts.stage_options import StageOptions  # noqa: E402
from tests.support.fakes import FakeControl  # noqa: E402
from tests.support.models import small_request, stage  # noqa: E402
from workers.encode_pool import EncodePool  # noqa: E402
from workers.models import DecoderAdapter  # noqa: E402
from workers.models.diffusers_glue import decode_latents  # noqa: E402
from workers.models.media import Mp4Writer, read_mp4  # noqa: E402
from workers.models.media_stream import Mp4Stream  # noqa: E402
from workers.roles import DecoderWorker  # noqa: E402
from workers.worker import Job  # noqa: E402

pytestmark = pytest.mark.integration  # builds and runs the tiny models

STREAMED = ("wan_t2v", "wan_i2v", "wan22_5b_t2v")
"""Wan2.1's VAE (T2V, I2V) and Wan2.2's 48-channel one with patch_size 2 (TI2V-5B)."""
LATENT_FRAMES = 4


def _request(task: str) -> GenerationRequest:
    return small_request(task, num_frames=1 + 4 * (LATENT_FRAMES - 1))


def _latents(dec: DecoderAdapter, req: GenerationRequest) -> dict[str, torch.Tensor]:
    cfg = dec.vae.config  # type: ignore[attr-defined]
    assert req.height is not None and req.width is not None
    shape = (1, cfg.z_dim, LATENT_FRAMES, req.height // cfg.scale_factor_spatial,
             req.width // cfg.scale_factor_spatial)
    return {"latents": torch.randn(shape, generator=torch.Generator().manual_seed(7))}


def _writers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "mp4-stream"]


@pytest.fixture(autouse=True)
def _no_writer_left() -> Iterator[None]:
    """Every test ends with its writer threads ended (joined here, bounded)."""
    yield
    for thread in _writers():
        thread.join(30)
    assert not _writers()


@pytest.mark.parametrize("task", STREAMED)
def test_streamed_decode_is_the_serial_one(tiny_models: Path, task: str) -> None:
    dec = stage("decoder", tiny_models, task)
    req = _request(task)
    latents = _latents(dec, req)

    # The chunks: one per latent frame (1 video frame, then 4 each), and together exactly
    # diffusers' vae.decode, postprocessed as the pipelines do for output_type="np".
    chunks = dec.frame_chunks(req, latents)
    assert chunks is not None and chunks.frames == req.num_frames
    parts: list[np.ndarray] = []
    chunks.run(lambda chunk: parts.append(chunk.float().numpy().copy()))
    assert [len(p) for p in parts] == [1] + [4] * (LATENT_FRAMES - 1)
    with torch.no_grad():
        video = decode_latents(dec.vae, latents["latents"], torch.device("cpu"))
    reference = dec.video_processor.postprocess_video(video, output_type="np")[0]
    assert np.array_equal(np.concatenate(parts), reference)
    assert np.array_equal(np.concatenate(parts), dec.decode_float(req, latents))

    # The file: the same pixels and the same MP4 bytes as decode-then-encode.
    serial = dec.encode_media(req, dec.decode_pixels(req, latents))
    streamed = dec.decode(req, latents)
    assert np.array_equal(streamed.frames, serial.frames)
    assert streamed.frames.std() > 1.0, "degenerate output: the test would prove little"
    assert (streamed.media_type, streamed.extension, streamed.fps) == ("video/mp4", "mp4", 8)
    assert np.array_equal(read_mp4(streamed.data), read_mp4(serial.data))
    assert streamed.data == serial.data


def test_what_does_not_stream(tiny_models: Path) -> None:
    """Tiled decodes and images keep the one-piece decode (and its result)."""
    tiled = DecoderAdapter.for_task(tiny_models / "wan_t2v", "wan_t2v",
                                    options=StageOptions(vae_tiling=True))
    tiled.load()
    req = _request("wan_t2v")
    latents = _latents(tiled, req)
    assert tiled.frame_chunks(req, latents) is None
    art = tiled.decode(req, latents)
    assert np.array_equal(art.frames, tiled.decode_pixels(req, latents))
    assert np.array_equal(read_mp4(art.data), read_mp4(tiled.encode_media(req, art.frames).data))

    qwen = stage("decoder", tiny_models, "qwen_t2i")
    image_req = small_request("qwen_t2i")
    lat = {"latents": torch.zeros(1, 1)}  # never looked at: images do not stream
    assert qwen.frame_chunks(image_req, lat) is None


def test_cancel_between_chunks_stops_the_writer(tiny_models: Path) -> None:
    dec = stage("decoder", tiny_models, "wan_t2v")
    req = _request("wan_t2v")
    asked: list[int] = []

    def should_stop() -> bool:
        asked.append(1)
        return len(asked) > 2  # after two chunks were handed to the writer

    with pytest.raises(StageCancelled, match="decode cancelled after 5 of 13 frames"):
        dec.decode_media(req, _latents(dec, req), should_stop=should_stop)
    # The writer was aborted (the fixture checks that it ended); the VAE's cache is free.
    assert all(f is None for f in dec.vae._feat_map)


# ---------------------------------------------------------------------------------------------
# the decoder worker: a writer that fails fails the task, and no file is left
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def broken_writer(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Mp4Writer.write raises on its second chunk (mid-stream); the event is set when it
    did."""
    raised = threading.Event()
    write = Mp4Writer.write
    calls: list[int] = []

    def failing(self: Mp4Writer, frames: np.ndarray) -> None:
        calls.append(len(frames))
        if len(calls) == 2:
            raised.set()
            raise OSError(28, "No space left on device (injected)")
        write(self, frames)

    monkeypatch.setattr(Mp4Writer, "write", failing)
    return raised


def _worker(dec: Any, out: Path, encode_queue: int, latents: dict[str, torch.Tensor],
            job: Job) -> DecoderWorker:
    worker = DecoderWorker(ServiceConfig(output_dir=str(out), encode_queue=encode_queue),
                           "token", {})
    worker.link.control = FakeControl()
    worker.stage = dec
    if encode_queue:
        worker.encoder_pool = EncodePool(encode_queue)
    worker.fetch_inputs = lambda job: latents  # type: ignore[method-assign]
    worker.claim = lambda: job  # type: ignore[method-assign]
    return worker


def _step(worker: DecoderWorker) -> None:
    try:
        assert worker.step()
        if worker.encoder_pool is not None:
            assert worker.encoder_pool.join(timeout=60)
    finally:
        if worker.encoder_pool is not None:
            worker.encoder_pool.close(timeout=60)


@pytest.mark.parametrize("encode_queue", [0, 1])
def test_writer_failure_fails_the_task(tiny_models: Path, tmp_path: Path,
                                       broken_writer: threading.Event,
                                       encode_queue: int) -> None:
    dec = stage("decoder", tiny_models, "wan_t2v")
    req = _request("wan_t2v")
    latents = _latents(dec, req)
    job = Job("t-broken", 1, {"request": req.to_dict()})
    worker = _worker(dec, tmp_path / "out", encode_queue, latents, job)
    _step(worker)
    assert broken_writer.is_set()
    control: Any = worker.link.control
    assert control.ops() == [Op.FAIL]
    _, fields = control.calls[0]
    assert fields["task_id"] == "t-broken"
    assert "the MP4 writer failed" in fields["error"]
    assert "No space left on device (injected)" in fields["error"]
    out = tmp_path / "out"
    assert not out.exists() or not list(out.iterdir())  # no file, no .part


@pytest.mark.parametrize("encode_queue", [0, 1])
def test_a_cancel_during_the_decode_drops_the_stream(tiny_models: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    encode_queue: int) -> None:
    """The controller's cancel arrives while the MP4 is being written (here: when its first
    chunk is; the decode waits for that before its next chunk): the task fails as cancelled
    between two chunks, its writer is stopped (the fixture checks that it ended) and no
    file is written."""
    dec = stage("decoder", tiny_models, "wan_t2v")
    req = _request("wan_t2v")
    latents = _latents(dec, req)
    job = Job("t-cancel", 1, {"request": req.to_dict()})
    cancelled = threading.Event()
    write, put = Mp4Writer.write, Mp4Stream.put

    def cancel_then_write(self: Mp4Writer, frames: np.ndarray) -> None:
        job.cancel.set()  # what a heartbeat's reply does
        cancelled.set()
        write(self, frames)

    def put_then_wait(self: Mp4Stream, frames: np.ndarray) -> None:
        put(self, frames)
        assert cancelled.wait(30)

    monkeypatch.setattr(Mp4Writer, "write", cancel_then_write)
    monkeypatch.setattr(Mp4Stream, "put", put_then_wait)
    worker = _worker(dec, tmp_path / "out", encode_queue, latents, job)
    _step(worker)
    control: Any = worker.link.control
    assert control.ops() == [Op.FAIL]
    _, fields = control.calls[0]
    assert fields["task_id"] == "t-cancel" and fields["error_type"] == "cancelled"
    assert "decode cancelled after 1 of 13 frames" in fields["error"]
    out = tmp_path / "out"
    assert not out.exists() or not list(out.iterdir())


def test_a_cancel_after_the_decode_drops_the_stream(tiny_models: Path, tmp_path: Path) -> None:
    """A cancel that arrives once the device decode is done, before the result is published
    (the step's own check): the writer still encoding is stopped (by the worker's _fail; the
    fixture checks that it ended), the task fails as cancelled, and no file is written."""
    dec = stage("decoder", tiny_models, "wan_t2v")
    req = _request("wan_t2v")
    job = Job("t-late", 1, {"request": req.to_dict()})
    worker = _worker(dec, tmp_path / "out", 0, _latents(dec, req), job)
    compute = worker.compute
    pending: list[Any] = []

    def compute_then_cancel(job: Job, inputs: Any) -> Any:
        pending.append(compute(job, inputs))
        job.cancel.set()
        return pending[0]

    worker.compute = compute_then_cancel  # type: ignore[method-assign]
    _step(worker)
    control: Any = worker.link.control
    assert control.ops() == [Op.FAIL]
    assert control.calls[0][1]["error_type"] == "cancelled"
    with pytest.raises(StageError, match="the MP4 writer"):  # dropped, never delivered
        pending[0].result()
    out = tmp_path / "out"
    assert not out.exists() or not list(out.iterdir())
