"""A denoising loop stopped at any step boundary and resumed from its checkpoint -- in a new
loop, from a state that went through the wire format -- gives the bytes of an uninterrupted
run: every pipeline, both schedulers (Wan: UniPC, Qwen-Image: FlowMatchEuler), the
synthetic stage too (tiny random-weight models, in this process)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

torch.set_num_threads(1)

from contracts.errors import CheckpointError, StageYielded  # noqa: E402
from contracts.pipelines import TASKS  # noqa: E402
from contracts.request import GenerationRequest  # noqa: E402
from workers.models import EncoderAdapter, TransformerAdapter  # noqa: E402
from workers.models.loop_state import (  # noqa: E402
    LoopState,
    capture_scheduler,
    from_wire,
    to_wire,
)

pytestmark = pytest.mark.integration  # builds and runs the tiny models

STEPS = 4
GEOMETRY: dict[str, dict[str, Any]] = {
    "wan_t2v": {"height": 32, "width": 32, "num_frames": 9, "fps": 8},
    "wan_i2v": {"height": 32, "width": 32, "num_frames": 9, "fps": 8},
    # A14B: the boundary inside the 4 steps (a resume on each side of it: test_wan22.py has
    # one after the switch); TI2V-5B: its VAE compresses 16 times.
    "wan22_a14b_t2v": {"height": 32, "width": 32, "num_frames": 9, "fps": 8},
    "wan22_a14b_i2v": {"height": 32, "width": 32, "num_frames": 9, "fps": 8},
    "wan22_5b_t2v": {"height": 64, "width": 64, "num_frames": 9, "fps": 8},
    "wan22_5b_i2v": {"height": 64, "width": 64, "num_frames": 9, "fps": 8},
    "qwen_t2i": {"height": 32, "width": 48},
    "qwen_i2i": {"height": 32, "width": 32},
    "qwen_i2i_plus": {"height": 32, "width": 32},
    "synthetic": {"height": 16, "width": 16},
}
_LOADED: dict[tuple[str, str], Any] = {}


def _stage(kind: str, models: Path, task: str) -> Any:
    if (kind, task) not in _LOADED:
        cls = EncoderAdapter if kind == "encoder" else TransformerAdapter
        obj = cls.for_task(models / task, task)
        obj.load()
        _LOADED[(kind, task)] = obj
    return _LOADED[(kind, task)]


class Hooks:
    """Loop hooks of a test: resume from ``resume``; at step ``stop_at`` take the state
    through the wire format and end the loop as a yield would."""

    def __init__(self, resume: LoopState | None = None, stop_at: int | None = None) -> None:
        self.resume = resume
        self.stop_at = stop_at
        self.taken: LoopState | None = None
        self.boundaries: list[int] = []

    def boundary(self, step: int, steps: int, snapshot: Callable[[], LoopState]) -> None:
        self.boundaries.append(step)
        if step == self.stop_at:
            state = snapshot()
            tensors, meta = to_wire(state)
            # The wire: raw bytes of each tensor into a new one (what the tensor plane does).
            copied = {k: _through_bytes(v) for k, v in tensors.items()}
            self.taken = from_wire(state.step, state.steps, copied, meta, "cpu")
            raise StageYielded("stopped", step, steps, "test")


def _through_bytes(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return np.frombuffer(value.tobytes(), dtype=value.dtype).reshape(value.shape).copy()
    raw = bytearray(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
                    .tobytes())
    return torch.frombuffer(raw, dtype=torch.uint8).view(value.dtype).reshape(value.shape)


def _bytes(tensors: dict[str, Any]) -> dict[str, bytes]:
    return {k: (v.tobytes() if isinstance(v, np.ndarray)
                else v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            for k, v in tensors.items()}


@pytest.mark.parametrize("task", TASKS)
def test_resumed_loop_is_byte_identical(tiny_models: Path, input_png: bytes, task: str) -> None:
    req = GenerationRequest(task=task, prompt="a fox in the snow", negative_prompt="blur",
                            seed=7, infer_steps=STEPS, **GEOMETRY[task])
    image = input_png if task.endswith(("i2v", "i2i", "i2i_plus")) else None
    inputs = _stage("encoder", tiny_models, task).encode(req, image)
    dit = _stage("transformer", tiny_models, task)
    plain = Hooks()
    want = _bytes(dit.denoise(req, inputs, loop=plain))
    assert plain.boundaries == list(range(1, STEPS + 1))
    for k in range(1, STEPS):  # stop after step k, resume from it in a new loop
        first = Hooks(stop_at=k)
        with pytest.raises(StageYielded):
            dit.denoise(req, inputs, loop=first)
        assert first.taken is not None and first.taken.step == k
        second = Hooks(resume=first.taken)
        got = _bytes(dit.denoise(req, inputs, loop=second))
        assert second.boundaries == list(range(k + 1, STEPS + 1))
        assert got == want, f"{task}: resumed after step {k} differs"


def test_scheduler_state_that_cannot_travel_is_refused() -> None:
    class Odd:
        def __init__(self) -> None:
            self._internal_dict = {"config": 1}
            self.generator = object()

    with pytest.raises(CheckpointError, match="generator"):
        capture_scheduler(Odd())


def test_bench_resume_runs_on_cpu(tmp_path: Path) -> None:
    """The real-size GPU check's own code path, at a toy size: it stops the loop, takes the
    state to host memory, resumes it and finds the bytes of the uninterrupted run."""
    from scripts.bench import bench_resume

    out = tmp_path / "out"
    assert bench_resume.main(["--arch", "wan-1.3b", "--device", "cpu", "--layers", "1",
                              "--shape", "16x16x5", "--steps", "3", "--stop-at", "1",
                              "--models", str(tmp_path / "models"), "--out", str(out)]) == 0
    row = json.loads((out / "bench_resume.json").read_text())
    assert row["exact"] and row["resumed_steps"] == 2 and row["checkpoint_mib"] > 0
    assert "| resumed latents equal to uninterrupted (bytes) | yes" in \
        (out / "bench_resume.md").read_text()
