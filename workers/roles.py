"""The three worker roles: each fills in steps 2-5 of the pull loop (:mod:`workers.worker`)
with its model stage."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from contracts import faults
from contracts.config import ServiceConfig
from contracts.errors import ConnectionLost, DiffringError, ResultWriteBlocked, storage_fault
from contracts.messages import (
    Complete,
    CompleteReply,
    Empty,
    Fault,
    Handoff,
    Kind,
    Take,
    TakeReply,
)
from contracts.request import GenerationRequest
from contracts.roles import Role
from contracts.stage_options import SPLIT_EXPERTS
from tensorplane.descriptor import TensorDescriptor
from tensorplane.handoff import pull_tensors, stage_tensors
from workers.checkpoints import DitCheckpoints
from workers.encode_pool import EncodePool
from workers.held import Held, HeldResults
from workers.models import (
    Artifact,
    DecoderAdapter,
    EncoderAdapter,
    PendingMedia,
    TransformerAdapter,
)
from workers.models.media import VideoSettings
from workers.models.prompt_cache import PromptCache
from workers.startup import StopSignal
from workers.triage import check_item, describe_failure
from workers.worker import Idle, Job, StageWorker, State

log = logging.getLogger("diffring.worker")

TAKE_POLL_S = 0.01
"""How often an idle low-noise worker (``split``) asks for a handed-over task: part of the
handover's latency (at most this), one small control call per poll."""


def _request(job: Job) -> GenerationRequest:
    return GenerationRequest.from_dict(job.item["request"])


def _size(req: GenerationRequest) -> str:
    """A request's geometry as an out-of-memory error names it."""
    size = f"{req.width}x{req.height}" if req.width and req.height else "the input's size"
    return f"{size} x {req.num_frames} frames" if req.num_frames and req.num_frames > 1 else size


class ProducerWorker(StageWorker):
    """A role whose outputs go to the next stage through a ring (encoder, transformer)."""

    output_kind: ClassVar[Kind]

    def publish(self, job: Job, outputs: Mapping[str, Any]) -> None:
        """Stage the outputs and push their descriptors to the next ring (backpressure)."""
        out_ring = self.link.out_ring
        assert out_ring is not None
        with self.timed("stage"):
            descs = stage_tensors(self.pool, self.engine, dict(outputs), task_id=job.task_id)
        self.staged.put((job.task_id, job.attempt), descs)
        payload = {
            "kind": self.output_kind.value,
            "task_id": job.task_id,
            "attempt": job.attempt,
            "pipeline": job.item["pipeline"],
            "request": job.item["request"],
            "tensors": [d.to_dict() for d in descs],
            "producer": self.name,
        }
        body = out_ring.encode(payload)
        delay = 0.001
        with self.timed("publish"):
            while not out_ring.try_push_body(body):
                self.check_cancel(job)  # a cancelled task gives its place up
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
        self.metrics.claim_seconds.labels(out_ring.name, "push").observe(
            out_ring.stats.last_claim_s
        )

    def release(self, job: Job) -> None:
        """The next stage has the task: report the handoff (the lease ends)."""
        self.link.call(Handoff(task_id=job.task_id, attempt=job.attempt), Empty)


class EncoderWorker(ProducerWorker):
    role = Role.ENCODER
    adapter = EncoderAdapter
    output_kind = Kind.PHASE1

    def adapter_options(self) -> dict[str, Any]:
        return {"options": self.cfg.encoder}

    def load_model(self) -> None:
        super().load_model()
        if self.cfg.prompt_cache_mb:
            self.stage.cache = PromptCache(self.cfg.prompt_cache_mb << 20)
            self.metrics.watch_prompt_cache(self.stage.cache.stats)

    def fetch_inputs(self, job: Job) -> bytes | None:
        """The input image of I2V / I2I tasks, pulled from the controller's pool."""
        if not job.item.get("image"):
            return None
        # The controller owns the staged image until the task ends (a retry needs it).
        desc = TensorDescriptor.from_dict(job.item["image"])
        out = pull_tensors(
            self.engine, self.pool, [desc], device="cpu", task_id=job.task_id, release=False,
            arrays="numpy",
        )
        data: bytes = out[desc.name].tobytes()
        return data

    def compute(self, job: Job, inputs: bytes | None) -> dict[str, Any]:
        req = _request(job)
        with self.stage.guarded(_size(req)):
            return self.stage.encode(req, inputs)


class TransformerWorker(ProducerWorker):
    """The DiT's loop, checkpointed when ``transformer.checkpoint_every_*`` is set
    (:mod:`workers.checkpoints`): a resume item starts from the kept checkpoint, a drain or
    a preemption hands the task back at a step boundary, and the final latents are kept by
    the controller until the result is written."""

    role = Role.TRANSFORMER
    adapter = TransformerAdapter
    output_kind = Kind.PHASE2

    def __init__(self, cfg: ServiceConfig, token: str, env: Mapping[str, str]) -> None:
        super().__init__(cfg, token, env)
        self.checkpoints = DitCheckpoints(cfg.transformer, self.metrics, self.name)
        self.link.on_registered = self.checkpoints.registered
        self.low = cfg.transformer.experts == "low"
        """``split``'s low-noise worker: its input is the tasks handed over at the boundary,
        which the controller holds and hands out (``take``), not the Phase1 ring."""

    def claim(self) -> Job | Idle:
        """Step 1; a low-noise worker (``split``) asks the controller, which claims the task
        for it in the same step (its lease starts with the reply)."""
        if not self.low:
            return super().claim()
        if self.link.heartbeats.lost.is_set():
            raise ConnectionLost(f"control channel to {self.link.where} lost")
        item = self.link.call(Take(), TakeReply).item
        if item is None:
            return Idle.EMPTY
        job = Job(item["task_id"], item["attempt"], item)
        problem = check_item(item, self.role, self.cfg.pipeline)
        if problem is not None:  # claimed: handed back as a failure, never dropped silently
            self.current = job
            try:
                self._fail(job, problem, "StageInputError", Fault.INPUT)
            finally:
                self.current = None
            return Idle.SKIPPED
        return job

    def wait_for_work(self) -> None:
        """A low-noise worker polls the controller (no ring, so no doorbell) every
        :data:`TAKE_POLL_S`; a drain or close wakes it at once."""
        if not self.low:
            super().wait_for_work()
            return
        self._wake.wait(TAKE_POLL_S)

    def adapter_options(self) -> dict[str, Any]:
        return transformer_options(self.cfg)

    def load_model(self) -> None:
        """Load the DiT, then warm it up (compile) before the worker registers: the first
        request must not pay for the compiler."""
        self.checkpoints.start(self.link.call, self.pool, self.engine)
        super().load_model()
        if self.cfg.warmup_shapes:
            seconds = self.stage.warm_up(self.cfg.warmup_shapes)
            self.metrics.stage_seconds.labels(self.role.value, "warmup").observe(seconds)
            log.info("worker %s: warm-up of %s took %.1f s (compile=%s)", self.name,
                     ", ".join(self.cfg.warmup_shapes), seconds, self.cfg.compile)

    def offers(self) -> dict[str, Any]:
        experts = self.cfg.transformer.experts
        return {**self.stage.offers(), "checkpoints": self.checkpoints.wanted,
                **({"experts": experts} if experts in SPLIT_EXPERTS else {})}

    def fetch_inputs(self, job: Job) -> dict[str, Any]:
        if job.item.get("resume"):  # the controller's resume item: its kept checkpoint
            inputs, job.resume = self.checkpoints.fetch(
                self.link.call, self.engine, self.pool, job, self.cfg.device,
                self.stage.tensor_kind)
            return inputs
        return self.pull(job)

    def yield_reason(self, job: Job) -> str | None:
        """Why the loop should hand ``job`` back at this step boundary (None: go on)."""
        if self.state is not State.RUNNING or self._stop.asked:
            return "drain"
        return "preempted" if job.yield_asked.is_set() else None

    def compute(self, job: Job, inputs: dict[str, Any]) -> dict[str, Any]:
        # Steps are reported in the background (workers.progress): no round trip between
        # two denoising steps. A cancel in a reply sets job.cancel, checked before each;
        # all reports are answered before the outputs are published.
        req = _request(job)
        hooks = self.checkpoints.hooks(job, inputs, lambda: self.yield_reason(job))
        with self.stage.guarded(_size(req)):
            out: dict[str, Any] = self.stage.denoise(
                req, inputs,
                on_step=lambda k, n: self._step(job, k, n),
                should_stop=job.cancel.is_set,
                loop=hooks,
            )
        self.progress.flush(job)
        job.result = out
        return out

    def _step(self, job: Job, step: int, steps: int) -> None:
        job.steps = steps
        self.progress.report(job, step, steps, self.stage.active_expert)

    def release(self, job: Job) -> None:
        """Send the final latents to the controller's keeping (a lost decoder then costs a
        decode), then report the handoff."""
        if job.result is not None and self.checkpoints.enabled:
            steps = job.steps or _request(job).infer_steps
            assert steps is not None
            self.checkpoints.send_final(job, job.result, steps)
        super().release(job)

    def close(self) -> None:
        self.checkpoints.close()
        super().close()


class DecoderWorker(StageWorker):
    """VAE decode on the critical path; a Wan video's MP4 is encoded on a background thread
    while the VAE decodes it, latent frame by latent frame (:meth:`DecoderAdapter.decode_media`),
    and what is left of the encoding (its tail, or the whole encode where the decode does
    not stream) is finished and written here or by a bounded background pool
    (:mod:`workers.encode_pool`, ``encode_queue`` > 0), so the decoder claims the next
    Phase2 item meanwhile. The task's lease stays with this worker until the background job
    reports the completion, after the file is fully written.

    A result whose write the storage refuses (here, or the controller's copy) is held and
    retried (:mod:`workers.held`), uncharged; each heartbeat reports what is held."""

    role = Role.DECODER
    adapter = DecoderAdapter
    encoder_pool: EncodePool | None = None

    def __init__(self, cfg: ServiceConfig, token: str, env: Mapping[str, str]) -> None:
        super().__init__(cfg, token, env)
        self.held = HeldResults(cfg.max_held_results, cfg.result_write_retry_s,
                                self._redeliver, self._give_up)
        self.metrics.watch_held(lambda: self.held.count)
        self.link.heartbeats.storage = self.held.report

    def adapter_options(self) -> dict[str, Any]:
        return {"video": video_settings(self.cfg), "options": self.cfg.decoder}

    def start(self, stop: StopSignal | None = None) -> None:
        if self.cfg.encode_queue > 0:
            self.encoder_pool = EncodePool(self.cfg.encode_queue, name="decoder-encode")
        self.held.start()
        super().start(stop)


    def claim(self) -> Job | Idle:
        # A full pool, or as many results held as allowed: claim nothing until a result is
        # written, so the ring item stays there for another decoder rather than wait here
        # (and no pixels pile up).
        for room in (self.encoder_pool, self.held):
            while room is not None and not room.wait_for_room(timeout=0.1):
                if self.state is not State.RUNNING:
                    return Idle.EMPTY
        return super().claim()

    def fetch_inputs(self, job: Job) -> dict[str, Any]:
        return self.pull(job)

    def compute(self, job: Job, inputs: dict[str, Any]) -> PendingMedia:
        """The device decode. A streamed decode's MP4 is being encoded meanwhile on a
        background thread (:meth:`DecoderAdapter.decode_media`); its tail (and a whole
        encode where the decoder does not stream) is left for :meth:`publish`."""
        req = _request(job)
        with self.stage.guarded(_size(req)):
            pending = self.stage.decode_media(req, inputs, should_stop=job.cancel.is_set)
        job.result = pending  # until published: a failure meanwhile stops its writer (_fail)
        return pending

    def publish(self, job: Job, outputs: PendingMedia) -> None:
        """Finish the media (``encode_media``: the encoder's tail, or the whole encode) and
        write the result file (atomically), here or in the background pool."""
        if self.encoder_pool is None:
            with self.timed("encode_media"):
                art = outputs.result()
            job.result = (art, self._write_or_hold(job, art))
            return
        job.result = _BACKGROUND
        with self.timed("queue"):
            self.encoder_pool.submit(lambda: self._finish(job, outputs))

    def _fail(self, job: Job, error: str, error_type: str, fault: Fault) -> None:
        if isinstance(job.result, PendingMedia):  # failed or cancelled before its publish
            job.result.cancel()
        super()._fail(job, error, error_type, fault)

    def _write(self, job: Job, art: Artifact) -> Path:
        """Write the result file; ResultWriteBlocked when the storage refuses it."""
        out_dir = Path(self.cfg.output_dir)
        local = out_dir / f"{job.task_id}.{art.extension}"
        tmp = local.with_name(local.name + ".part")
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            faults.hit("decoder.before_write", faults.no_space)
            tmp.write_bytes(art.data)
            faults.hit("decoder.result_write")
            tmp.replace(local)
        except OSError as exc:
            if not storage_fault(exc):
                raise
            with contextlib.suppress(OSError):  # a partial file takes the room a retry needs
                tmp.unlink(missing_ok=True)
            raise ResultWriteBlocked(f"cannot write the result to {local}: {exc}") from exc
        return local

    def _write_or_hold(self, job: Job, art: Artifact) -> Path | None:
        """The written file, or None: held (:meth:`_hold`)."""
        try:
            return self._write(job, art)
        except ResultWriteBlocked as exc:
            self._hold(job, art, exc, None)
            return None

    def _complete_or_hold(self, job: Job, art: Artifact, local: Path) -> None:
        try:
            self._complete(job, art)
        except ResultWriteBlocked as exc:
            self._hold(job, art, exc, local)

    def _hold(self, job: Job, art: Artifact, exc: ResultWriteBlocked, local: Path | None
              ) -> None:
        if not self.held.hold(job, art, str(exc), local):
            self._give_up(Held(job, art, str(exc), 0.0), (
                f"{exc}; {self.held.capacity} results are held already (max_held_results)"))

    def _redeliver(self, held: Held) -> None:
        """A retry of a held result (the holder's thread): what is not written yet."""
        if held.local is None:
            held.local = self._write(held.job, held.result)
        self._complete(held.job, held.result)

    def _give_up(self, held: Held, why: str) -> None:
        """Hand the task back uncharged (Fault.SYSTEM): the controller runs it again."""
        self.metrics.tasks.labels(self.role.value, "handed_back").inc()
        try:
            self._fail(held.job, f"{why}; handed back, not charged to the task",
                       "result_write_blocked", Fault.SYSTEM)
        except DiffringError as exc:  # gone with the connection: back in play already
            log.warning("task %s: hand-back not reported: %s", held.job.task_id, exc)

    def _finish(self, job: Job, pending: PendingMedia) -> None:
        """Background: finish the media (encode it, or wait for its streamed encode's tail),
        write it, then report the completion (the lease ends here)."""
        try:
            with self.timed("encode_media"):
                art = pending.result()
            local = self._write_or_hold(job, art)
            if local is not None:
                self._complete_or_hold(job, art, local)
        except ConnectionLost as exc:
            # The controller put this worker's tasks back in play when the connection went.
            log.warning("task %s: completion not reported, control channel lost: %s",
                        job.task_id, exc)
        except Exception as exc:
            self.metrics.tasks.labels(self.role.value, "failed").inc()
            self._fail(job, *describe_failure(exc))

    def release(self, job: Job) -> None:
        """Send the result to the controller; completing the task ends the lease. A result
        in the background pool is reported by its job instead."""
        if job.result is _BACKGROUND:
            return
        art, local = job.result
        if local is not None:  # else held: its retry reports it
            self._complete_or_hold(job, art, local)

    def _complete(self, job: Job, art: Artifact) -> None:
        reply = self.link.call(
            Complete(task_id=job.task_id, attempt=job.attempt, extension=art.extension,
                     media_type=art.media_type, data=art.data),
            CompleteReply)
        if reply.storage_error:
            raise ResultWriteBlocked(
                f"the controller cannot write the result: {reply.storage_error}"
            )
        if not reply.accepted:
            log.info(
                "task %s: result of attempt %d not needed (already completed)",
                job.task_id,
                job.attempt,
            )

    def wait_drained(self) -> None:
        # Draining, still heartbeating (the leases stay renewed): report every result the
        # pool is still writing before the worker stops.
        if self.encoder_pool is not None and not self.encoder_pool.join(
            timeout=self.cfg.drain_timeout_s
        ):
            log.warning("worker %s: results still being written after drain_timeout_s",
                        self.name)
        # Results the storage refuses are not waited for: another decoder (or this one,
        # restarted) runs their tasks again once it is fixed.
        self.held.close("the decoder is stopping")
        super().wait_drained()

    def close(self) -> None:
        # After a fatal error the controller has put this worker's tasks back in play: a
        # late result is refused there (the task completes once), never lost.
        if self.encoder_pool is not None:
            self.encoder_pool.close(timeout=self.cfg.lease_timeout_s)
        self.held.close("the decoder is stopping")
        super().close()


_BACKGROUND = "background"
"""``Job.result`` of a decode whose file the encode pool writes and reports."""


def transformer_options(cfg: ServiceConfig) -> dict[str, Any]:
    """The DiT stage's settings from a service's config (every rank of a group takes them)."""
    return {
        "attention": cfg.attention_backend,
        "attention_fallback": cfg.attention_fallback,
        "dit_file": cfg.dit_original_ckpt,
        "compile": cfg.compile,
        "cfg_batch": cfg.cfg_batch,
        "options": cfg.transformer,
        "budget_shapes": cfg.warmup_shapes,
    }


def video_settings(cfg: ServiceConfig) -> VideoSettings:
    return VideoSettings(
        codec=cfg.video_codec, preset=cfg.video_preset, crf=cfg.video_crf,
        threads=cfg.video_threads,
    )


WORKERS: dict[Role, type[StageWorker]] = {
    cls.role: cls for cls in (EncoderWorker, TransformerWorker, DecoderWorker)
}
