"""The stage adapters' interfaces, the decoded artifact, and a task's family (one adapter of
each role, :func:`get_family`; the table of which module serves a task:
:mod:`workers.models.family`; what the three share, :class:`StageAdapter`:
:mod:`workers.models.adapter`).

Importing this module is cheap: a family module (and with it torch and diffusers) is imported
when an adapter of that family is first asked for (:meth:`StageAdapter.for_task`).

Stage contract (one request, batch size 1):

* encoder:      ``encode(req, image_bytes) -> tensors``  (text/image conditioning)
* transformer:  ``denoise(req, tensors) -> tensors``     (owns scheduler and initial noise)
* decoder:      ``decode(req, tensors) -> Artifact``     (VAE decode + media encoding)

Nothing but the request and the tensor dictionary travels between stages, so each stage can
run in its own process on its own device.
"""

from __future__ import annotations

import contextlib
import time
from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from contracts.errors import ModelLoadError, StageCancelled, StageError, StageInputError
from contracts.pipelines import task_spec
from contracts.request import GenerationRequest
from contracts.roles import Role
from contracts.stage_options import StageOptions

from .adapter import StageAdapter
from .components import check_backend_name, check_request_task, warmup_geometry
from .family import adapter_class
from .media import VideoSettings
from .prompt_cache import PromptCache, PromptKey, image_digest

if TYPE_CHECKING:
    import torch

    from contracts.recipes import Recipe

    from .dit.dit_requests import RequestOptions
    from .loop_state import LoopHooks


@dataclass(frozen=True, eq=False)
class Artifact:
    """The decoded result: encoded media bytes plus the exact pixels they were made from."""

    data: bytes
    """The file: PNG for images, MP4 (H.264) for videos."""
    media_type: str
    """``image/png`` or ``video/mp4``."""
    extension: str
    """``png`` or ``mp4``."""
    frames: np.ndarray
    """uint8 pixels, (H, W, 3) for an image, (F, H, W, 3) for a video. MP4 is lossy; compare
    pixels here, not decoded MP4 frames."""
    fps: int | None = None
    """Frame rate of a video artifact."""


StepCallback = Callable[[int, int], None]
StopCheck = Callable[[], bool]


@dataclass(frozen=True)
class FrameChunks:
    """A video decode that hands its frames over chunk by chunk
    (:meth:`DecoderAdapter.frame_chunks`)."""

    frames: int
    """How many frames the chunks add up to."""
    run: Callable[[Callable[[torch.Tensor], None]], None]
    """Decode, calling ``each(chunk)`` with every chunk in order: pixels in [0, 1] on the
    stage's device, channels last, (f, H, W, 3): the rows of what :meth:`decode_tensor`
    returns for the whole video, value for value."""


class PendingMedia:
    """A decoded result whose media file may still be being encoded: :meth:`result` waits
    for it (and raises its encoder's error), :meth:`cancel` drops it."""

    def __init__(self, finish: Callable[[], Artifact], cancel: Callable[[], None] | None = None
                 ) -> None:
        self._finish = finish
        self._cancel = cancel

    def result(self) -> Artifact:
        return self._finish()

    def cancel(self) -> None:
        if self._cancel is not None:
            self._cancel()


class EncoderAdapter(StageAdapter):
    """Stage 1: text (and image) conditioning for the DiT.

    :meth:`encode` is the same for every family: the input image is decoded once
    (:meth:`load_image`), the text embeddings come from the prompt cache when it holds them
    (else from :meth:`encode_text`, and are then cached), and the image conditioning is
    added (:meth:`encode_image`). A family fills in those three and :meth:`guidance_on`.
    """

    role = Role.ENCODER
    cache: PromptCache | None = None
    """The prompt-embedding cache (None: every request runs the text encoder)."""
    text_sees_image: bool = False
    """Whether the text embeddings depend on the input image (Qwen Edit's vision-language
    prompt): its digest is then part of the cache key."""

    def encode(
        self, req: GenerationRequest, image_bytes: bytes | None = None
    ) -> dict[str, torch.Tensor]:
        """Everything the transformer stage needs, as contiguous tensors on this stage's
        device. ``image_bytes`` is the encoded input image (PNG/JPEG) of I2V / I2I tasks."""
        self._require_loaded()
        check_request_task(req, self.task, self.role)
        image = self.load_image(req, image_bytes)
        key = self.prompt_key(req, image_bytes) if self.cache is not None else None
        text = self.cache.get(key) if self.cache is not None and key is not None else None
        if text is None:
            text = self.encode_text(req, image)
            if self.cache is not None and key is not None:
                self.cache.put(key, text)
        out = {**text, **self.encode_image(req, image)}
        out = {k: v.contiguous() for k, v in out.items()}
        self._synchronize()
        return out

    def prompt_key(self, req: GenerationRequest, image_bytes: bytes | None) -> PromptKey:
        """The cache key of ``req``'s text embeddings: model, pipeline, prompts, settings."""
        guided = self.guidance_on(req)
        return PromptKey(
            model=str(self.model_dir.resolve()),
            pipeline=self.task,
            dtype=self.dtype_name,
            device=self.device_name,
            prompt=req.prompt,
            negative_prompt=req.negative_prompt if guided else None,
            settings=(req.max_sequence_length, guided),
            image_digest=image_digest(image_bytes) if self.text_sees_image else None,
        )

    def load_image(self, req: GenerationRequest, image_bytes: bytes | None) -> Any:
        """The decoded input image of I2V / I2I tasks; None for text-only tasks, which
        refuse an image."""
        if image_bytes is not None:
            raise StageInputError(f"{self.task} takes no input image, but one was given")
        return None

    def guidance_on(self, req: GenerationRequest) -> bool:
        """Whether this request uses classifier-free guidance (negative embeddings made)."""
        raise NotImplementedError(f"{type(self).__name__} must implement guidance_on")

    def encode_text(self, req: GenerationRequest, image: Any) -> dict[str, torch.Tensor]:
        """The text embeddings (prompt, and negative prompt under guidance)."""
        raise NotImplementedError(f"{type(self).__name__} must implement encode_text or encode")

    def encode_image(self, req: GenerationRequest, image: Any) -> dict[str, torch.Tensor]:
        """The image conditioning of I2V / I2I tasks (none for text-only tasks)."""
        return {}


class TransformerAdapter(StageAdapter):
    """Stage 2: the denoising loop. Owns the DiT, the whole scheduler and the initial noise.

    Options (all off by default; with them off the loop is diffusers' pipeline op for op):

    * ``compile``: ``torch.compile`` the DiT's repeated blocks at load (regional compilation:
      one block is compiled and its code reused by all, minutes of compile become seconds).
      Compilation happens at the first call of each shape, so a worker runs
      :meth:`warm_up` before it takes requests.
    * ``cfg_batch``: the conditional and unconditional CFG branches run as one batch-2
      forward instead of two batch-1 forwards (same math, other kernel shapes: equal within
      the dtype's rounding, not bit for bit).
    * ``group``: this process is one rank of a transformer group (a
      :class:`~workers.models.dit.parallel.GroupMesh`): CFG-parallel (``cfg_split``) and
      sequence-parallel forwards (:mod:`workers.models.dit.parallel`).
    """

    role = Role.TRANSFORMER
    transformer: Any
    """The DiT (a diffusers model), set by the family's ``_load``."""
    requests: RequestOptions | None = None
    """Per-request LoRA adapters and step cache, set at load (None: no model)."""
    active_expert: str | None = None
    """Wan2.2-A14B: the expert of the step that ran last (``high`` / ``low``); None for a
    one-DiT model. What the worker's progress reports carry to status and events."""

    def __init__(
        self,
        model_dir: str | Path,
        task: str,
        device: str = "cpu",
        dtype: str = "float32",
        attention: str = "sdpa",
        compile: bool = False,
        cfg_batch: bool = False,
        options: StageOptions | None = None,
        budget_shapes: Sequence[str] = (),
        group: Any = None,
        attention_fallback: str | None = None,
        dit_file: str | None = None,
    ) -> None:
        super().__init__(model_dir, task, device, dtype, options)
        self.dit_file = dit_file
        self.group = group
        self.cfg_split: Any = None
        """Set by :func:`~workers.models.dit.parallel.attach_group` in a CFG-2 group."""
        self.budget_shapes = tuple(budget_shapes)
        check_backend_name(attention)
        self.attention = attention
        if attention_fallback is not None:
            check_backend_name(attention_fallback)
        self.attention_fallback = attention_fallback
        """The backend run where ``attention`` cannot (None: refuse to load)."""
        self.compile = compile
        self.cfg_batch = cfg_batch

    def _resolve_settings(self) -> None:
        super()._resolve_settings()
        import dataclasses

        if self.options.fused:  # merged into the DiT's weights before they are placed
            self.placement = dataclasses.replace(self.placement, before=self._fuse)
        if self.options.linear == "fp8":  # converted block by block on the device
            self.placement = dataclasses.replace(self.placement, resident=self._fp8_linear)

    def _fp8_linear(self, model: Any) -> None:
        from .dit.dit_options import apply_fp8_linear

        apply_fp8_linear(model, self.device)

    def _fuse(self, model: Any, half: str | None = None) -> None:
        """``half``: the Wan2.2-A14B expert ``model`` is (each gets its half of a pair)."""
        from .dit.lora import fuse

        assert self.options.lora_dir is not None  # StageOptions requires it with lora_fuse
        fuse(model, self.spec.family, Path(self.options.lora_dir), self.options.fused, half)

    def load(self) -> None:
        if self._loaded:
            return
        super().load()
        if self.group is not None:
            from .dit.parallel import attach_group

            attach_group(self)
        if self.options.compile_cache_dir is not None:
            from .dit.dit_options import configure_compile_cache

            configure_compile_cache(self.options.compile_cache_dir)
        if self.torch_model:
            from .dit.dit_requests import RequestOptions

            self.requests = RequestOptions(self.dits(), self.spec.family, self.task,
                                           self.options, self.compile,
                                           self.recipe_name(), self.dit_halves())
        if self.compile:
            # Blocks only: the embeddings and RoPE tables around them change shape with the
            # request and are cheap; dynamic=None lets a second text length turn that
            # dimension symbolic instead of compiling once per prompt length.
            for dit in self.dits():
                dit.compile_repeated_blocks(dynamic=None)

    def dits(self) -> list[Any]:
        """The DiTs of this stage: one, or Wan2.2-A14B's two experts (high-noise first).
        FP8 linear layers and compile apply to each."""
        return [self.transformer]

    def dit_halves(self) -> list[str] | None:
        """The experts :meth:`dits` are, where this worker holds part of a two-expert
        checkpoint (``split``); None: all of the model's DiTs."""
        return None

    def working_bytes(self) -> int:
        """Activations of one DiT forward at the largest of ``budget_shapes`` (the worker's
        ``warmup_shapes``) and kernel workspace (:func:`.memory.dit_working_bytes`)."""
        from .memory import dit_working_bytes

        return dit_working_bytes(self._config("transformer"), self.spec.output,
                                 self.budget_shapes, self.cfg_batch, self.dtype.itemsize)

    def warm_up(self, shapes: Sequence[str], steps: int = 2) -> float:
        """Run short denoising loops on synthetic inputs of each geometry ("HxW" for images,
        "HxWxF" for videos), with CFG unless the stage's recipe is CFG-distilled (then at the
        recipe's guidance, the path its requests take), so that compilation, kernel selection
        and allocator growth happen now and not in the first requests. Returns the seconds
        it took."""
        found = self.served_recipe()
        guidance: dict[str, Any] = {}
        if found is not None and found.cfg_distilled:
            guidance = {found.guidance_key: found.request_defaults[found.guidance_key]}
        t0 = time.perf_counter()
        for shape in shapes:
            geometry = warmup_geometry(shape, self.spec)
            for variant in range(self.warmup_variants):
                req = GenerationRequest(
                    task=self.task, prompt="warm-up", infer_steps=steps, **geometry,
                    **guidance)
                self.denoise(req, self.warmup_inputs(req, variant))
                if self.requests is not None:  # compiled adapter slots: their path too
                    self.requests.warm(self._denoise, req, self.warmup_inputs(req, variant))
        return time.perf_counter() - t0

    def _check_fp8_rows(self, tokens: int) -> None:
        """With FP8 linear layers, refuse a request of fewer than ``FP8_MIN_TOKENS`` image /
        video tokens (``tokens``: one sample's, after patching) before its first step."""
        if self.options.linear == "fp8":
            from .dit.dit_options import check_fp8_rows

            check_fp8_rows(self.task, tokens)

    warmup_variants: ClassVar[int] = 1
    """How many input variants :meth:`warm_up` runs per shape (Qwen: two text lengths)."""

    @abstractmethod
    def warmup_inputs(self, req: GenerationRequest, variant: int) -> dict[str, torch.Tensor]:
        """Synthetic encoder outputs of the right shapes and dtypes for ``req``."""

    def denoise(
        self,
        req: GenerationRequest,
        tensors: Mapping[str, torch.Tensor],
        on_step: StepCallback | None = None,
        should_stop: StopCheck | None = None,
        loop: LoopHooks | None = None,
    ) -> dict[str, torch.Tensor]:
        """Run the denoising loop; returns ``{"latents": ...}`` in the VAE's latent layout.

        ``on_step(k, n)`` is called after step k of n; ``should_stop()`` is polled before
        every step and a True answer raises :class:`StageCancelled`. ``loop``: where the loop
        starts (a checkpoint) and what runs at each step boundary
        (:mod:`workers.models.loop_state`). On a GPU it returns after the device finished
        (so that timing it measures the work, not the launches). The request's LoRA adapters
        and step cache are on for this loop only (:mod:`workers.models.dit.dit_requests`).
        """
        self._require_loaded()
        with self.requests.scope(req) if self.requests else contextlib.nullcontext():
            return self._denoise(req, tensors, on_step, should_stop, loop)

    def offers(self) -> dict[str, Any]:
        """What requests may ask of this stage (its adapters, its cache kinds), what it
        always runs (its fused adapters) and its recipe (:mod:`contracts.recipes`)."""
        r = self.requests
        if r is None:
            return {}
        return {"loras": r.lora_names(), "caches": r.cache_kinds(),
                "fused": [f.to_dict() for f in self.options.fused],
                "recipe": r.recipe.name if r.recipe is not None else None}

    def scheduler_overrides(self) -> dict[str, Any]:
        """Scheduler config values replacing the folder's: ``transformer.flow_shift``, else
        the recipe's settings (Wan's shift, Qwen-Image-Lightning's scheduler)."""
        found = self.served_recipe()
        out: dict[str, Any] = dict(found.scheduler) if found is not None else {}
        shift = self.options.flow_shift or (found.flow_shift if found is not None else None)
        if shift is not None:
            out["flow_shift"] = shift
        return out

    def served_recipe(self) -> Recipe | None:
        """The recipe this stage serves (:meth:`recipe_name`), None: none."""
        from contracts.recipes import recipe

        return recipe(self.recipe_name(), self.spec.family)

    def recipe_name(self) -> str | None:
        """The service's recipe, else the one the model folder declares."""
        from contracts.recipes import folder_recipe, recipe

        name = self.options.recipe or folder_recipe(self.model_dir)
        recipe(name, self.spec.family)  # one for the other family is refused here
        return name

    @abstractmethod
    def _denoise(self, req: GenerationRequest, tensors: Mapping[str, torch.Tensor],
                 on_step: StepCallback | None = None, should_stop: StopCheck | None = None,
                 loop: LoopHooks | None = None) -> dict[str, torch.Tensor]:
        """The family's denoising loop (:meth:`denoise` around it)."""

    @staticmethod
    def _check_stop(should_stop: StopCheck | None, done: int, total: int) -> None:
        if should_stop is not None and should_stop():
            raise StageCancelled(f"denoising cancelled after {done} of {total} steps", done, total)

    def _branches(self, cfg: bool, forward: Callable[..., torch.Tensor],
                  cond: Sequence[Any], uncond: Sequence[Any],
                  both: Callable[..., tuple[torch.Tensor, torch.Tensor]],
                  both_args: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One step's predictions: the conditional one (``forward(*cond)``) and, with
        ``cfg``, the unconditional one (``forward(*uncond)``), however this worker runs the
        two branches -- one on each rank of a CFG-2 group (``cfg_split``), as one batch of
        two (``cfg_batch``: ``both(*both_args)``), or one after the other, conditional
        first, as diffusers does. How the two combine is the family's."""
        if not cfg:
            return forward(*cond), None
        if self.cfg_split is not None:
            pair: tuple[torch.Tensor, torch.Tensor] = self.cfg_split.both(forward, cond, uncond)
            return pair
        if self.cfg_batch:
            return both(*both_args)
        return forward(*cond), forward(*uncond)


class DecoderAdapter(StageAdapter):
    """Stage 3: VAE decode of the final latents and media encoding.

    Two halves, so that a worker can move the second off its critical path:
    :meth:`decode_pixels` (the VAE, on the stage's device; uint8 pixels on the CPU) and
    :meth:`encode_media` (PNG or MP4 of those pixels, CPU only). :meth:`decode` does both.
    """

    role = Role.DECODER

    def __init__(
        self,
        model_dir: str | Path,
        task: str,
        device: str = "cpu",
        dtype: str = "float32",
        video: VideoSettings | None = None,
        options: StageOptions | None = None,
    ) -> None:
        super().__init__(model_dir, task, device, dtype, options)
        self.video = video or VideoSettings()

    def load(self) -> None:
        if self._loaded:
            return
        super().load()
        if self.options.vae_tiling:
            vae = getattr(self, "vae", None)
            if vae is None or not hasattr(vae, "enable_tiling"):
                raise ModelLoadError(f"decoder.vae_tiling: the {self.task} decoder's VAE "
                                     "offers no tiled decode")
            vae.enable_tiling()

    @abstractmethod
    def decode_tensor(
        self, req: GenerationRequest, tensors: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        """Decoded pixels in [0, 1] on this stage's device, channels last: (H, W, 3) or
        (F, H, W, 3); the values diffusers' postprocessing has before its numpy conversion."""

    def decode_float(
        self, req: GenerationRequest, tensors: Mapping[str, torch.Tensor]
    ) -> np.ndarray:
        """Decoded pixels as float32 in [0, 1]: (H, W, 3) or (F, H, W, 3). Exactly what
        diffusers' pipeline returns with ``output_type="np"`` (minus the batch axis)."""
        return self.decode_tensor(req, tensors).float().cpu().numpy()

    def decode_pixels(
        self, req: GenerationRequest, tensors: Mapping[str, torch.Tensor]
    ) -> np.ndarray:
        """Decoded uint8 pixels on the CPU, equal to ``to_uint8(decode_float(...))``.

        The float -> uint8 step runs on the stage's device: the same IEEE float32 multiply
        and round-half-to-even as numpy's, on a quarter of the bytes to copy back (for a
        480x832x81 video, 97 MB instead of 388 MB, and no CPU pass over 97 M floats).
        """
        import torch

        with torch.no_grad():
            pixels = self.decode_tensor(req, tensors).float().mul(255).round().to(torch.uint8)
            # Contiguous on the device: one dense copy to the host, not a strided one
            # (decode_tensor is a channels-last view of the VAE's output).
            return pixels.contiguous().cpu().numpy()

    def encode_media(self, req: GenerationRequest, pixels: np.ndarray) -> Artifact:
        """PNG (image) or MP4 (video) of uint8 pixels; CPU only, safe off the main thread."""
        from .media import encode_mp4, encode_png

        if self.spec.output == "image":
            return Artifact(encode_png(pixels), "image/png", "png", pixels)
        assert req.fps is not None  # validated for video tasks
        data = encode_mp4(pixels, req.fps, self.video)
        return Artifact(data, "video/mp4", "mp4", pixels, fps=req.fps)

    def frame_chunks(
        self, req: GenerationRequest, tensors: Mapping[str, torch.Tensor]
    ) -> FrameChunks | None:
        """The decode of a video chunk by chunk, or None where this decoder decodes in one
        piece (images, tiled decodes, families without a causal VAE)."""
        return None

    def decode_media(
        self, req: GenerationRequest, tensors: Mapping[str, torch.Tensor],
        should_stop: StopCheck | None = None,
    ) -> PendingMedia:
        """Decode on the device; returns when the device is done, with the media encoding
        pending (:meth:`PendingMedia.result`).

        Where the decoder streams (:meth:`frame_chunks`), the MP4 is encoded on a background
        thread while the VAE decodes (:mod:`workers.models.media_stream`): each chunk is
        converted to uint8 on the device as :meth:`decode_pixels` does and copied into the
        result's pixel array, then queued to the writer; what is pending on return is the
        encoder's tail. The pixels and the MP4 are those of the serial path (the same values,
        the same frames fed to the same encoder). Elsewhere the pixels are decoded here and
        encoded in :meth:`PendingMedia.result`. ``should_stop()`` is polled between chunks
        (a True answer raises :class:`StageCancelled`).
        """
        chunks = self.frame_chunks(req, tensors)
        if chunks is None:
            pixels = self.decode_pixels(req, tensors)
            return PendingMedia(lambda: self.encode_media(req, pixels))
        return self._decode_streamed(req, chunks, should_stop)

    def _decode_streamed(self, req: GenerationRequest, chunks: FrameChunks,
                         should_stop: StopCheck | None) -> PendingMedia:
        import torch

        from .media_stream import Mp4Stream

        assert req.fps is not None  # validated for video tasks
        fps = req.fps
        pixels: np.ndarray | None = None
        done = 0
        stream = Mp4Stream(fps, self.video)

        def each(chunk: torch.Tensor) -> None:
            nonlocal pixels, done
            if should_stop is not None and should_stop():
                raise StageCancelled(f"decode cancelled after {done} of {chunks.frames} frames")
            n, height, width, _ = chunk.shape
            if pixels is None:  # allocated before the writer holds the heap's perturb window
                pixels = np.empty((chunks.frames, height, width, 3), np.uint8)
            if done + n > chunks.frames:
                raise StageError(f"the VAE decoded more than the {chunks.frames} frames "
                                 "expected of these latents")
            rows = pixels[done:done + n]
            with torch.no_grad():  # decode_pixels' conversion, one chunk of rows
                torch.from_numpy(rows).copy_(
                    chunk.float().mul(255).round().to(torch.uint8).contiguous())
            stream.put(rows)
            done += n

        try:
            chunks.run(each)
            if done != chunks.frames:
                raise StageError(f"the VAE decoded {done} frames, {chunks.frames} expected")
        except BaseException:
            stream.abort()
            raise
        self._synchronize()
        assert pixels is not None
        result = pixels

        def finish() -> Artifact:
            return Artifact(stream.finish(), "video/mp4", "mp4", result, fps=fps)

        return PendingMedia(finish, stream.abort)

    def decode(self, req: GenerationRequest, tensors: Mapping[str, torch.Tensor]) -> Artifact:
        """Decode and encode the result as PNG (image) or MP4 (video)."""
        return self.decode_media(req, tensors).result()


@dataclass(frozen=True)
class ModelFamily:
    """The adapters that serve one task."""

    task: str
    encoder: type[EncoderAdapter]
    transformer: type[TransformerAdapter]
    decoder: type[DecoderAdapter]
    pipeline_class: str | None
    """Name of diffusers' one-process pipeline for this task (the reference in tests); None
    for the synthetic family, which has no model."""


def get_family(task: str) -> ModelFamily:
    """The adapters serving ``task``. Imports the family module, and with it torch."""
    encoder = adapter_class(task, Role.ENCODER)
    transformer = adapter_class(task, Role.TRANSFORMER)
    decoder = adapter_class(task, Role.DECODER)
    assert issubclass(encoder, EncoderAdapter) and issubclass(decoder, DecoderAdapter)
    assert issubclass(transformer, TransformerAdapter)
    return ModelFamily(task=task, encoder=encoder, transformer=transformer, decoder=decoder,
                       pipeline_class=task_spec(task).pipeline_class)
