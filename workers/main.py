"""Entry point of a worker process (``--service encoder|transformer|decoder``): one worker
(:mod:`workers.lifecycle`), or a transformer group when the DiT's layout spans devices
(:mod:`workers.group.supervisor`, whose rank 0 runs the same lifecycle)."""

from __future__ import annotations

from collections.abc import Mapping

from contracts.config import ServiceConfig
from contracts.roles import Role
from workers.lifecycle import run_stage_worker


def run_worker(role: Role, cfg: ServiceConfig, token: str, env: Mapping[str, str]) -> int:
    """Run the worker ``role`` until it is drained; the process's exit status."""
    if role is Role.TRANSFORMER and cfg.transformer.layout.size > 1:
        from workers.group.supervisor import run_group

        return run_group(cfg, token, env)
    return run_stage_worker(role, cfg, token, env)
