#!/usr/bin/env python3
"""A denoising checkpoint at real size: what it costs and whether a resume is exact, on the
device the DiT runs on.

    python -m scripts.bench.bench_resume --arch wan-1.3b --device cuda:0 --steps 8 \\
        --stop-at 3 --out out/resume [--models /dev/shm/diffring-models]

Builds (or reuses) a DiT-stage folder of the published architecture with random bf16
weights (:func:`scripts.bench.bench_dit.build_folder`), loads it through the DiT stage's
adapter (``TransformerAdapter``, what a worker runs), then

1. runs ``--steps`` steps uninterrupted, timing every step boundary;
2. runs again and stops after step ``--stop-at`` the way a checkpointing worker does: the
   loop's state (:mod:`workers.models.loop_state`: latents and the scheduler's whole state)
   is taken at the boundary, put in wire form, and copied to host memory byte for byte (the
   tensor plane's job between the DiT and the controller); the loop ends there;
3. restores that state in a new loop on the device and runs the remaining steps.

It prints (and writes as JSON / markdown into ``--out``) the step time, the checkpoint's
size, the seconds of taking it (snapshot + wire form + device-to-host copy) and of restoring
it, and whether the resumed latents equal the uninterrupted ones byte for byte. The lost-work
rows are arithmetic on the measured step: a DiT lost at a uniformly random step loses on
average half a request's steps without checkpoints, and half the interval with them.

The controller side of a checkpoint (its pool, its files, the retry on another worker) is
measured on the CPU machine by :mod:`scripts.bench.bench_checkpoints`; this script is the
part only the real model on its device can answer. On a CPU at a toy size (``--layers 1
--shape 16x16x5 --device cpu``) it runs in the test-suite; its figures mean nothing there.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scripts.bench.bench_dit import SHAPES, TASKS, _request, build_folder

T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[resume {time.monotonic() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def _host_bytes(value: Any) -> Any:
    """``value`` copied to host memory through its raw bytes, as the tensor plane moves it."""
    import numpy as np
    import torch

    if isinstance(value, np.ndarray):
        return value.copy()
    raw = bytearray(value.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
                    .tobytes())
    return torch.frombuffer(raw, dtype=torch.uint8).view(value.dtype).reshape(value.shape)


def _nbytes(value: Any) -> int:
    return int(value.nbytes) if hasattr(value, "nbytes") else \
        int(value.numel() * value.element_size())


class Probe:
    """Loop hooks (:class:`workers.models.loop_state.LoopHooks`): start from ``resume``,
    time every boundary, and after ``stop_at`` take the state to host memory and end the
    loop as a worker's yield does."""

    def __init__(self, device: str, resume: Any = None, stop_at: int | None = None) -> None:
        self.device = device
        self.resume = resume
        self.stop_at = stop_at
        self.times: list[float] = []
        self.taken: tuple[int, int, dict[str, Any], dict[str, Any]] | None = None
        self.take_s = 0.0
        self.bytes = 0

    def boundary(self, step: int, steps: int, snapshot: Callable[[], Any]) -> None:
        from contracts.errors import StageYielded
        from workers.models.loop_state import to_wire

        _sync(self.device)
        self.times.append(time.perf_counter())
        if step != self.stop_at:
            return
        t0 = time.perf_counter()
        state = snapshot()
        tensors, meta = to_wire(state)
        host = {k: _host_bytes(v) for k, v in tensors.items()}
        self.take_s = time.perf_counter() - t0
        self.bytes = sum(_nbytes(v) for v in host.values())
        self.taken = (state.step, state.steps, host, meta)
        raise StageYielded("benchmark checkpoint", step, steps, "bench_resume")


def _raw(latents: Any) -> bytes:
    import torch

    return bytes(latents.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
                 .tobytes())


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from contracts.errors import StageYielded
    from workers.models import TransformerAdapter
    from workers.models.loop_state import from_wire

    shape = args.shape or SHAPES[args.arch]
    folder = args.models / f"{args.arch}-dit{f'-l{args.layers}' if args.layers else ''}"
    log(f"folder {folder}: {build_folder(args.arch, folder, args.device, args.layers)}")
    adapter = TransformerAdapter.for_task(folder, TASKS[args.arch], args.device, "bfloat16")
    adapter.load()
    req = _request(args.arch, args.steps, args.shape)
    inputs = adapter.warmup_inputs(req, 0)
    adapter.denoise(_request(args.arch, 1, args.shape), inputs)  # warm the kernels

    plain = Probe(args.device)
    _sync(args.device)
    start = time.perf_counter()
    want = adapter.denoise(req, inputs, loop=plain)["latents"]
    steps_s = [b - a for a, b in zip([start, *plain.times], plain.times, strict=False)]
    step_s = sorted(steps_s)[len(steps_s) // 2]
    log(f"uninterrupted: {args.steps} steps, median step {step_s:.3f} s")

    first = Probe(args.device, stop_at=args.stop_at)
    try:
        adapter.denoise(req, inputs, loop=first)
        raise SystemExit(f"the loop did not stop after step {args.stop_at}")
    except StageYielded:
        pass
    assert first.taken is not None
    step, steps, host, meta = first.taken
    t0 = time.perf_counter()
    state = from_wire(step, steps, {k: v for k, v in host.items()}, meta, args.device)
    _sync(args.device)
    restore_s = time.perf_counter() - t0
    second = Probe(args.device, resume=state)
    got = adapter.denoise(req, inputs, loop=second)["latents"]
    exact = _raw(got) == _raw(want)
    diff = float((got.float() - want.float()).abs().max())
    row = {
        "arch": args.arch, "shape": shape, "device": args.device,
        "device_name": torch.cuda.get_device_name(args.device)
        if args.device.startswith("cuda") else "cpu",
        "layers": args.layers, "steps": args.steps, "stop_at": args.stop_at,
        "step_s": round(step_s, 4), "checkpoint_mib": round(first.bytes / 2**20, 2),
        "take_s": round(first.take_s, 4), "restore_s": round(restore_s, 4),
        "resumed_steps": len(second.times), "exact": exact, "max_abs_diff": diff,
        "every": args.every,
        "lost_without_s": round(args.steps / 2 * step_s, 2),
        "lost_with_s": round(args.every / 2 * step_s + restore_s, 2),
    }
    log(f"resumed after step {step}: exact={exact} (max abs diff {diff})")
    return row


def table(row: dict[str, Any]) -> str:
    n, e = row["steps"], row["every"]
    return "\n".join([
        f"Denoising checkpoint at real size: {row['arch']} ({row['layers'] or 'all'} layers), "
        f"{row['shape']}, {row['device_name']}, random bf16, {n} steps, stopped after step "
        f"{row['stop_at']}",
        "",
        "| what | value |",
        "| --- | --- |",
        f"| step (CFG, median) | {row['step_s']:.3f} s |",
        f"| checkpoint size (latents + scheduler state) | {row['checkpoint_mib']} MiB |",
        f"| take it: snapshot, wire form, copy to host | {row['take_s'] * 1000:.1f} ms |",
        f"| restore it on the device | {row['restore_s'] * 1000:.1f} ms |",
        f"| resumed latents equal to uninterrupted (bytes) | {'yes' if row['exact'] else 'NO'} "
        f"(max abs diff {row['max_abs_diff']:g}) |",
        f"| DiT time lost per death at a random step, no checkpoints ({n} steps) | "
        f"{row['lost_without_s']} s |",
        f"| the same, a checkpoint every {e} steps (+ the restore) | {row['lost_with_s']} s |",
    ])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", choices=sorted(TASKS), default="wan-1.3b")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--stop-at", type=int, default=3)
    ap.add_argument("--every", type=int, default=5,
                    help="checkpoint interval (steps) for the lost-work arithmetic")
    ap.add_argument("--shape", help="geometry instead of the published default (quick checks)")
    ap.add_argument("--layers", type=int, help="DiT depth (quick checks)")
    ap.add_argument("--models", type=Path, default=Path("/dev/shm/diffring-models"))
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if not 0 < args.stop_at < args.steps:
        ap.error("--stop-at must lie between 0 and --steps")
    row = measure(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_resume.json").write_text(json.dumps(row, indent=1))
    text = table(row)
    (args.out / "bench_resume.md").write_text(text + "\n")
    print(text)
    return 0 if row["exact"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
