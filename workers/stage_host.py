"""The model stage a worker runs (:class:`StageHost`, a base of
:class:`~workers.worker.StageWorker`): the role's stage adapter, constructed for the task and
loaded before the worker joins the rings, what requests may ask of it, and its memory report.

A role class (:mod:`workers.roles`) sets ``adapter`` and may add ``adapter_options``,
``offers`` and work after ``load_model`` (the encoder's prompt cache, the DiT's warm-up).
"""

from __future__ import annotations

from typing import Any, ClassVar

from contracts import faults
from contracts.config import ServiceConfig
from contracts.errors import ModelLoadError, StageError
from contracts.roles import Role
from workers.link import ControlLink
from workers.metrics import WorkerMetrics
from workers.models.base import StageAdapter
from workers.models.model_folder import ModelFolder
from workers.startup import StopSignal


class StageHost:
    """Loads and describes the role's model stage. The attributes below are the worker's
    (:class:`~workers.worker.StageWorker` sets them up)."""

    role: ClassVar[Role]
    adapter: ClassVar[type[StageAdapter]]
    """The stage adapter interface of this role; the task picks the family's class."""
    stage: Any
    cfg: ServiceConfig
    metrics: WorkerMetrics
    link: ControlLink
    model_folder: ModelFolder | None
    _stop: StopSignal

    def load_model(self) -> None:
        """Construct and load this role's model stage (before joining the rings); a stop
        asked for meanwhile ends the load after the component being loaded."""
        self.stage = self.adapter.for_task(
            self.model_path(),
            self.cfg.pipeline,
            self.cfg.device,
            self.cfg.dtype,
            **self.adapter_options(),
        )
        self.stage.on_component = lambda _name: self._stop.boundary("startup.component")
        self.stage.model_folder = self.model_folder  # checked at start: not again in load()
        if self.cfg.torch_threads is not None and self.stage.torch_model:
            # Only a torch model pays for importing torch here (a synthetic stage has none).
            import torch

            torch.set_num_threads(self.cfg.torch_threads)
        faults.hit("worker.load", ModelLoadError)
        self.stage.load()
        self.metrics.watch_memory(self.stage)
        if self.stage.torch_model:
            # The stage's GPU memory for the controller's status (zeros on a CPU).
            self.link.heartbeats.report = self.stage.memory.report

    def adapter_options(self) -> dict[str, Any]:
        """Role-specific settings of the stage adapter."""
        return {}

    def offers(self) -> dict[str, Any]:
        """What requests may ask of the loaded stage, reported at registration (the
        transformer role: its LoRA adapters and step-cache kinds)."""
        return {}

    def model_path(self) -> str:
        if not self.cfg.model_path:
            raise StageError(f"{self.role.value} worker needs model_path (config or --model_path)")
        return self.cfg.model_path

    def pool_device(self) -> str:
        return self.cfg.device
