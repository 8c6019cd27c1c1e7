"""The coordinator's own configuration, taken from a service's file once, at assembly.

Each component gets its sub-config, not the whole :class:`~contracts.config.ServiceConfig`;
defaults are the file's defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from contracts.config import ServiceConfig
from contracts.errors import ConfigError


@dataclass(frozen=True)
class CoordinatorConfig:
    """What :class:`controller.ownership.coordinator.Coordinator` needs to know."""

    pipeline: str
    """The one pipeline this controller serves; workers of another are refused."""
    output_dir: Path
    """Where result files are written (an absolute folder)."""
    lease_timeout_s: float = ServiceConfig.lease_timeout_s
    """A claimed task whose worker is silent this long goes back in play; also the grace of
    a ring item taken and never claimed (window 2 of the ownership argument)."""
    heartbeat_interval_s: float = ServiceConfig.heartbeat_interval_s
    """How often workers heartbeat; a producer unheard for three intervals counts as gone."""
    max_pending: int = ServiceConfig.max_pending_tasks
    """Tasks accepted and not finished before new ones are refused (429)."""
    max_task_failures: int = ServiceConfig.max_task_failures
    """Failures a task itself causes before it is failed."""
    poison_worker_deaths: int = ServiceConfig.poison_worker_deaths
    """Attempts in a row that lose their worker before the task is quarantined as poison."""
    release_ahead: int | None = None
    """Tasks released ahead of the DiT workers beyond the registered encoders and
    transformers, per priority class and up (None: all at once; the service default is 2)."""
    preempt_after_s: float | None = None
    """A waiting task preempts a lower-priority one after this long (None: never)."""
    max_preemptions: int = ServiceConfig.max_preemptions
    """Times one task can be preempted."""

    def __post_init__(self) -> None:
        if not (self.lease_timeout_s > 0 and self.heartbeat_interval_s > 0):
            raise ConfigError("lease_timeout_s and heartbeat_interval_s must be positive")
        if self.max_pending < 1 or self.max_task_failures < 1 or self.poison_worker_deaths < 1:
            raise ConfigError(
                "max_pending_tasks, max_task_failures and poison_worker_deaths must be at least 1"
            )

    @classmethod
    def from_service(cls, cfg: ServiceConfig, output_dir: Path | None = None
                     ) -> CoordinatorConfig:
        """The coordinator's part of ``cfg``; ``output_dir`` defaults to the file's, resolved."""
        return cls(
            pipeline=cfg.pipeline,
            output_dir=output_dir or Path(cfg.output_dir).resolve(),
            lease_timeout_s=cfg.lease_timeout_s,
            heartbeat_interval_s=cfg.heartbeat_interval_s,
            max_pending=cfg.max_pending_tasks,
            max_task_failures=cfg.max_task_failures,
            poison_worker_deaths=cfg.poison_worker_deaths,
            release_ahead=cfg.release_ahead,
            preempt_after_s=cfg.preempt_after_s,
            max_preemptions=cfg.max_preemptions,
        )
