#!/usr/bin/env python3
"""GPU smoke test: a whole Wan T2V group on one GPU, GPU-resident Mooncake staging, timings.

    python -m scripts.bench.gpu_smoke --out DIR [--device cuda:0] [--dtype bfloat16]
                                [--requests 2] [--skip-tiny] [--real] [--real-steps 4] ...

On the lent GPU machine the missing packages must be carried first; BENCHMARKS.md ("GPU smoke:
Wan T2V on one H200") lists them and the exact commands.

What it does, per scenario:

* ``tiny``: builds the tiny random-weight Wan T2V folder (``modelkit.tiny``).
* ``real`` (``--real``): builds a Wan2.1-1.3B-architecture DiT (dim 1536, 30 layers, 12 heads,
  ffn 8960, text_dim 4096) with random weights in ``--dtype``, a small random UMT5 encoder
  that produces 4096-dim embeddings, and the published Wan VAE config (diffusers' defaults of
  ``AutoencoderKLWan``), and requests 480x832, 81 frames, ``--real-steps`` steps with CFG.

Then it starts a controller plus one encoder, one transformer and one decoder process
(``controller.group.LocalGroup``) with every stage on ``--device`` in ``--dtype``, rings over
tcp and Mooncake over tcp, posts ``--requests`` (default 2) ``POST /v1/tasks/video/`` requests one
after the other (the first is cold, later ones warm), waits for each, fetches the first MP4 and
checks its frames.

Proof of GPU-resident staging and the timings come from a ``sitecustomize`` hook that this
script writes into its work folder and puts on the workers' ``PYTHONPATH``: it wraps (without
changing behaviour) ``StagingPool.start``, ``stage_tensors``, ``pull_tensors``,
``TransferEngine.read`` and the three stage calls, and appends one JSON line per event to a
trace file per process. The summary (stdout and ``OUT/summary.json``) gives each pool's
device and checksum algorithm (``wsum64`` = hashed on the GPU), the Phase1 / Phase2 tensors
with their bytes, devices and times, the Mooncake read times, encode / per-step denoise /
VAE decode / MP4 times, and the controller's stage timestamps. Service logs and traces go to
``OUT/logs-<scenario>.tar.gz``. Exit status 0 only if every scenario completed and every pool
was on the requested device.
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import traceback
from pathlib import Path
from typing import Any

# --------------------------------------------------------------------------------------------
# The hook the service processes load (sitecustomize). Active only with DIFFRING_SMOKE_TRACE.
# --------------------------------------------------------------------------------------------
HOOK = r"""
import os, sys
_TRACE_DIR = os.environ.get("DIFFRING_SMOKE_TRACE")
if _TRACE_DIR:
    import functools, importlib.abc, importlib.util, json, time

    def _role():
        argv = list(getattr(sys, "argv", []) or [])
        if "--service" in argv and argv.index("--service") + 1 < len(argv):
            return argv[argv.index("--service") + 1]
        return "proc"

    def _emit(event, **fields):
        rec = {"t": time.time(), "pid": os.getpid(), "role": _role(), "event": event, **fields}
        line = json.dumps(rec, default=str)
        with open(os.path.join(_TRACE_DIR, f"{rec['role']}-{os.getpid()}.jsonl"), "a") as f:
            f.write(line + "\n")
        print(f"[smoke] {line}", file=sys.stderr, flush=True)

    def _sync():
        try:
            import torch
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
        except Exception:
            pass

    def _peak_gib():
        try:
            import torch
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                return round(torch.cuda.max_memory_allocated() / 2**30, 3)
        except Exception:
            pass
        return None

    def _tinfo(t):
        return {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                "device": str(t.device), "nbytes": t.numel() * t.element_size()}

    def _patch_pool(m):
        orig_start = m.StagingPool.start
        def start(self, engine):
            orig_start(self, engine)
            buf = self._buffer
            _emit("pool", device=str(self.device), buffer_device=str(buf.device),
                  buffer_is_cuda=bool(buf.is_cuda), checksum_algo=self.checksum_algo,
                  capacity=self.capacity, base_addr=hex(buf.data_ptr()))
        m.StagingPool.start = start

    def _patch_handoff(m):
        orig_stage = m.stage_tensors
        @functools.wraps(orig_stage)
        def stage_tensors(pool, engine, tensors, **kw):
            t0 = time.perf_counter()
            descs = orig_stage(pool, engine, tensors, **kw)
            dt = time.perf_counter() - t0
            _emit("stage", task_id=kw.get("task_id"), seconds=round(dt, 6),
                  nbytes=sum(d.nbytes for d in descs), pool_device=str(pool.device),
                  tensors={k: _tinfo(v) for k, v in tensors.items()},
                  checksum_algos=sorted({d.checksum_algo for d in descs}))
            return descs
        m.stage_tensors = stage_tensors

        orig_pull = m.pull_tensors
        @functools.wraps(orig_pull)
        def pull_tensors(engine, pool, descs, device="cpu", task_id=None, **kw):
            descs = list(descs)
            t0 = time.perf_counter()
            out = orig_pull(engine, pool, descs, device, task_id, **kw)
            dt = time.perf_counter() - t0
            _emit("pull", task_id=task_id, seconds=round(dt, 6),
                  nbytes=sum(d.nbytes for d in descs), pool_device=str(pool.device),
                  checksum_algos=sorted({d.checksum_algo for d in descs}),
                  out={k: _tinfo(v) for k, v in out.items()})
            return out
        m.pull_tensors = pull_tensors

    def _patch_transfer(m):
        orig_read = m.TransferEngine.read
        @functools.wraps(orig_read)
        def read(self, segment, local_addr, remote_addr, nbytes, *a, **kw):
            t0 = time.perf_counter()
            r = orig_read(self, segment, local_addr, remote_addr, nbytes, *a, **kw)
            dt = time.perf_counter() - t0
            _emit("mooncake_read", tensor=kw.get("tensor"), nbytes=nbytes, seconds=round(dt, 6),
                  gbps=round(nbytes / dt / 1e9, 3) if dt > 0 else None,
                  protocol=getattr(self.settings, "protocol", None))
            return r
        m.TransferEngine.read = read

    def _patch_stages(m):
        orig_encode = m.WanEncoder.encode
        def encode(self, req, image_bytes=None):
            _sync(); t0 = time.perf_counter()
            out = orig_encode(self, req, image_bytes)
            _sync(); dt = time.perf_counter() - t0
            _emit("encode", seconds=round(dt, 6), device=self.device_name, dtype=self.dtype_name,
                  peak_gib=_peak_gib(), tensors={k: _tinfo(v) for k, v in out.items()})
            return out
        m.WanEncoder.encode = encode

        orig_denoise = m.WanTransformer.denoise
        def denoise(self, req, tensors, on_step=None, should_stop=None):
            steps = []
            _sync(); t0 = time.perf_counter()
            last = [t0]
            def wrapped(k, n):
                _sync(); now = time.perf_counter()
                steps.append(round(now - last[0], 6)); last[0] = now
                if on_step is not None:
                    on_step(k, n)
            out = orig_denoise(self, req, tensors, on_step=wrapped, should_stop=should_stop)
            _sync(); dt = time.perf_counter() - t0
            _emit("denoise", seconds=round(dt, 6), step_seconds=steps, device=self.device_name,
                  dtype=self.dtype_name, attention=self.attention, peak_gib=_peak_gib(),
                  guidance_scale=req.guidance_scale,
                  tensors={k: _tinfo(v) for k, v in out.items()})
            return out
        m.WanTransformer.denoise = denoise

    def _patch_base(m):
        orig_decode = m.DecoderAdapter.decode_pixels
        def decode_pixels(self, req, tensors):
            _sync(); t0 = time.perf_counter()
            px = orig_decode(self, req, tensors)
            dt = time.perf_counter() - t0
            _emit("decode", seconds=round(dt, 6), device=self.device_name, dtype=self.dtype_name,
                  peak_gib=_peak_gib(), result_bytes=int(px.nbytes), media_type="pixels")
            return px
        m.DecoderAdapter.decode_pixels = decode_pixels

    def _patch_wan(m):
        orig = m.WanDecoder.decode_tensor
        def decode_tensor(self, req, tensors):
            _sync(); t0 = time.perf_counter()
            out = orig(self, req, tensors)
            _sync()
            _emit("vae_decode", seconds=round(time.perf_counter() - t0, 6),
                  frames_shape=list(out.shape))
            return out
        m.WanDecoder.decode_tensor = decode_tensor

    def _patch_media(m):
        orig = m.encode_mp4
        @functools.wraps(orig)
        def encode_mp4(frames, fps, *a, **kw):
            t0 = time.perf_counter()
            data = orig(frames, fps, *a, **kw)
            _emit("encode_mp4", seconds=round(time.perf_counter() - t0, 6),
                  frames_shape=list(frames.shape), nbytes=len(data))
            return data
        m.encode_mp4 = encode_mp4

    def _patch_wan_module(m):
        _patch_stages(m)
        _patch_wan(m)

    _PATCHES = {"tensorplane.pool": _patch_pool, "tensorplane.handoff": _patch_handoff,
                "tensorplane.engine": _patch_transfer, "workers.models.base": _patch_base,
                "workers.models.wan": _patch_wan_module, "workers.models.media": _patch_media}

    class _Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name not in _PATCHES:
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            if spec is None or spec.loader is None:
                return spec
            loader = spec.loader
            orig_exec = loader.exec_module
            def exec_module(module, _orig=orig_exec, _name=name):
                _orig(module)
                try:
                    _PATCHES[_name](module)
                except Exception as exc:
                    print(f"[smoke] patching {_name} failed: {exc!r}", file=sys.stderr)
            loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Hook())
"""


def log(msg: str) -> None:
    print(f"[gpu_smoke {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------
def build_tiny(models: Path) -> Path:
    from modelkit.tiny import build_task

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return build_task(models, "wan_t2v", seed=0)


def build_real(dest: Path, device: str, dtype: str, layers: int, te_layers: int) -> None:
    """Wan2.1-1.3B-architecture DiT + real Wan VAE config + small 4096-dim UMT5, random
    (``modelkit.real``)."""
    from modelkit import real as real_models

    info = real_models.build("wan-1.3b", dest, device, dtype, layers, te_layers)
    (dest / "gpu_smoke_build.json").write_text(json.dumps(info))
    print(json.dumps(info), flush=True)


# --------------------------------------------------------------------------------------------
# One group, one request
# --------------------------------------------------------------------------------------------
def read_traces(trace_dir: Path) -> list[dict[str, Any]]:
    events = []
    for f in sorted(trace_dir.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                events.append(json.loads(line))
    return sorted(events, key=lambda e: e["t"])


def check_video(data: bytes, frames: int, height: int, width: int) -> dict[str, Any]:
    try:
        from workers.models.media import read_mp4

        px = read_mp4(data)
        return {
            "decoded_shape": list(px.shape),
            "shape_ok": tuple(px.shape) == (frames, height, width, 3),
            "mean": round(float(px.mean()), 3),
            "std": round(float(px.std()), 3),
        }
    except Exception as exc:  # reading back is a check, not the test
        return {"decoded_error": f"{type(exc).__name__}: {exc}"}


def summarize(events: list[dict[str, Any]], status: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"pools": {}, "phase1": {}, "phase2": {}}
    for e in events:
        role = e["role"]
        if e["event"] == "pool":
            out["pools"][role] = {
                k: e[k]
                for k in ("device", "buffer_device", "buffer_is_cuda", "checksum_algo", "capacity")
            }
        elif e["event"] == "stage":
            phase = "phase1" if role == "encoder" else "phase2"
            out[phase]["stage_s"] = e["seconds"]
            out[phase]["nbytes"] = e["nbytes"]
            out[phase]["tensors"] = e["tensors"]
            out[phase]["checksum_algos"] = e["checksum_algos"]
            out[phase]["producer_pool_device"] = e["pool_device"]
        elif e["event"] == "pull":
            phase = "phase1" if role == "transformer" else "phase2"
            out[phase]["pull_s"] = e["seconds"]
            out[phase]["consumer_pool_device"] = e["pool_device"]
            out[phase]["pulled_to"] = sorted({v["device"] for v in e["out"].values()})
        elif e["event"] == "mooncake_read":
            phase = "phase1" if role == "transformer" else "phase2"
            reads = out[phase].setdefault("mooncake_reads", [])
            reads.append({k: e[k] for k in ("tensor", "nbytes", "seconds", "gbps", "protocol")})
        elif e["event"] in ("encode", "denoise", "decode", "vae_decode", "encode_mp4"):
            out[e["event"]] = {
                k: v for k, v in e.items() if k not in ("t", "pid", "role", "event", "tensors")
            }
    for phase in ("phase1", "phase2"):
        reads = out[phase].get("mooncake_reads", [])
        if reads:
            nb = sum(r["nbytes"] for r in reads)
            s = sum(r["seconds"] for r in reads)
            out[phase]["mooncake_read_total"] = {
                "nbytes": nb,
                "seconds": round(s, 6),
                "gbps": round(nb / s / 1e9, 3) if s else None,
            }
    times = status.get("stage_times", {})
    order = sorted(times.items(), key=lambda kv: kv[1])
    out["controller_stage_s"] = {
        a: round(tb - ta, 4) for (a, ta), (_b, tb) in itertools.pairwise(order)
    }
    if order:
        out["controller_total_s"] = round(order[-1][1] - order[0][1], 4)
    return out


def run_scenario(
    name: str,
    model_path: Path,
    request: dict[str, Any],
    args: argparse.Namespace,
    out_dir: Path,
    work: Path,
) -> dict[str, Any]:
    import httpx

    from controller.group import LocalGroup, group_config, submit

    wd = work / f"group-{name}"
    trace = wd / "trace"
    hooks = wd / "hooks"
    shutil.rmtree(trace, ignore_errors=True)  # traces of an earlier run in the same folder
    for d in (wd, trace, hooks):
        d.mkdir(parents=True, exist_ok=True)
    (hooks / "sitecustomize.py").write_text(HOOK)
    mooncake_cfg = wd / "mooncake.json"
    mooncake_cfg.write_text(
        json.dumps(
            {"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "protocol": "tcp"}
        )
    )
    cfg = group_config(
        "wan_t2v",
        str(model_path),
        wd,
        device=args.device,
        dtype=args.dtype,
        attention_backend="sdpa",
        staging_pool_mb=args.pool_mb,
        mooncake_config_path=str(mooncake_cfg),
        disagg_config={"ring_transport": "tcp"},
    )
    group = LocalGroup(cfg, wd)
    group.env = {
        "PYTHONPATH": os.pathsep.join([str(hooks), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "DIFFRING_SMOKE_TRACE": str(trace),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    result: dict[str, Any] = {
        "scenario": name,
        "model_path": str(model_path),
        "request": request,
        "config": {
            "device": args.device,
            "dtype": args.dtype,
            "staging_pool_mb": args.pool_mb,
            "ring_transport": "tcp",
            "mooncake_protocol": "tcp",
        },
        "warm": [],
    }
    t_start = time.perf_counter()
    try:
        group.start_all()
        result["group_start_s"] = round(time.perf_counter() - t_start, 2)
        log(f"{name}: group up in {result['group_start_s']} s at {group.url}")
        t0, window0 = time.perf_counter(), time.time()
        st = submit(group.url, "video", request, timeout=args.request_timeout)
        result["request_wall_s"] = round(time.perf_counter() - t0, 3)
        result["window"] = (window0, time.time())
        result["status"] = st
        log(f"{name}: status={st['status']} in {result['request_wall_s']} s")
        if st["status"] == "completed":
            r = httpx.get(f"{group.url}/v1/tasks/{st['task_id']}/result", timeout=60)
            result["result_http"] = r.status_code
            data = r.content
            result["result_bytes"] = len(data)
            result["result_content_type"] = r.headers.get("content-type")
            frames = request["target_video_length"]
            result["video_check"] = check_video(data, frames, request["height"], request["width"])
            if len(data) < 15 << 20:
                (out_dir / f"{name}.mp4").write_bytes(data)
        # Further requests on the warm group (seed + i): steady-state figures.
        for i in range(1, args.requests):
            req_i = {**request, "seed": request["seed"] + i}
            t0, window0 = time.perf_counter(), time.time()
            st_i = submit(group.url, "video", req_i, timeout=args.request_timeout)
            entry: dict[str, Any] = {
                "seed": req_i["seed"],
                "status": st_i,
                "request_wall_s": round(time.perf_counter() - t0, 3),
                "window": (window0, time.time()),
            }
            if st_i["status"] == "completed":
                r = httpx.get(f"{group.url}/v1/tasks/{st_i['task_id']}/result", timeout=60)
                entry["result_bytes"] = len(r.content)
            result["warm"].append(entry)
            log(f"{name}: warm request {i}: {st_i['status']} in {entry['request_wall_s']} s")
        status = httpx.get(f"{group.url}/v1/service/status", timeout=10).json()
        result["service_status_counts"] = status.get("counts")
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-3000:]
        log(f"{name}: FAILED: {result['error']}")
    finally:
        group.stop()
    events = read_traces(trace)

    def within(window: Any) -> list[dict[str, Any]]:
        return [e for e in events if e["event"] == "pool" or window[0] <= e["t"] <= window[1]]

    first = within(result["window"]) if "window" in result else events
    result["summary"] = summarize(first, result.get("status", {}))
    for entry in result["warm"]:
        entry["summary"] = summarize(within(entry["window"]), entry["status"])
    logs = {svc.role + f"-{i}": svc.log() for i, svc in enumerate(group.services)}
    result["log_highlights"] = {
        role: [
            ln
            for ln in text.splitlines()
            if any(
                k in ln
                for k in (
                    "mooncake engine started",
                    "protocol auto",
                    "ready:",
                    "ring transport",
                    "ERROR",
                    "Traceback",
                    "error:",
                )
            )
        ][:12]
        for role, text in logs.items()
    }
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for f in sorted(wd.rglob("*")):
            if f.is_file() and f.suffix in (".log", ".json", ".jsonl"):
                tar.add(f, arcname=str(f.relative_to(wd)))
    (out_dir / f"logs-{name}.tar.gz").write_bytes(buf.getvalue())
    return result


def verdict(res: dict[str, Any], device: str) -> list[str]:
    problems = []
    st = res.get("status", {})
    if st.get("status") != "completed":
        problems.append(f"status {st.get('status')!r} ({res.get('error') or st.get('error')})")
    pools = res.get("summary", {}).get("pools", {})
    for role in ("encoder", "transformer", "decoder"):
        p = pools.get(role)
        if p is None:
            problems.append(f"no pool event from {role}")
        elif p["buffer_device"] != device or (
            device.startswith("cuda") and p["checksum_algo"] != "wsum64"
        ):
            problems.append(f"{role} pool on {p['buffer_device']} with {p['checksum_algo']}")
    for phase in ("phase1", "phase2"):
        ph = res.get("summary", {}).get(phase, {})
        if not ph.get("mooncake_reads"):
            problems.append(f"no Mooncake read traced in {phase}")
    for entry in res.get("warm", []):
        if entry["status"].get("status") != "completed":
            problems.append(f"warm request seed {entry['seed']}: {entry['status']}")
    vc = res.get("video_check", {})
    if vc and not vc.get("shape_ok"):
        problems.append(f"video check: {vc}")
    return problems


def print_request(s: dict[str, Any]) -> None:
    for phase in ("phase1", "phase2"):
        ph = s.get(phase, {})
        tensors = {
            k: f"{v['shape']} {v['dtype']} {v['device']}" for k, v in ph.get("tensors", {}).items()
        }
        print(
            f"{phase}: {ph.get('nbytes')} bytes {tensors} algos={ph.get('checksum_algos')} "
            f"stage {ph.get('stage_s')} s ({ph.get('producer_pool_device')}) -> pull "
            f"{ph.get('pull_s')} s ({ph.get('consumer_pool_device')}, to "
            f"{ph.get('pulled_to')}); mooncake {ph.get('mooncake_read_total')}"
        )
    for key in ("encode", "denoise", "vae_decode", "encode_mp4", "decode"):
        if key in s:
            print(f"{key}: {json.dumps(s[key])}")
    print(
        f"controller stages (s): {s.get('controller_stage_s')} total {s.get('controller_total_s')}"
    )


def print_summary(res: dict[str, Any]) -> None:
    s = res.get("summary", {})
    print(f"\n==== {res['scenario']}: {res.get('status', {}).get('status')} ====", flush=True)
    print(f"request: {json.dumps(res['request'])}")
    print(
        f"group start {res.get('group_start_s')} s; request wall {res.get('request_wall_s')} s;"
        f" result {res.get('result_bytes')} bytes {res.get('result_content_type')};"
        f" video check {res.get('video_check')}"
    )
    for role, p in s.get("pools", {}).items():
        print(
            f"pool {role:<11} device={p['buffer_device']} is_cuda={p['buffer_is_cuda']} "
            f"checksum={p['checksum_algo']} capacity={p['capacity'] >> 20} MiB"
        )
    print_request(s)
    for entry in res.get("warm", []):
        print(
            f"-- warm request seed {entry['seed']}: {entry['status'].get('status')} in "
            f"{entry['request_wall_s']} s, result {entry.get('result_bytes')} bytes"
        )
        print_request(entry.get("summary", {}))
    for role, lines in res.get("log_highlights", {}).items():
        for ln in lines:
            print(f"  [{role}] {ln[:240]}")
    if res.get("error"):
        print(res.get("traceback", ""))
    sys.stdout.flush()


def environment() -> dict[str, Any]:
    info: dict[str, Any] = {"python": sys.version.split()[0]}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except Exception as exc:
        info["torch_error"] = repr(exc)
    for mod in (
        "diffusers",
        "transformers",
        "fastapi",
        "uvicorn",
        "pydantic",
        "httpx",
        "av",
        "mooncake",
    ):
        try:
            m = __import__(mod)
            info[mod] = getattr(m, "__version__", "?")
        except Exception as exc:
            info[mod] = f"import failed: {exc!r}"
    try:
        import av

        info["ffmpeg_libs"] = {k: ".".join(map(str, v)) for k, v in av.library_versions.items()}
    except Exception as exc:
        info["ffmpeg_error"] = repr(exc)
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out/gpu_smoke")))
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/diffring-gpu-smoke"))
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--pool-mb", type=int, default=512)
    ap.add_argument("--request-timeout", type=float, default=300)
    ap.add_argument(
        "--requests", type=int, default=2, help="requests per scenario, one after another"
    )
    ap.add_argument("--skip-tiny", action="store_true")
    ap.add_argument(
        "--tiny-size", type=int, nargs=3, default=(64, 64, 9), metavar=("H", "W", "FRAMES")
    )
    ap.add_argument("--tiny-steps", type=int, default=2)
    ap.add_argument("--real", action="store_true", help="also run the 1.3B-architecture size")
    ap.add_argument("--real-layers", type=int, default=30)
    ap.add_argument("--real-te-layers", type=int, default=2)
    ap.add_argument(
        "--real-size", type=int, nargs=3, default=(480, 832, 81), metavar=("H", "W", "FRAMES")
    )
    ap.add_argument("--real-steps", type=int, default=4)
    ap.add_argument("--build-real", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.build_real is not None:  # child process: build and exit (frees the GPU)
        build_real(args.build_real, args.device, args.dtype, args.real_layers, args.real_te_layers)
        return 0

    args.out.mkdir(parents=True, exist_ok=True)
    args.workdir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"environment": environment(), "scenarios": []}
    log(f"environment: {json.dumps(report['environment'])}")
    ok = True

    def save() -> None:
        (args.out / "summary.json").write_text(json.dumps(report, indent=2, default=str))

    if not args.skip_tiny:
        t0 = time.perf_counter()
        model = build_tiny(args.workdir / "models")
        log(f"tiny models built in {time.perf_counter() - t0:.1f} s: {model}")
        h, w, f = args.tiny_size
        req = {
            "prompt": "A red fox running through fresh snow at sunrise",
            "seed": 7,
            "height": h,
            "width": w,
            "target_video_length": f,
            "infer_steps": args.tiny_steps,
            "target_fps": 8,
        }
        res = run_scenario("tiny", model, req, args, args.out, args.workdir)
        res["problems"] = verdict(res, args.device)
        ok &= not res["problems"]
        report["scenarios"].append(res)
        print_summary(res)
        print(f"tiny problems: {res['problems']}", flush=True)
        save()

    if args.real:
        dest = args.workdir / "models" / f"wan_t2v_1.3b_arch_{args.real_layers}l"
        if not dest.exists():
            t0 = time.perf_counter()
            cmd = [
                sys.executable,
                "-m",
                "scripts.bench.gpu_smoke",
                "--build-real",
                str(dest),
                "--device",
                args.device,
                "--dtype",
                args.dtype,
                "--real-layers",
                str(args.real_layers),
                "--real-te-layers",
                str(args.real_te_layers),
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stdout[-3000:], proc.stderr[-5000:], flush=True)
                report["real_build_error"] = proc.stderr[-5000:]
                save()
                return 1
            report["real_build"] = json.loads(proc.stdout.strip().splitlines()[-1])
            report["real_build"]["wall_s"] = round(time.perf_counter() - t0, 2)
            log(f"real-size models built: {report['real_build']}")
        else:
            info_file = dest / "gpu_smoke_build.json"
            if info_file.exists():
                report["real_build"] = json.loads(info_file.read_text())
            log(f"real-size models reused: {dest} {report.get('real_build')}")
        h, w, f = args.real_size
        req = {
            "prompt": "A red fox running through fresh snow at sunrise, cinematic lighting",
            "seed": 7,
            "height": h,
            "width": w,
            "target_video_length": f,
            "infer_steps": args.real_steps,
            "target_fps": 16,
        }
        res = run_scenario("real", dest, req, args, args.out, args.workdir)
        res["problems"] = verdict(res, args.device)
        ok &= not res["problems"]
        report["scenarios"].append(res)
        print_summary(res)
        print(f"real problems: {res['problems']}", flush=True)
        save()

    save()
    log("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
