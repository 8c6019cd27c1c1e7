"""A denoising loop's state at a step boundary, and how a loop hands it out and takes it back.

A loop's state after ``step`` of ``steps`` is what the next step reads: the tensors it
carries (the latents; the synthetic stage's outputs) and the scheduler's whole state. The
scheduler is a diffusers ``SchedulerMixin`` whose state lives in its instance attributes
(UniPC: ``model_outputs``, ``timestep_list``, ``lower_order_nums``, ``last_sample``,
``this_order``, ``_step_index``, the schedule tensors; FlowMatchEuler: ``_step_index``,
``sigmas``, ``timesteps``, ...) and whose configuration is ``config``. diffusers offers no
state-dict for schedulers, so :func:`capture_scheduler` takes every attribute but the
configuration (copied: tensors cloned, lists rebuilt), and :func:`restore_scheduler` sets
them on a scheduler made from the same configuration. Taking all of them, not a list per
class, is what keeps a resumed loop bit-identical for any scheduler class, including ones
added later; an attribute of a type that cannot travel (a generator, a module) refuses the
checkpoint with a :class:`~contracts.errors.CheckpointError` naming it.

The loops use no random numbers after the initial noise (UniPC and FlowMatchEuler's
deterministic sampling), so no generator state is part of it; the initial noise is drawn
from the seed only when the loop does not resume.

On the wire (:func:`to_wire` / :func:`from_wire`) a state is a flat ``{name: tensor}`` map
for the tensor plane plus a msgpack-able ``meta`` tree that says where each tensor goes back
and holds the plain values (ints, floats -- numpy scalars keep their type --, None, ...).

Torch is imported only for torch tensors: the synthetic stage's state is numpy arrays.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from contracts.errors import CheckpointError

_CONFIG_ATTR = "_internal_dict"
"""Where ``ConfigMixin`` keeps a scheduler's configuration (rebuilt by ``from_config``)."""


@dataclass
class LoopState:
    """A loop after ``step`` of ``steps`` steps: what the next step needs."""

    step: int
    steps: int
    tensors: dict[str, Any]
    """The tensors the loop carries (``latents``), on the stage's device."""
    scheduler: dict[str, Any] = field(default_factory=dict)
    """The scheduler's attributes (:func:`capture_scheduler`); empty for a stage without
    one (synthetic)."""
    expert: str | None = None
    """Wan2.2-A14B: the expert the next step runs (``high`` / ``low``; None: a one-DiT
    model, or the end). A resumed loop continues with it and refuses a schedule that would
    put the step on the other one."""


class LoopHooks(Protocol):
    """What a worker gives a denoising loop: where it starts, and a call at every step
    boundary (which may take a checkpoint, or end the loop with StageYielded)."""

    resume: LoopState | None

    def boundary(self, step: int, steps: int, snapshot: Callable[[], LoopState]) -> None:
        """Called after step ``step`` of ``steps``; ``snapshot()`` copies the state."""

    # Optional (the worker's hooks have it; a loop of one process needs none):
    # ``hand_over(step, steps, snapshot)``: the next step runs an expert this worker does
    # not hold (``split``): hand the state over and end the loop (StageYielded).


# -- the scheduler ---------------------------------------------------------------------------
def capture_scheduler(scheduler: Any) -> dict[str, Any]:
    """A copy of every state attribute of ``scheduler`` (not its configuration)."""
    return {name: _copy(value, name) for name, value in vars(scheduler).items()
            if name != _CONFIG_ATTR}


def restore_scheduler(scheduler: Any, state: Mapping[str, Any]) -> None:
    """Set the captured attributes on ``scheduler`` (made from the same configuration and
    through the same ``set_timesteps`` as the one captured)."""
    for name, value in state.items():
        setattr(scheduler, name, value)


def _copy(value: Any, where: str) -> Any:
    if _is_torch(value):
        return value.detach().clone()
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, list | tuple):
        items = [_copy(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if value is None or isinstance(value, bool | int | float | str | np.generic):
        return value
    raise CheckpointError(f"scheduler attribute {where} holds a {type(value).__name__}, "
                          "which a checkpoint cannot carry")


def _is_torch(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "detach")


# -- the wire --------------------------------------------------------------------------------
def to_wire(state: LoopState) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors, meta) of ``state``: every tensor under its own name, the rest in ``meta``."""
    tensors: dict[str, Any] = {}
    meta: dict[str, Any] = {
        "tensors": {name: _flatten(value, name, tensors) for name, value in state.tensors.items()},
        "scheduler": {name: _flatten(value, f"sched.{name}", tensors)
                      for name, value in state.scheduler.items()},
    }
    if state.expert is not None:  # one-DiT states travel as before
        meta["expert"] = state.expert
    return tensors, meta


def from_wire(step: int, steps: int, tensors: Mapping[str, Any], meta: Mapping[str, Any],
              device: Any) -> LoopState:
    """The state :func:`to_wire` described, its tensors (pulled onto ``device``) put back
    where they were: on the CPU when they were there (UniPC keeps its sigmas on the CPU on
    purpose), numpy arrays as numpy arrays."""
    try:
        return LoopState(
            step, steps,
            {name: _unflatten(m, tensors, device) for name, m in meta["tensors"].items()},
            {name: _unflatten(m, tensors, device) for name, m in meta["scheduler"].items()},
            meta.get("expert"),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint does not describe a loop state: {exc!r}") from None


def _flatten(value: Any, name: str, out: dict[str, Any]) -> dict[str, Any]:
    if _is_torch(value):
        out[name] = value
        return {"t": "tensor", "k": name, "cpu": value.device.type == "cpu"}
    if isinstance(value, np.ndarray):
        out[name] = value
        return {"t": "ndarray", "k": name}
    if isinstance(value, list | tuple):
        return {"t": "list" if isinstance(value, list) else "tuple",
                "v": [_flatten(v, f"{name}.{i}", out) for i, v in enumerate(value)]}
    if isinstance(value, np.generic):
        return {"t": "np", "dtype": value.dtype.name, "v": value.item()}
    return {"t": "v", "v": value}


def _unflatten(m: Mapping[str, Any], tensors: Mapping[str, Any], device: Any) -> Any:
    kind = m["t"]
    if kind == "tensor":
        value = tensors[m["k"]]
        if not _is_torch(value):  # pulled as a numpy array: a torch-free worker
            import torch

            value = torch.from_numpy(value)
        return value.to("cpu" if m["cpu"] else device)
    if kind == "ndarray":
        value = tensors[m["k"]]
        return value.cpu().numpy() if _is_torch(value) else value
    if kind in ("list", "tuple"):
        items = [_unflatten(v, tensors, device) for v in m["v"]]
        return items if kind == "list" else tuple(items)
    if kind == "np":
        return np.dtype(m["dtype"]).type(m["v"])
    if kind == "v":
        return m["v"]
    raise ValueError(f"unknown kind {kind!r}")


def start(hooks: LoopHooks | None, scheduler: Any, fresh: Callable[[], Any], device: Any,
          name: str = "latents") -> tuple[Any, int]:
    """Where a loop starts: ``(fresh(), 0)`` (the initial noise), or the resumed state's
    ``name`` tensor and step, with the scheduler's state restored."""
    if hooks is None or hooks.resume is None:
        return fresh(), 0
    state = hooks.resume
    if scheduler is not None:
        restore_scheduler(scheduler, state.scheduler)
    latents = state.tensors[name]
    return (latents.to(device) if _is_torch(latents) else latents), state.step


def boundary(hooks: LoopHooks | None, step: int, steps: int, scheduler: Any,
             tensors: Callable[[], dict[str, Any]], expert: str | None = None) -> None:
    """A loop's step boundary: hand ``hooks`` a way to copy the state now (not a copy:
    most boundaries take none). ``expert``: the one the next step runs (two-expert DiTs)."""
    if hooks is None:
        return

    def snapshot() -> LoopState:
        carried = {k: _copy(v, k) for k, v in tensors().items()}
        return LoopState(step, steps, carried,
                         capture_scheduler(scheduler) if scheduler is not None else {},
                         expert)

    hooks.boundary(step, steps, snapshot)


def hand_over(hooks: LoopHooks | None, step: int, steps: int, scheduler: Any,
              tensors: Callable[[], dict[str, Any]], expert: str) -> None:
    """Wan2.2-A14B's boundary on a worker holding one expert (``split``): the state goes to
    the worker holding ``expert`` (through the controller, as a checkpoint goes), and the
    loop ends here (the hooks raise StageYielded)."""
    handed = getattr(hooks, "hand_over", None)
    if handed is None:
        raise CheckpointError(f"the next step (after {step} of {steps}) runs the {expert}-noise "
                              "expert, which this stage does not hold: the split placement "
                              "(experts 'high' / 'low') runs in a DiT worker, whose loop hands "
                              "the request over; use experts 'both' or 'swap' in one process")

    def snapshot() -> LoopState:
        carried = {k: _copy(v, k) for k, v in tensors().items()}
        return LoopState(step, steps, carried, capture_scheduler(scheduler), expert)

    handed(step, steps, snapshot)
    raise CheckpointError(f"the loop state after step {step} was not handed over")
