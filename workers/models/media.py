"""Image input decoding and result encoding (PNG / MP4).

The input image of I2V / I2I requests arrives as the bytes of a picture file in one of the
formats the front door accepts (``contracts.input_images.IMAGE_FORMATS``); results
leave as PNG (images) or H.264 MP4 (videos). MP4s are written in memory with PyAV (``av``),
whose wheels bundle FFmpeg with libx264: no ffmpeg binary or subprocess. libx264 runs
multi-threaded (``VideoSettings.threads``); ``h264_nvenc`` is used when asked for and it
opens (the GPU driver must ship the encoder library), else libx264, logged once. Pixels are
converted to uint8 the way diffusers does for PIL output (``round(x * 255)``), so our frames
equal the pipelines' images exactly.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from contracts.errors import StageError, StageInputError
from contracts.input_images import IMAGE_FORMATS, is_pack, unpack_images
from contracts.pipelines import VIDEO_CODECS, X264_PRESETS

if TYPE_CHECKING:
    from PIL import Image

log = logging.getLogger("diffring.media")

# A decompression bomb must not take a worker down: far above any real input (~16k x 16k).
_MAX_INPUT_PIXELS = 256 * 1024 * 1024


def decode_image(data: bytes | bytearray | memoryview | None, task: str) -> Image.Image:
    """Decode one input image of an I2V / I2I request to an RGB PIL image (a buffer of
    several packed images is refused: the pipeline of ``task`` takes one)."""
    from PIL import Image, UnidentifiedImageError

    if data is None or len(data) == 0:
        raise StageInputError(f"{task} needs an input image ({', '.join(IMAGE_FORMATS)} "
                              "bytes); none was given")
    if is_pack(data):  # several images packed together (contracts.input_images)
        n = len(unpack_images(data, task))
        raise StageInputError(f"{task} takes one input image, got {n}")
    try:
        with Image.open(io.BytesIO(bytes(data)), formats=IMAGE_FORMATS) as img:
            if img.width * img.height > _MAX_INPUT_PIXELS:
                raise StageInputError(
                    f"{task} input image is {img.width}x{img.height}, larger than the "
                    f"{_MAX_INPUT_PIXELS} pixel limit"
                )
            rgb = img.convert("RGB")
            rgb.load()
            return rgb
    except StageInputError:
        raise
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise StageInputError(f"{task} input image could not be decoded: {e}") from e


def to_uint8(pixels: np.ndarray) -> np.ndarray:
    """float [0, 1] -> uint8, rounding like diffusers' ``numpy_to_pil``."""
    if pixels.dtype == np.uint8:
        return pixels
    return np.ascontiguousarray((pixels * 255).round().astype(np.uint8))


def encode_png(pixels: np.ndarray) -> bytes:
    """PNG bytes of an (H, W, 3) uint8 image. No metadata is written, so the bytes depend on
    the pixels only."""
    from PIL import Image

    if pixels.ndim != 3 or pixels.shape[-1] != 3 or pixels.dtype != np.uint8:
        raise ValueError(f"expected an (H, W, 3) uint8 image, got {pixels.shape} {pixels.dtype}")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG", compress_level=6)
    return buf.getvalue()


@dataclass(frozen=True)
class VideoSettings:
    """How MP4 results are encoded (the decoder's ``video_*`` config fields)."""

    codec: str = "auto"
    """``libx264``, ``h264_nvenc``, or ``auto`` (NVENC when it opens here, else libx264)."""
    preset: str = "veryfast"
    """libx264 preset (ultrafast .. veryslow); NVENC gets its own p1..p7 equivalent."""
    crf: int = 18
    """libx264 constant rate factor (0 = lossless, 51 = worst); NVENC's ``cq``."""
    threads: int = 0
    """libx264 threads; 0 = one per core."""

    def __post_init__(self) -> None:
        if self.codec not in VIDEO_CODECS:
            raise ValueError(f"video codec must be one of {', '.join(VIDEO_CODECS)}, got "
                             f"{self.codec!r}")
        if self.preset not in X264_PRESETS:
            raise ValueError(f"video preset must be one of {', '.join(X264_PRESETS)}, got "
                             f"{self.preset!r}")
        if not 0 <= self.crf <= 51:
            raise ValueError(f"video crf must be within 0..51, got {self.crf}")
        if self.threads < 0:
            raise ValueError(f"video threads must be >= 0 (0: one per core), got {self.threads}")


# libx264 preset -> the NVENC preset of similar speed rank (p1 fastest .. p7 slowest).
_NVENC_PRESET = {"ultrafast": "p1", "superfast": "p1", "veryfast": "p2", "faster": "p3",
                 "fast": "p4", "medium": "p4", "slow": "p5", "slower": "p6", "veryslow": "p7"}
_nvenc_ok: bool | None = None
_nvenc_lock = threading.Lock()


def nvenc_available() -> bool:
    """Whether ``h264_nvenc`` opens in this process (probed once, with a tiny clip)."""
    global _nvenc_ok
    with _nvenc_lock:
        if _nvenc_ok is None:
            try:
                _encode_mp4_with(np.zeros((2, 256, 256, 3), np.uint8), 8, "h264_nvenc",
                                 VideoSettings())
                _nvenc_ok = True
            except Exception as exc:  # no driver library, no GPU, no session: all the same
                log.info("h264_nvenc does not open here (%s); MP4s use libx264", exc)
                _nvenc_ok = False
        return _nvenc_ok


def encode_mp4(frames: np.ndarray, fps: int, settings: VideoSettings | None = None) -> bytes:
    """H.264 MP4 bytes of (F, H, W, 3) uint8 frames (yuv420p, playable everywhere).

    libx264 output is deterministic for any thread count: the same frames and settings give
    the same bytes with the same FFmpeg build (the muxer writes no time stamps of its own).
    """
    settings = settings or VideoSettings()
    _check_frames(frames)
    codec = resolve_codec(settings)
    with defined_heap():
        return _encode_mp4_with(frames, fps, codec, settings)


def resolve_codec(settings: VideoSettings) -> str:
    """The codec an MP4 is written with: ``auto`` resolved, an unusable NVENC refused."""
    codec = settings.codec
    if codec == "auto":
        return "h264_nvenc" if nvenc_available() else "libx264"
    if codec == "h264_nvenc" and not nvenc_available():
        raise StageError("video codec h264_nvenc was asked for but does not open on this "
                         "machine; set video_codec to 'auto' or 'libx264'")
    return codec


def _check_frames(frames: np.ndarray) -> None:
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"expected (F, H, W, 3) uint8 frames, got {frames.shape} {frames.dtype}")
    _, height, width, _ = frames.shape
    if height % 2 or width % 2:
        raise ValueError(f"H.264 yuv420p needs even sizes, got {width}x{height}")


# glibc's mallopt(M_PERTURB, byte): fill every heap block malloc hands out with that byte.
_M_PERTURB = -6
_heap_lock = threading.Lock()


@contextlib.contextmanager
def defined_heap() -> Iterator[None]:
    """Make the encoder's uninitialised heap reads read a fixed byte.

    libx264 (through FFmpeg) reads heap memory it never wrote: with the same frames and
    settings, in a process whose heap other work (torch) has churned, the bytes and decoded
    pixels of an MP4 differed from one encode to the next (measured: 4 different outputs in
    6 encodes of one 32x32x5 clip, 2 in 5 at 480x832x9; with the heap filled by glibc's
    MALLOC_PERTURB_, always one). An encoder in its own process (the old ffmpeg binary)
    hid this. Turning glibc's perturb byte on for the encode makes those reads defined, so
    the same frames give the same bytes again. It costs a memset per block allocated
    meanwhile (in any thread). Not glibc: left as is. Held for a whole encode (from the
    encoder's opening to its flush: a streamed MP4's too), one encode at a time.
    """
    mallopt = _mallopt()
    if mallopt is None:
        yield
        return
    with _heap_lock:
        mallopt(_M_PERTURB, 0x5A)
        try:
            yield
        finally:
            mallopt(_M_PERTURB, 0)


@functools.cache
def _mallopt() -> Callable[[int, int], int] | None:
    import ctypes

    try:
        fn: Callable[[int, int], int] = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    return fn


def _encode_mp4_with(frames: np.ndarray, fps: int, codec: str, settings: VideoSettings) -> bytes:
    writer = Mp4Writer(frames.shape[2], frames.shape[1], fps, codec, settings)
    try:
        writer.write(frames)
        return writer.finish()
    finally:
        writer.close()


class Mp4Writer:
    """An MP4 encoded in memory frame by frame, for frames that arrive in chunks (a streamed
    decode) or all at once (:func:`encode_mp4`): the same frames give the same bytes either
    way. ``codec`` is resolved (:func:`resolve_codec`); the caller holds
    :func:`defined_heap` from the construction to :meth:`finish`. One thread uses it."""

    def __init__(self, width: int, height: int, fps: int, codec: str,
                 settings: VideoSettings) -> None:
        import av

        if height % 2 or width % 2:
            raise ValueError(f"H.264 yuv420p needs even sizes, got {width}x{height}")
        self.size = (height, width)
        self.written = 0
        """Frames written so far (the next frame's time stamp)."""
        self._buf = io.BytesIO()
        self._container: Any = av.open(self._buf, mode="w", format="mp4")
        stream: Any = self._container.add_stream(codec, rate=fps)  # a VideoStream here
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if codec == "libx264":
            stream.codec_context.thread_count = settings.threads
            stream.options = {"preset": settings.preset, "crf": str(settings.crf)}
        else:
            stream.options = {"preset": _NVENC_PRESET.get(settings.preset, "p4"),
                              "rc": "vbr", "cq": str(settings.crf)}
        # No library version strings in the container: bytes depend on frames and settings.
        bitexact: int = av.container.Flags.bitexact.value  # type: ignore[assignment]
        self._container.flags |= bitexact
        self._stream = stream

    def write(self, frames: np.ndarray) -> None:
        """Encode (F, H, W, 3) uint8 frames, the next ones of the video."""
        import av

        _check_frames(frames)
        if frames.shape[1:3] != self.size:
            raise ValueError(f"frames of {frames.shape[2]}x{frames.shape[1]} in a video of "
                             f"{self.size[1]}x{self.size[0]}")
        for frame in frames:
            video_frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")
            # Explicit time stamps: without them x264's rate control sees undefined frame
            # durations and the bytes (and pixels) of the same frames vary from run to run.
            video_frame.pts = self.written
            self.written += 1
            for packet in self._stream.encode(video_frame):
                self._container.mux(packet)

    def finish(self) -> bytes:
        """Flush the encoder's delayed frames, close the file; its bytes."""
        for packet in self._stream.encode():
            self._container.mux(packet)
        self._container.close()
        return self._buf.getvalue()

    def close(self) -> None:
        """Release the encoder (after :meth:`finish`, or instead of it: the bytes are lost)."""
        with contextlib.suppress(Exception):  # a failed encoder may fail to close too
            self._container.close()


def read_mp4(data: bytes) -> np.ndarray:
    """(F, H, W, 3) uint8 RGB frames of MP4 bytes (tests and benchmarks read results back)."""
    import av

    with av.open(io.BytesIO(data), mode="r") as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
