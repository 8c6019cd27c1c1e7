"""The three worker roles: each fills in steps 2-5 of the pull loop (:mod:`workers.worker`)
with its model stage."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from contracts.messages import Kind, Op
from contracts.request import GenerationRequest
from contracts.roles import Role
from tensorplane.descriptor import TensorDescriptor
from tensorplane.handoff import pull_tensors, stage_tensors
from workers.models import Artifact, DecoderAdapter, EncoderAdapter, TransformerAdapter
from workers.models.prompt_cache import PromptCache
from workers.worker import Job, StageWorker

log = logging.getLogger("diffring.worker")


def _request(job: Job) -> GenerationRequest:
    return GenerationRequest.from_dict(job.item["request"])


class ProducerWorker(StageWorker):
    """A role whose outputs go to the next stage through a ring (encoder, transformer)."""

    output_kind: ClassVar[Kind]

    def publish(self, job: Job, outputs: Mapping[str, Any]) -> None:
        """Stage the outputs and push their descriptors to the next ring (backpressure)."""
        assert self.out_ring is not None
        with self.timed("stage"):
            descs = stage_tensors(self.pool, self.engine, dict(outputs), task_id=job.task_id)
        key = (job.task_id, job.attempt)
        with self._staged_lock:
            self.staged[key] = descs
        payload = {
            "kind": self.output_kind.value,
            "task_id": job.task_id,
            "attempt": job.attempt,
            "pipeline": job.item["pipeline"],
            "request": job.item["request"],
            "tensors": [d.to_dict() for d in descs],
            "producer": self.name,
        }
        body = self.out_ring.encode(payload)
        delay = 0.001
        with self.timed("publish"):
            while not self.out_ring.try_push_body(body):
                self.check_cancel(job)  # a cancelled task gives its place up
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
        self.metrics.claim_seconds.labels(self.out_ring.name, "push").observe(
            self.out_ring.stats.last_claim_s
        )

    def release(self, job: Job) -> None:
        """The next stage has the task: report the handoff (the lease ends)."""
        self.control.call(
            Op.HANDOFF, task_id=job.task_id, attempt=job.attempt, stage=self.role.value
        )


class EncoderWorker(ProducerWorker):
    role = Role.ENCODER
    adapter = EncoderAdapter
    output_kind = Kind.PHASE1

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
            self.engine, self.pool, [desc], device="cpu", task_id=job.task_id, release=False
        )
        data: bytes = out[desc.name].numpy().tobytes()
        return data

    def compute(self, job: Job, inputs: bytes | None) -> dict[str, Any]:
        return self.stage.encode(_request(job), inputs)


class TransformerWorker(ProducerWorker):
    role = Role.TRANSFORMER
    adapter = TransformerAdapter
    output_kind = Kind.PHASE2

    def adapter_options(self) -> dict[str, Any]:
        return {"attention": self.cfg.attention_backend}

    def fetch_inputs(self, job: Job) -> dict[str, Any]:
        return self.pull(job)

    def compute(self, job: Job, inputs: dict[str, Any]) -> dict[str, Any]:
        def on_step(k: int, n: int) -> None:
            reply = self.control.call(
                Op.PROGRESS, task_id=job.task_id, attempt=job.attempt, step=k, steps=n
            )
            if reply.get("cancel"):
                job.cancel.set()

        return self.stage.denoise(
            _request(job), inputs, on_step=on_step, should_stop=job.cancel.is_set
        )


class DecoderWorker(StageWorker):
    role = Role.DECODER
    adapter = DecoderAdapter

    def fetch_inputs(self, job: Job) -> dict[str, Any]:
        return self.pull(job)

    def compute(self, job: Job, inputs: dict[str, Any]) -> Artifact:
        return self.stage.decode(_request(job), inputs)

    def publish(self, job: Job, outputs: Artifact) -> None:
        """Write the result file in this worker's output folder (atomically)."""
        out_dir = Path(self.cfg.output_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        local = out_dir / f"{job.task_id}.{outputs.extension}"
        tmp = local.with_name(local.name + ".part")
        tmp.write_bytes(outputs.data)
        tmp.replace(local)
        job.result = (outputs, local)

    def release(self, job: Job) -> None:
        """Send the result to the controller; completing the task ends the lease."""
        art, local = job.result
        reply = self.control.call(
            Op.COMPLETE,
            task_id=job.task_id,
            attempt=job.attempt,
            extension=art.extension,
            media_type=art.media_type,
            data=art.data,
            worker_path=str(local.resolve()),
        )
        if not reply.get("accepted"):
            log.info(
                "task %s: result of attempt %d not needed (already completed)",
                job.task_id,
                job.attempt,
            )


WORKERS: dict[Role, type[StageWorker]] = {
    cls.role: cls for cls in (EncoderWorker, TransformerWorker, DecoderWorker)
}
