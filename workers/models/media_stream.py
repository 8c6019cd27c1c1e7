"""An MP4 written on a background thread while its frames are still being decoded.

A Wan decode makes its frames one latent frame at a time (:meth:`DecoderAdapter.frame_chunks`);
each chunk is handed to :class:`Mp4Stream` as soon as it is on the host, and libx264 encodes
it while the VAE decodes the next one. What is left when the last chunk is in, the tail, is
the encoding of that chunk and the encoder's flush: :meth:`Mp4Stream.finish` waits for it.

Protocol (one producer thread, the writer thread):

* :meth:`~Mp4Stream.put` queues a chunk (never blocks: the chunks are views of the result's
  own pixel array, so queueing copies nothing); it raises the writer's error once the writer
  has failed, so the producer stops decoding early.
* :meth:`~Mp4Stream.finish` queues the end mark, joins the writer and returns the bytes, or
  raises its error as a :class:`StageError` naming the writer.
* :meth:`~Mp4Stream.abort` (a failed or cancelled decode) queues the end mark with the
  abort flag set: the writer drops what is queued, releases the encoder and ends. The bytes
  are never returned, so no partial file can be written from them.

The file's bytes stay in memory until the decoder writes the result atomically, as for an
MP4 encoded in one piece (:func:`~workers.models.media.encode_mp4`, the same bytes).

The writer holds :func:`~workers.models.media.defined_heap` from the encoder's opening to its
flush, as an encode in one piece does, so the decode runs inside that window: every heap block
allocated meanwhile, in any thread, is filled first. A CUDA decode allocates only small host
blocks (tensor headers) meanwhile; a decode on the CPU allocates its activations there, which
cost about 10 % more main-thread CPU time in a CPU run of the real-size Wan2.1 VAE (64x64x17,
measured on this branch's development machine, 2026-12-03).
"""

from __future__ import annotations

import queue
import threading

import numpy as np

from contracts.errors import StageError

from .media import Mp4Writer, VideoSettings, defined_heap, resolve_codec

_END = None
"""The end mark in the queue."""


class Mp4Stream:
    """One MP4, encoded on its own thread from chunks of (F, H, W, 3) uint8 frames."""

    def __init__(self, fps: int, settings: VideoSettings, name: str = "mp4-stream") -> None:
        self.fps = fps
        self.settings = settings
        self._queue: queue.SimpleQueue[np.ndarray | None] = queue.SimpleQueue()
        self._aborted = threading.Event()
        self._error: BaseException | None = None
        """Set by the writer thread before it ends; read after a join, or as a hint by put."""
        self._data: bytes | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, frames: np.ndarray) -> None:
        """Queue the next frames; the caller must not change them until :meth:`finish`."""
        if self._error is not None:  # the writer has failed: stop feeding it
            self._thread.join()
            raise self._failure()
        self._queue.put(frames)

    def finish(self, timeout: float | None = None) -> bytes:
        """Wait for the writer to encode what is queued and flush: the file's bytes."""
        self._queue.put(_END)
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.abort()
            raise StageError(f"the MP4 writer did not finish within {timeout} s")
        if self._error is not None:
            raise self._failure()
        if self._data is None:  # aborted
            raise StageError("the MP4 writer was stopped before the end of the video (the "
                             "decode failed or was cancelled)")
        return self._data

    def abort(self) -> None:
        """Stop the writer without waiting for it; its bytes are dropped."""
        self._aborted.set()
        self._queue.put(_END)

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the writer thread has ended; False on timeout."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _failure(self) -> StageError:
        exc = self._error
        err = StageError(f"the MP4 writer failed: {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        return err

    def _run(self) -> None:
        try:
            codec = resolve_codec(self.settings)
            # The first chunk is waited for outside the heap window: a queued stream must not
            # hold up another MP4 being finished meanwhile (encode pool) while it has nothing
            # to encode.
            first = self._queue.get()
            if first is None or self._aborted.is_set():
                return
            with defined_heap():
                writer = Mp4Writer(first.shape[2], first.shape[1], self.fps, codec,
                                   self.settings)
                try:
                    chunk: np.ndarray | None = first
                    while chunk is not None and not self._aborted.is_set():
                        writer.write(chunk)
                        chunk = self._queue.get()
                    if not self._aborted.is_set():
                        self._data = writer.finish()
                finally:
                    writer.close()
        except BaseException as exc:  # reported to the producer by put / finish
            self._error = exc
