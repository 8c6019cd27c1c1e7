"""One rank of a CPU transformer group that runs a list of layouts
(tests/integration/test_group_layouts.py).

    python -m tests.support.group_layouts --rank R --world G --rendezvous DIR --models DIR --out DIR
        --cases CASE[;CASE...]      CASE = pipeline:layout, e.g. wan_t2v:cfg=2,ulysses=2
        [--timeout S] [--then-hang]

Every rank joins one gloo process group through the product's code
(:func:`workers.group.dist.init_group`: the same process group, mesh and timeout a
``--devices cpu,cpu`` group gets), then for each case loads the tiny model as that layout's
rank (:func:`workers.models.dit.parallel.attach_group`: diffusers' context parallelism over that
mesh) and denoises fixed synthetic inputs (the adapter's own ``warmup_inputs``, seed 7).
Each rank saves its latents as ``OUT/<i>-rank<R>.pt``; rank 0 also saves the single-process
output of the same inputs as ``OUT/<i>-ref.pt``. With ``--then-hang``, the last rank then
stops taking part (it sleeps past the timeout, heartbeat or not) while the others enter one
more collective, and each of those writes how long it waited and what it raised to
``OUT/hang-rank<R>.txt``: no rank waits in a collective for longer than ``--timeout``.

What stands in for what, because this machine has no GPU:

* gloo for NCCL: the same collectives (all-gather, all-to-all, broadcast), on host memory.
* ring attention needs an attention kernel that returns the log-sum-exp, which torch has on
  CPU only as ``_scaled_dot_product_flash_attention_for_cpu`` (the CPU twin of the CUDA
  flash kernel). Cases with ring > 1 run with ``attention_backend: sdpa_flash`` (diffusers'
  ``_native_flash``) with that op standing in for ``_native_flash``'s CUDA-only op, and with
  the CUDA / bf16 check of that backend lifted. Everything around the op (diffusers'
  ``TemplatedRingAttention``, the merge, the sharding) is diffusers' own.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

from contracts.parallel import ParallelLayout
from contracts.request import GenerationRequest

REQUESTS: dict[str, dict[str, Any]] = {
    # Wan: 2 x 2 x 3 = 12 video tokens (even over 2 and 4 ranks).
    "wan_t2v": {"height": 32, "width": 48, "num_frames": 5, "infer_steps": 3},
    "wan_i2v": {"height": 32, "width": 48, "num_frames": 5, "infer_steps": 2},
    # Qwen: 2 x 3 = 6 image tokens and prompts of 12 and 5 tokens (the warm-up inputs): the
    # negative prompt is uneven over 2 ranks, diffusers' "anything" split. (Uneven image
    # tokens need an uneven all-gather, which gloo lacks: refused on CPU.)
    "qwen_t2i": {"height": 32, "width": 48, "infer_steps": 3},
    "qwen_i2i": {"height": 32, "width": 32, "infer_steps": 2},
}


def stand_in_ring_kernel() -> None:
    import diffusers.models.attention_dispatch as dispatch

    import workers.models.dit.attention as attention

    def cpu_flash(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
                  scale: float | None = None, enable_gqa: bool = False,
                  return_lse: bool = False, _save_ctx: bool = True,
                  _parallel_config: Any = None) -> Any:
        q, k, v = (x.transpose(1, 2).contiguous() for x in (query, key, value))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
        out, lse = out.transpose(1, 2).contiguous(), lse.transpose(1, 2).contiguous()
        return (out, lse) if return_lse else out

    dispatch._native_flash_attention_forward_op = cpu_flash
    attention._require_cuda_half = lambda *args: None


def run_case(i: int, pipeline: str, layout: ParallelLayout, rank: int, models: Path,
             out: Path) -> None:
    from workers.models import TransformerAdapter
    from workers.models.dit.parallel import GroupMesh

    attention = "sdpa_flash" if layout.ring > 1 else "sdpa"
    group = GroupMesh.build(layout, "cpu")
    stage = TransformerAdapter.for_task(models / pipeline, pipeline, "cpu", "float32",
                                        attention=attention, group=group)
    stage.load()
    req = GenerationRequest(task=pipeline, prompt="group", seed=7, **REQUESTS[pipeline])
    inputs = stage.warmup_inputs(req, 0)
    latents = stage.denoise(req, inputs)["latents"]
    torch.save(latents, out / f"{i}-rank{rank}.pt")
    if rank == 0:
        single = TransformerAdapter.for_task(models / pipeline, pipeline, "cpu", "float32")
        single.load()
        torch.save(single.denoise(req, inputs)["latents"], out / f"{i}-ref.pt")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--rendezvous", type=Path, required=True)
    ap.add_argument("--models", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cases", required=True)
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--then-hang", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from workers.group.dist import init_group, serve_store

    world = ParallelLayout(ulysses=args.world)  # only the size matters for the world
    port_file = args.rendezvous / "port"
    store = None
    if args.rank == 0:
        store = serve_store(world, args.timeout)
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(str(store.port))
        tmp.replace(port_file)
        port = store.port
    else:
        while not port_file.exists():  # rank 0 writes it once its store listens
            time.sleep(0.05)
        port = int(port_file.read_text())
    init_group(args.rank, world, torch.device("cpu"), port, args.timeout, leader_store=store)
    stand_in_ring_kernel()
    for i, case in enumerate(args.cases.split(";")):
        pipeline, _, text = case.partition(":")
        run_case(i, pipeline, ParallelLayout.parse(text), args.rank, args.models, args.out)
    if args.then_hang:
        hang(args.rank, args.world, args.timeout, args.out)
    return 0


def hang(rank: int, world: int, timeout: float, out: Path) -> None:
    import torch.distributed as dist

    if rank == world - 1:
        time.sleep(timeout + 15)  # alive, but not in the collective
        return
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
        what = "completed"
    except Exception as exc:
        what = f"{type(exc).__name__}: {exc}"
    (out / f"hang-rank{rank}.txt").write_text(f"{time.monotonic() - t0:.1f}\n{what}")


if __name__ == "__main__":
    sys.exit(main())
