#!/usr/bin/env python3
"""GPU micro-benchmarks: MP4 writing, the decoder's critical path, DiT step variants.

    python -m scripts.bench.bench_gpu --out DIR [--sections env,mp4,wan,qwen] [--budget-s 480]

Sections (each writes its part of ``DIR/bench_gpu.json`` as soon as it is done, so a run
cut short keeps what it measured; a section that would start past ``--budget-s`` is
skipped and says so):

* ``env``:  versions, GPU, whether ``h264_nvenc`` opens.
* ``mp4``:  ``encode_mp4`` of 81 x 480 x 832 frames (random, and smooth), libx264 veryfast
            CRF 18 with all cores (the default) and with one thread, and preset medium.
* ``wan``:  Wan2.1-T2V-1.3B architecture (random bf16, ``modelkit.real``),
            480x832x81: one CFG step (two DiT forwards, or one batch-2 forward) timed
            through ``TransformerAdapter.denoise`` for each of ``--wan-variants`` (eager
            SDPA, ``cfg_batch``, ``sage_attn``, ``sdpa_cudnn``, ``compile``, ...), the
            warm-up (compile) time, and each variant's latents against the first variant
            on the same inputs.
* ``decoder``: the Wan VAE decode alone against ``decode_pixels`` (VAE + uint8 + copy to
            the host: the decoder's critical path with the background encoder) and the
            MP4 of those frames.
* ``decoder_stream``: issue 33, decode + MP4 serial against streamed (the MP4 written while
            the VAE decodes, ``DecoderAdapter.decode_media``) in the same run; prints the
            ratio streamed / serial and checks that pixels and MP4 bytes are equal. Not in
            the default ``--sections``: ``--sections env,decoder_stream``.
* ``qwen``: Qwen-Image architecture (20B DiT, random bf16), 1024x1024: one step without CFG
            (one forward) eager and compiled, and the compiled latents against eager.

Timing: each stage call synchronises the device before it returns; a step time is the
denoise time over its steps, after the warm-up; the median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS: dict[str, Any] = {}
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[gpu {time.monotonic() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def save(out: Path) -> None:
    (out / "bench_gpu.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def peak_gib() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return round(torch.cuda.max_memory_allocated() / 2**30, 1)


def model_dir(args: argparse.Namespace, arch: str) -> Path:
    return args.models / (arch + (f"-l{args.layers}" if args.layers else ""))


# ------------------------------------------------------------------------------ sections
def section_env(args: argparse.Namespace) -> dict[str, Any]:
    import av
    import diffusers
    import torch
    import transformers

    from workers.models.media import nvenc_available

    return {"torch": torch.__version__, "cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "diffusers": diffusers.__version__,
            "transformers": transformers.__version__, "av": av.__version__,
            "ffmpeg": {k: ".".join(map(str, v)) for k, v in av.library_versions.items()},
            "h264_nvenc_opens": nvenc_available(),
            "cpus": __import__("os").cpu_count()}


def section_mp4(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    from workers.models.media import VideoSettings, encode_mp4

    rng = np.random.default_rng(0)
    random = rng.integers(0, 256, (81, 480, 832, 3), dtype=np.uint8)
    yy, xx = np.mgrid[0:480, 0:832]
    smooth = np.stack([np.stack([(xx + 3 * t) % 256, (yy + 2 * t) % 256,
                                 (xx + yy + t) % 256], -1) for t in range(81)]).astype(np.uint8)
    out: dict[str, Any] = {}
    cases = [("random veryfast crf18 all cores", random, VideoSettings(codec="libx264"), 3),
             ("random veryfast crf18 1 thread", random,
              VideoSettings(codec="libx264", threads=1), 1),
             ("random medium crf18 all cores", random,
              VideoSettings(codec="libx264", preset="medium"), 1),
             ("smooth veryfast crf18 all cores", smooth, VideoSettings(codec="libx264"), 3),
             ("random auto (nvenc if it opens)", random, VideoSettings(codec="auto"), 1)]
    for name, frames, settings, reps in cases:
        def run(f: Any = frames, s: Any = settings) -> bytes:
            return encode_mp4(f, 16, s)

        seconds, data = timed(run, reps)
        out[name] = {"seconds": round(seconds, 3), "bytes": len(data)}
        log(f"mp4 {name}: {seconds:.3f} s, {len(data)} B")
    return out


def dit_variants(args: argparse.Namespace, task: str, folder: Path, shape: str, steps: int,
                 variants: list[dict[str, Any]], cfg: bool, budget: float) -> dict[str, Any]:
    """Time ``denoise`` per step for each adapter variant on the same synthetic inputs."""
    import torch
    import torch._dynamo

    from contracts.pipelines import parse_shape
    from contracts.request import GenerationRequest
    from workers.models import TransformerAdapter

    dims = parse_shape(shape)
    geometry: dict[str, Any] = {"height": dims[0], "width": dims[1]}
    if len(dims) == 3:
        geometry["num_frames"] = dims[2]
    guidance: dict[str, Any] = {"guidance_scale": 5.0} if task.startswith("wan") else {
        "true_cfg_scale": 4.0 if cfg else 1.0}
    req = GenerationRequest(task=task, prompt="bench", infer_steps=steps, seed=3, **geometry,
                            **guidance)
    out: dict[str, Any] = {"shape": shape, "steps": steps, "cfg": cfg, "variants": {}}
    reference = None
    for variant in variants:
        name = variant["name"]
        if time.monotonic() - T0 > budget:
            out["variants"][name] = {"skipped": "time budget"}
            log(f"{task} {name}: skipped (budget)")
            continue
        opts = {k: v for k, v in variant.items() if k != "name"}
        torch._dynamo.reset()
        try:
            t0 = time.perf_counter()
            adapter = TransformerAdapter.for_task(folder, task, args.device, args.dtype, **opts)
            adapter.load()
            load_s = time.perf_counter() - t0
            inputs = adapter.warmup_inputs(req, 0)
            if not cfg and task.startswith("qwen"):
                inputs = {k: v for k, v in inputs.items() if not k.startswith("negative")}
            t0 = time.perf_counter()
            adapter.denoise(req, inputs)  # warm-up: compile, kernel choice, allocator
            if adapter.compile and task.startswith("qwen"):
                adapter.warm_up([shape])  # the second text length: the dynamic recompile
            warm_s = time.perf_counter() - t0
            def run(a: Any = adapter, i: Any = inputs) -> Any:
                return a.denoise(req, i)

            total, latents = timed(run, args.repeats)
            lat = latents["latents"].float()
            row: dict[str, Any] = {"load_s": round(load_s, 2), "warmup_s": round(warm_s, 2),
                                   "step_s": round(total / steps, 4),
                                   "peak_gib": peak_gib()}
            if reference is None:
                reference = lat
            else:
                diff = (lat - reference).abs()
                row["max_abs_diff_vs_first"] = float(diff.max())
                row["rel_l2_vs_first"] = float((lat - reference).norm() / reference.norm())
            row["finite"] = bool(torch.isfinite(lat).all())
            out["variants"][name] = row
            log(f"{task} {name}: step {row['step_s']:.3f} s (warm-up {warm_s:.1f} s) {row}")
        except Exception as exc:  # one variant failing must not lose the others
            out["variants"][name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            log(f"{task} {name}: FAILED {exc!r}"[:500])
        finally:
            adapter = None  # type: ignore[assignment]
            free()
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
    return out


def section_wan(args: argparse.Namespace) -> dict[str, Any]:
    from modelkit import real as real_models

    folder = model_dir(args, "wan-1.3b")
    t0 = time.perf_counter()
    built = real_models.build("wan-1.3b", folder, args.device, args.dtype, args.layers)
    free()
    out: dict[str, Any] = {"build": built, "build_wall_s": round(time.perf_counter() - t0, 1)}
    variants = [dict(WAN_VARIANTS[k]) for k in args.wan_variants.split(",")]
    out["dit"] = dit_variants(args, "wan_t2v", folder, args.wan_shape, args.wan_steps,
                              variants, True, args.budget_s - 60)
    return out


def _wan_decoder(args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    """The Wan2.1 decoder (the VAE of every Wan2.1 size), a request of ``--wan-shape`` and
    random latents of its size on the device."""
    import torch

    from contracts.pipelines import parse_shape
    from contracts.request import GenerationRequest
    from modelkit import real as real_models
    from workers.models import DecoderAdapter
    from workers.models.media import VideoSettings

    folder = model_dir(args, "wan-1.3b")
    real_models.build("wan-1.3b", folder, args.device, args.dtype, args.layers)
    dec = DecoderAdapter.for_task(folder, "wan_t2v", args.device, args.dtype,
                                  video=VideoSettings(codec="libx264"))
    dec.load()
    h, w, f = parse_shape(args.wan_shape)
    req = GenerationRequest(task="wan_t2v", prompt="bench", height=h, width=w, num_frames=f,
                            infer_steps=2)
    gen = torch.Generator().manual_seed(0)
    latents = {"latents": torch.randn(1, 16, (f - 1) // 4 + 1, h // 8, w // 8, generator=gen)
               .to(args.device)}
    return dec, req, latents


def section_decoder(args: argparse.Namespace) -> dict[str, Any]:
    """The Wan decoder: VAE alone against the critical path of the background-encoder
    decoder (decode_pixels), and the MP4 of its frames."""
    import numpy as np
    import torch

    dec, req, latents = _wan_decoder(args)
    out: dict[str, Any] = {}

    def vae_only() -> Any:
        x = dec.decode_tensor(req, latents)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return x

    dec.decode_pixels(req, latents)  # warm-up
    vae_s, _ = timed(vae_only, args.repeats)
    crit_s, pixels = timed(lambda: dec.decode_pixels(req, latents), args.repeats)
    mp4_s, art = timed(lambda: dec.encode_media(req, pixels), args.repeats)
    out.update({"vae_decode_s": round(vae_s, 3),
                "critical_path_decode_pixels_s": round(crit_s, 3),
                "overhead_over_vae_s": round(crit_s - vae_s, 3),
                "mp4_of_vae_frames_s": round(mp4_s, 3), "mp4_bytes": len(art.data),
                "pixels": list(np.asarray(pixels).shape)})
    log(f"decoder: {out}")
    return out


def section_decoder_stream(args: argparse.Namespace) -> dict[str, Any]:
    """Issue 33: decode + MP4 serial (``decode_pixels`` then ``encode_media``, today's path
    where the decoder does not stream) against streamed (``decode_media``: the MP4 written on
    a background thread while the VAE decodes, then its tail), on the same latents in the
    same run, alternating, after one warm-up of each. Each side: the device decode (returns
    when the pixels are on the host), what follows it (the whole MP4, or the writer's tail)
    and their sum; the ratio is streamed / serial of the sums. Both results are compared:
    the pixels and the MP4 bytes must be equal."""
    import numpy as np

    dec, req, latents = _wan_decoder(args)
    if dec.frame_chunks(req, latents) is None:
        raise RuntimeError("this decoder does not stream (vae_tiling?): nothing to compare")

    def serial() -> tuple[float, float, Any]:
        t0 = time.perf_counter()
        pixels = dec.decode_pixels(req, latents)
        t1 = time.perf_counter()
        art = dec.encode_media(req, pixels)
        return t1 - t0, time.perf_counter() - t1, art

    def streamed() -> tuple[float, float, Any]:
        t0 = time.perf_counter()
        pending = dec.decode_media(req, latents)
        t1 = time.perf_counter()
        art = pending.result()
        return t1 - t0, time.perf_counter() - t1, art

    serial()  # warm-up (kernels, allocator, the encoder's first open)
    streamed()
    runs: dict[str, list[tuple[float, float, Any]]] = {"serial": [], "streamed": []}
    for _ in range(max(args.repeats, 3)):
        runs["serial"].append(serial())
        runs["streamed"].append(streamed())
    out: dict[str, Any] = {}
    for name, rows in runs.items():
        out[f"{name}_decode_s"] = round(statistics.median(r[0] for r in rows), 3)
        out[f"{name}_after_decode_s"] = round(statistics.median(r[1] for r in rows), 3)
        out[f"{name}_total_s"] = round(statistics.median(r[0] + r[1] for r in rows), 3)
    out["ratio_streamed_over_serial"] = round(out["streamed_total_s"] / out["serial_total_s"], 3)
    out["saved_s"] = round(out["serial_total_s"] - out["streamed_total_s"], 3)
    a, b = runs["serial"][-1][2], runs["streamed"][-1][2]
    out["pixels_equal"] = bool(np.array_equal(a.frames, b.frames))
    out["mp4_bytes_equal"] = a.data == b.data
    out.update({"repeats": len(runs["serial"]), "shape": args.wan_shape,
                "threads": dec.video.threads, "preset": dec.video.preset})
    log(f"decoder_stream: streamed/serial = {out['ratio_streamed_over_serial']} "
        f"({out['streamed_total_s']} s against {out['serial_total_s']} s): {out}")
    return out


def section_qwen(args: argparse.Namespace) -> dict[str, Any]:
    from modelkit import real as real_models

    folder = model_dir(args, "qwen-image")
    t0 = time.perf_counter()
    built = real_models.build("qwen-image", folder, args.device, args.dtype, args.layers)
    free()
    out: dict[str, Any] = {"build": built, "build_wall_s": round(time.perf_counter() - t0, 1)}
    RESULTS["qwen"] = out
    save(args.out)
    variants = [dict(QWEN_VARIANTS[k]) for k in args.qwen_variants.split(",")]
    out["forward"] = dit_variants(args, "qwen_t2i", folder, args.qwen_shape, args.qwen_steps,
                                  variants, False, args.budget_s)
    return out


SECTIONS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "env": section_env, "mp4": section_mp4, "wan": section_wan, "decoder": section_decoder,
    "decoder_stream": section_decoder_stream, "qwen": section_qwen}
WAN_VARIANTS: dict[str, dict[str, Any]] = {
    "eager": {"name": "eager sdpa, 2 x batch-1"},
    "cfg_batch": {"name": "eager sdpa, cfg_batch", "cfg_batch": True},
    "sage": {"name": "sage_attn 1.0.6, 2 x batch-1", "attention": "sage_attn"},
    "cudnn": {"name": "sdpa_cudnn, 2 x batch-1", "attention": "sdpa_cudnn"},
    "flash": {"name": "sdpa_flash, 2 x batch-1", "attention": "sdpa_flash"},
    "compile": {"name": "compile, 2 x batch-1", "compile": True},
    "compile_cfg": {"name": "compile + cfg_batch", "compile": True, "cfg_batch": True},
    "compile_cudnn": {"name": "compile + sdpa_cudnn", "compile": True,
                      "attention": "sdpa_cudnn"},
    "compile_cudnn_cfg": {"name": "compile + sdpa_cudnn + cfg_batch", "compile": True,
                          "attention": "sdpa_cudnn", "cfg_batch": True},
}
QWEN_VARIANTS: dict[str, dict[str, Any]] = {
    "eager": {"name": "eager sdpa"},
    "cudnn": {"name": "sdpa_cudnn", "attention": "sdpa_cudnn"},
    "compile": {"name": "compile", "compile": True},
    "compile_cudnn": {"name": "compile + sdpa_cudnn", "compile": True,
                      "attention": "sdpa_cudnn"},
}


def summary() -> str:
    lines = ["| what | value |", "| --- | --- |"]
    for name, row in (RESULTS.get("mp4") or {}).items():
        lines.append(f"| MP4 81x480x832 {name} | {row['seconds']} s |")
    wan = RESULTS.get("wan") or {}
    for name, row in ((wan.get("dit") or {}).get("variants") or {}).items():
        lines.append(f"| Wan 1.3B CFG step, {name} | {row.get('step_s', row)} s "
                     f"(warm-up {row.get('warmup_s')} s, "
                     f"max diff {row.get('max_abs_diff_vs_first')}) |")
    for k, v in (RESULTS.get("decoder") or {}).items():
        lines.append(f"| Wan decoder {k} | {v} |")
    for k, v in (RESULTS.get("decoder_stream") or {}).items():
        lines.append(f"| Wan decode + MP4, streamed vs serial: {k} | {v} |")
    qwen = RESULTS.get("qwen") or {}
    for name, row in ((qwen.get("forward") or {}).get("variants") or {}).items():
        lines.append(f"| Qwen-Image 1024x1024 step (1 forward), {name} | "
                     f"{row.get('step_s', row)} s (warm-up {row.get('warmup_s')} s, "
                     f"max diff {row.get('max_abs_diff_vs_first')}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sections", default="env,mp4,wan,decoder,qwen")
    ap.add_argument("--models", type=Path, default=Path("/tmp/diffring-real"))
    ap.add_argument("--wan-steps", type=int, default=3)
    ap.add_argument("--qwen-steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=480)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layers", type=int, help="DiT depth (quick checks; default: published)")
    ap.add_argument("--wan-shape", default="480x832x81")
    ap.add_argument("--wan-variants", default="eager,cfg_batch,sage,compile,compile_cfg",
                    help=f"comma list of {', '.join(WAN_VARIANTS)}")
    ap.add_argument("--qwen-variants", default="eager,compile",
                    help=f"comma list of {', '.join(QWEN_VARIANTS)}")
    ap.add_argument("--qwen-shape", default="1024x1024")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.sections.split(","):
        if time.monotonic() - T0 > args.budget_s:
            RESULTS[name] = {"skipped": "time budget"}
            continue
        log(f"section {name}")
        try:
            RESULTS[name] = SECTIONS[name](args)
        except Exception as exc:
            import traceback

            RESULTS[name] = {"error": f"{type(exc).__name__}: {exc}",
                             "traceback": traceback.format_exc()[-4000:]}
            log(f"section {name} FAILED: {exc!r}")
        save(args.out)
    text = summary()
    (args.out / "bench_gpu.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
