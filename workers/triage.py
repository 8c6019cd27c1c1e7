"""What a worker makes of an item it cannot run and of a failed attempt.

:func:`check_item` says why a ring item is not this worker's to run (the worker then reports
it to the controller as ``dropped``); :func:`describe_failure` says whose fault a failed
attempt was (:class:`~contracts.messages.Fault`), from which the controller decides whether
the attempt counts against the task (:mod:`controller.ownership.budget` on the other side of
the wire).
"""

from __future__ import annotations

import logging
from typing import Any

from contracts.errors import (
    DiffringError,
    InvalidRequestError,
    PayloadTooLarge,
    StageCancelled,
    StageError,
    StageInputError,
)
from contracts.messages import ROLE_INPUT_KIND, Fault
from contracts.roles import Role
from tensorplane.descriptor import TensorDescriptor
from tensorplane.errors import ChecksumMismatch, DescriptorError, RequestTooLarge, TransferFailed

log = logging.getLogger("diffring.worker")


def check_item(item: dict[str, Any], role: Role, pipeline: str) -> str | None:
    """Why a worker of ``role`` serving ``pipeline`` cannot run ``item`` (None: it can)."""
    kind = ROLE_INPUT_KIND[role]
    if item.get("kind") != kind:
        return f"unexpected {item.get('kind')!r} item (a {role.value} takes {kind!r})"
    tid, attempt = item.get("task_id"), item.get("attempt")
    if not isinstance(tid, str) or not tid:
        return f"task_id {tid!r} is not a task id"
    if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 1:
        return f"attempt {attempt!r} is not an attempt number"
    if item.get("pipeline") != pipeline:
        return f"pipeline {item.get('pipeline')!r}, this worker serves {pipeline}"
    if not isinstance(item.get("request"), dict):
        return "no request map"
    try:
        for d in item.get("tensors") or []:
            TensorDescriptor.from_dict(d)
        if item.get("image"):
            TensorDescriptor.from_dict(item["image"])
    except (DescriptorError, TypeError, ValueError, KeyError) as exc:
        return f"malformed tensor descriptor: {exc}"
    return None


def describe_failure(exc: Exception) -> tuple[str, str, Fault]:
    """(message, error_type, whose fault) of a failed attempt."""
    name = type(exc).__name__
    if isinstance(exc, StageCancelled):
        return str(exc), "cancelled", Fault.CANCELLED
    if isinstance(exc, InvalidRequestError | StageInputError | RequestTooLarge | PayloadTooLarge):
        return str(exc), name, Fault.INPUT  # the same request fails the same way again
    if isinstance(exc, TransferFailed):
        return str(exc), name, Fault.TRANSFER  # the controller knows if the producer lives
    if isinstance(exc, ChecksumMismatch | DescriptorError | StageError):
        return str(exc), name, Fault.TASK
    if isinstance(exc, DiffringError):  # tensor plane, rings, control, injected faults
        return str(exc), name, Fault.SYSTEM
    log.exception("task failed with an unexpected error")
    return f"{name}: {exc}", name, Fault.TASK
