"""Wan2.2-A14B's two experts in one DiT worker: which one runs a step, and where each is.

The checkpoint is two DiTs of one architecture: ``transformer`` (the high-noise expert) runs
every step whose timestep is at or above the boundary (``boundary_ratio`` of the folder's
model index times the scheduler's ``num_train_timesteps``), ``transformer_2`` (the
low-noise expert) the rest -- diffusers' rule, so the schedule decides, not a step count. A
request switches once, from high to low.

Where the experts are is the ``transformer.experts`` option (:data:`PLACEMENTS`):

* ``both``: both on the stage's device (each with the stage's weight options: FP8 storage,
  FP8 linear layers). Nothing moves; twice one expert's memory.
* ``swap``: one expert on the device, the other in host memory (pinned on CUDA). When the
  schedule reaches the other expert, the one on the device is parked in host memory and the
  other moved in, on a copy stream on CUDA (on the CPU a move is nothing: host memory is the
  device's). Where the device has room for both for a moment -- the free memory, within
  ``max_vram_gb``, holds the incoming expert and a step's working memory -- the move starts
  before the last high-noise step and overlaps it; else it runs at the boundary. After the
  loop the high-noise expert is moved back, so the next request starts on it: one switch and
  one return per request (:attr:`Experts.moves` counts them).

* ``high`` / ``low`` (the ``split`` placement): this worker loads and holds one expert; the
  other is another worker's. Its loop runs the steps of its expert only: a high-noise
  worker hands the request over at the boundary (the loop state, as a checkpoint carries
  it: :mod:`workers.checkpoints`), a low-noise worker resumes it there. :meth:`Experts.get`
  of the expert it does not hold is a bug, refused.

The host copies of both experts' weights are made at load (pinned on CUDA: host memory of
both experts, 57 GiB for A14B in bf16, 29 GiB in FP8 storage) and kept, since weights do not
change after load: parking an expert only drops its device copy, and the move in is one
copy from pinned memory. Tensors whose name says they are LoRA weights (``lora_``) are copied
out each time, because adapters are loaded and hot-swapped into them per request (an adapter
loaded into a parked expert lands in host memory and moves in with it). ``swap`` moves plain
tensors: FP8 linear layers (torchao tensor subclasses), offload hooks and compiled graphs
are not moved, so those options are refused with it (:func:`check_placement`); FP8 storage
(layerwise casting, plain float8 tensors) is what makes an expert fit a 24 GB card, and
moves like any weight.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from contracts.errors import CheckpointError, ModelLoadError
from contracts.stage_options import EXPERT_PLACEMENTS, SPLIT_EXPERTS, StageOptions

log = logging.getLogger("diffring.experts")

PLACEMENTS = EXPERT_PLACEMENTS
EXPERT_NAMES = ("high", "low")
"""The experts by index, as status and events name them."""
HIGH, LOW = 0, 1
_MARGIN = 1 << 30
"""Room kept beyond the incoming expert before an overlapped move starts (allocator
fragmentation, the step's own peaks)."""


def check_placement(options: StageOptions, experts: int, compiled: bool) -> None:
    """Refuse, at load, an ``experts`` placement this stage cannot run (named)."""
    if options.experts == "both":
        return
    if experts != 2:
        raise ModelLoadError(f"transformer.experts {options.experts!r} places the two experts "
                             "of a Wan2.2-A14B checkpoint; this model has one DiT")
    if options.experts in SPLIT_EXPERTS:  # one expert, placed like any one DiT
        return
    if options.linear == "fp8" or options.offload != "none" or compiled:
        raise ModelLoadError("transformer.experts 'swap' moves plain tensors: it cannot move "
                             "FP8 linear layers (linear 'fp8'), offloaded weights or a "
                             "compiled DiT's; use weight_storage 'fp8' with it, or experts "
                             "'both'")


def _tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, str, bool]]:
    """(qualified name, owner, attribute, is a parameter) of every parameter and buffer."""
    for prefix, owner in module.named_modules():
        for name, param in owner._parameters.items():
            if param is not None:
                yield f"{prefix}.{name}" if prefix else name, owner, name, True
        for name, buf in owner._buffers.items():
            if buf is not None:
                yield f"{prefix}.{name}" if prefix else name, owner, name, False


def _get(owner: torch.nn.Module, name: str, param: bool) -> torch.Tensor:
    table = owner._parameters if param else owner._buffers
    value = table[name]
    assert value is not None
    return value


def _set(owner: torch.nn.Module, name: str, param: bool, value: torch.Tensor) -> None:
    if param:
        # The Parameter object stays (hooks, PEFT and optimisers hold it); its data moves.
        _get(owner, name, True).data = value
    else:
        owner._buffers[name] = value


class Experts:
    """The DiTs of one checkpoint (one for every model but Wan2.2-A14B) and the rule that
    picks the one of a step."""

    def __init__(self, dits: Sequence[Any | None], boundary: float | None, placement: str,
                 device: torch.device, limit_bytes: int | None = None) -> None:
        if placement not in PLACEMENTS:
            raise ModelLoadError(f"transformer.experts must be one of {', '.join(PLACEMENTS)}, "
                                 f"got {placement!r}")
        self.dits: list[Any] = list(dits)  # None: an expert this worker does not hold
        self.boundary = boundary
        """The boundary timestep (None: one expert)."""
        self.placement = placement if len(self.dits) == 2 else "both"
        self.device = device
        self.limit_bytes = limit_bytes
        """The stage's memory budget (``max_vram_gb``), which an overlapped move respects."""
        self.resident = HIGH
        """The expert on the device (``swap``)."""
        self.moves = 0
        """Expert moves so far (``swap``): a switch at a boundary, or a return after it."""
        self._stand_in = False
        """A warm-up of a split worker: the held expert runs the other's steps too."""
        self._host: list[dict[str, torch.Tensor]] = [{} for _ in self.dits]
        self._stream: Any = None
        self._ready: Any = None
        self._incoming: int | None = None

    @property
    def two(self) -> bool:
        return len(self.dits) == 2

    @property
    def first(self) -> Any:
        """The high-noise expert (the one DiT of other models; with ``low``, the low-noise
        expert, the one held)."""
        return self.all()[0]

    def holds(self, index: int) -> bool:
        """This worker holds expert ``index`` (``high`` / ``low``: the one it was given)."""
        return self.dits[index] is not None or self._stand_in

    @contextlib.contextmanager
    def standing_in(self) -> Iterator[None]:
        """A split worker's warm-up (its outputs are thrown away): the expert it holds runs
        every step, the other's too (the same architecture, so the same kernels and compiled
        graphs), so the loop neither hands over nor refuses a step."""
        self._stand_in = True
        try:
            yield
        finally:
            self._stand_in = False

    def index_at(self, timestep: Any) -> int:
        """The expert of a step at ``timestep``: high at or above the boundary."""
        if self.boundary is None or float(timestep) >= self.boundary:
            return HIGH
        return LOW

    def name(self, index: int) -> str | None:
        """The expert's name in status and events (None: a one-DiT model)."""
        return EXPERT_NAMES[index] if self.two else None

    # -- placement -----------------------------------------------------------------------
    def placed(self) -> None:
        """``swap``, after load: keep a host copy of both experts' weights and move the
        low-noise expert out (it was built in host memory: the device never held both)."""
        if self.placement != "swap":
            return
        self._keep(HIGH)
        self._park(LOW)
        self.resident = HIGH

    def get(self, index: int) -> Any:
        """The DiT of expert ``index``, on the device (``swap``: moved in now unless it is
        there or on its way; the compute stream then waits for its copy)."""
        if self.dits[index] is None and self._stand_in:
            return self.first
        if self.dits[index] is None:
            raise CheckpointError(f"this worker holds the {EXPERT_NAMES[1 - index]}-noise expert "
                                  f"only (experts {self.placement!r}); the step needs the "
                                  f"{EXPERT_NAMES[index]}-noise one")
        if self.placement == "swap":
            if self.resident != index:
                self._bring(index)
            if self._ready is not None:  # queued: the copy lands before the step reads it
                torch.cuda.current_stream(self.device).wait_event(self._ready)
                self._ready = None
        return self.dits[index]

    def upcoming(self, index: int) -> None:
        """The step after the next runs expert ``index``: with ``swap``, start moving it in
        now, overlapped with the next step, if the device has room for both."""
        if (self.placement != "swap" or index == self.resident or self._incoming == index
                or self.device.type != "cuda" or not self._room_for(index)):
            return
        self._copy_in(index)
        self._incoming = index
        self.moves += 1

    def finished(self) -> None:
        """After a loop (and after its device work): bring the high-noise expert back, so
        the next request starts on it. On CUDA the copy runs on the side stream while the
        worker hands the result on; nothing waits for it before the next :meth:`get`."""
        if self.placement == "swap" and self.resident != HIGH:
            self._bring(HIGH)

    def _bring(self, index: int) -> None:
        if self._incoming != index:  # make room first, then move it in
            self._park(self.resident)
            self._copy_in(index)
            self.moves += 1
        else:  # moved in beside the other one (upcoming): that one leaves now
            self._park(self.resident)
        self._incoming = None
        self.resident = index

    def _room_for(self, index: int) -> bool:
        need = sum(t.numel() * t.element_size() for t in self._host[index].values()) + _MARGIN
        free, _total = torch.cuda.mem_get_info(self.device)
        allocated = torch.cuda.memory_allocated(self.device)
        room = free + torch.cuda.memory_reserved(self.device) - allocated
        if self.limit_bytes is not None:
            room = min(room, self.limit_bytes - allocated)
        return room >= need

    def _keep(self, index: int, park: bool = False) -> None:
        """Host copies of expert ``index``'s tensors (pinned on CUDA), made once; ``park``:
        each tensor becomes its host copy at once, so that an expert built in host memory
        is never there twice (14B: 28.6 GiB in bf16)."""
        cuda = self.device.type == "cuda"
        host = self._host[index]
        for qualified, owner, name, param in _tensors(self.dits[index]):
            tensor = _get(owner, name, param)
            kept = host.get(qualified)
            if kept is None or "lora_" in qualified or kept.shape != tensor.shape or \
                    kept.dtype != tensor.dtype:
                kept = tensor.detach()
                if cuda and not (kept.device.type == "cpu" and kept.is_pinned()):
                    # One copy, straight into pinned memory.
                    kept = torch.empty_like(kept, device="cpu", pin_memory=True).copy_(kept)
                # On the CPU the host copy is the tensor itself: a move there is nothing.
                host[qualified] = kept
            if park:
                _set(owner, name, param, kept)

    def _park(self, index: int) -> None:
        """Expert ``index`` to host memory: its tensors become their host copies (kept
        copies of the weights; LoRA weights copied now), the device copies are freed."""
        if self.device.type == "cuda":  # the last step that read them ran before this
            torch.cuda.current_stream(self.device).synchronize()
        self._keep(index, park=True)

    def _copy_in(self, index: int) -> None:
        """Expert ``index``'s host copies to the device. On CUDA the memory is taken on the
        compute stream (its pool holds what the parked expert freed) and filled on a copy
        stream; :meth:`get` makes the compute stream wait for the copy."""
        self._keep(index)  # adapters loaded while it was parked are new tensors
        host = self._host[index]
        if self.device.type != "cuda":
            for qualified, owner, name, param in _tensors(self.dits[index]):
                _set(owner, name, param, host[qualified])
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        moved = []
        for qualified, owner, name, param in _tensors(self.dits[index]):
            dev = torch.empty_like(host[qualified], device=self.device)
            moved.append((dev, host[qualified]))
            _set(owner, name, param, dev)
        with torch.cuda.stream(self._stream):
            for dev, src in moved:
                dev.copy_(src, non_blocking=True)
                dev.record_stream(self._stream)  # not reused before the copy is done
            self._ready = torch.cuda.Event()
            self._ready.record(self._stream)

    def all(self) -> list[Any]:
        """The DiTs this worker holds (high-noise first)."""
        return [d for d in self.dits if d is not None]
