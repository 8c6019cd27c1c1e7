#!/usr/bin/env python3
"""GPU smoke test: a whole Wan T2V group on one GPU, GPU-resident Mooncake staging, timings.

    python -m scripts.bench.gpu_smoke --out DIR [--device cuda:0] [--dtype bfloat16]
                                      [--requests 2] [--skip-tiny] [--real] [--real-steps 4]

On the lent GPU machine the missing packages must be carried first; BENCHMARKS.md ("GPU smoke:
Wan T2V on one H200") lists them and the exact commands. ``--device cpu --dtype float32``
runs the same checks on a CPU machine (host pools, crc32).

What it does, per scenario:

* ``tiny``: builds the tiny random-weight Wan T2V folder (``modelkit.tiny``).
* ``real`` (``--real``): builds a Wan2.1-1.3B-architecture DiT (dim 1536, 30 layers, 12 heads,
  ffn 8960, text_dim 4096) with random weights in ``--dtype``, a small random UMT5 encoder
  that produces 4096-dim embeddings, and the published Wan VAE config (``modelkit.real``),
  and requests 480x832, 81 frames, ``--real-steps`` steps with CFG.

Then it starts a controller plus one encoder, one transformer and one decoder process
(``launcher.LocalGroup``, each worker with a metrics port) with every stage on
``--device`` in ``--dtype``, rings and Mooncake over tcp, posts ``--requests`` (default 2)
``POST /v1/tasks/video/`` requests one after the other (the first is cold, later ones warm),
waits for each, fetches the first MP4 and checks its frames.

Everything is measured through what the services export; nothing in them is patched:

* each worker's Prometheus endpoint, scraped before and after every request: the seconds of
  each step of the worker loop (``diffring_stage_seconds``: the encoder's ``compute`` is the
  text encode, the transformer's the denoise, the decoder's the VAE decode to pixels (a Wan
  video's MP4 is written meanwhile, issue 33), its ``encode_media`` what is left of the MP4
  after it (the whole encode where the decode does not stream); ``stage`` puts a stage's
  outputs into its pool), the tensors each worker pulled over Mooncake
  (``diffring_transfer_bytes`` / ``diffring_transfer_seconds`` with ``direction="pull"``: the
  transformer's pull is Phase1, the decoder's Phase2), the staging pool's device and checksum
  algorithm (``diffring_staging_pool_info``; ``wsum64``: hashed on the GPU) and the peak GPU
  memory of the request (``diffring_stage_peak_bytes``, the stage's
  ``torch.cuda.max_memory_allocated`` over its last request, pool included);
* the controller's event stream (``GET /v1/events``, opened before the first request): the
  time of each denoising step, from its ``progress`` event's ``at`` (step 1 from the
  transformer's claim, so it includes the Phase1 pull);
* each task's status: the controller's stage timestamps (``stage_times``).

Worker timings are wall times of the loop's steps, not CUDA-synchronised: kernels still
queued when a step returns are charged to the next step (the staging copy waits for them).

The summary (stdout and ``OUT/summary.json``) gives per request the client wall time, those
figures and the controller's stage times. Service logs go to ``OUT/logs-<scenario>.tar.gz``.
Exit status 0 only if every request completed, every pool was on the requested device (with
``wsum64`` on a GPU) and both hand-offs moved bytes over Mooncake.
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
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import httpx

from contracts.roles import Role

ROLES = tuple(role.value for role in Role)
LOG_MARKS = ("mooncake engine started", "protocol auto", "ready:", "ring transport", "ERROR",
             "Traceback", "error:")
Sample = tuple[str, dict[str, str], float]


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
# What the services export
# --------------------------------------------------------------------------------------------
def scrape(url: str) -> list[Sample]:
    """Every sample of one Prometheus endpoint: (name, labels, value)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url, timeout=10, trust_env=False).text
    return [(s.name, dict(s.labels), s.value)
            for family in text_string_to_metric_families(text) for s in family.samples]


def _total(samples: list[Sample], name: str, **labels: str) -> float:
    return sum(v for n, lab, v in samples
               if n == name and all(lab.get(k) == x for k, x in labels.items()))


def worker_figures(before: list[Sample], after: list[Sample]) -> dict[str, Any]:
    """One worker's share of one request, from its endpoint scraped before and after it."""

    def delta(name: str, **labels: str) -> float:
        return _total(after, name, **labels) - _total(before, name, **labels)

    steps = sorted({lab["step"] for n, lab, _ in after if n == "diffring_stage_seconds_sum"})
    seconds = {s: round(delta("diffring_stage_seconds_sum", step=s), 6) for s in steps}
    pull_bytes = delta("diffring_transfer_bytes_total", direction="pull")
    pull_s = delta("diffring_transfer_seconds_sum", direction="pull")
    out: dict[str, Any] = {
        "steps_s": {s: v for s, v in seconds.items() if v > 0},
        "pull": {"bytes": int(pull_bytes), "seconds": round(pull_s, 6),
                 "pulls": int(delta("diffring_transfer_seconds_count", direction="pull")),
                 "gbps": round(pull_bytes / pull_s / 1e9, 3) if pull_s > 0 else None},
    }
    pools = [lab for n, lab, _ in after if n == "diffring_staging_pool_info"]
    if pools:
        out["pool"] = {"device": pools[0]["device"], "checksum_algo": pools[0]["checksum_algo"],
                       "capacity_mib": int(_total(after, "diffring_staging_pool_capacity_bytes"))
                       >> 20}
    peaks = [v for n, _, v in after if n == "diffring_stage_peak_bytes"]
    out["peak_gib"] = round(max(peaks) / 2**30, 3) if peaks else None
    return out


class EventLog:
    """Every event of the controller's ``GET /v1/events`` stream, with the time it carries,
    collected by a thread from :meth:`start` (which returns once the stream is open, so no
    event of a later request is missed) until :meth:`close`."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.events: list[tuple[str, dict[str, Any]]] = []
        self._open = threading.Event()
        self._client = httpx.Client(base_url=url, timeout=httpx.Timeout(10, read=None),
                                    trust_env=False)
        self._thread = threading.Thread(target=self._run, name="events", daemon=True)

    def start(self, timeout: float = 60) -> None:
        self._thread.start()
        if not self._open.wait(timeout):
            raise RuntimeError(f"{self.url}/v1/events did not open within {timeout} s")

    def _run(self) -> None:
        from httpx_sse import connect_sse

        try:
            with connect_sse(self._client, "GET", "/v1/events") as source:
                source.response.raise_for_status()
                self._open.set()
                for sse in source.iter_sse():
                    if sse.event and sse.data:
                        self.events.append((sse.event, json.loads(sse.data)))
        except (httpx.HTTPError, RuntimeError) as exc:  # closed by close(), or the group went
            log(f"event stream ended: {type(exc).__name__}: {exc}")

    def step_times(self, task_id: str) -> list[float]:
        """Seconds of each denoising step of ``task_id`` (step 1 from the DiT's claim)."""
        mine = [(n, d) for n, d in list(self.events) if d.get("task_id") == task_id]
        start = [d["at"] for n, d in mine if n == "stage" and d.get("stage") == "denoising"]
        ats = [d["at"] for n, d in mine if n == "progress"]
        marks = start[-1:] + ats
        return [round(b - a, 4) for a, b in itertools.pairwise(marks)]

    def close(self) -> None:
        self._client.close()
        self._thread.join(10)


# --------------------------------------------------------------------------------------------
# One group, its requests
# --------------------------------------------------------------------------------------------
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


def one_request(url: str, metrics: dict[str, str], events: EventLog, body: dict[str, Any],
                timeout: float) -> dict[str, Any]:
    from launcher import submit

    before = {role: scrape(u) for role, u in metrics.items()}
    t0 = time.perf_counter()
    st = submit(url, "video", body, timeout=timeout)
    entry: dict[str, Any] = {"seed": body["seed"], "status": st,
                             "wall_s": round(time.perf_counter() - t0, 3)}
    entry["workers"] = {role: worker_figures(before[role], scrape(u))
                        for role, u in metrics.items()}
    entry["denoise_steps_s"] = events.step_times(st["task_id"])
    order = sorted(st.get("stage_times", {}).items(), key=lambda kv: kv[1])
    entry["controller_stage_s"] = {
        a: round(tb - ta, 4) for (a, ta), (_b, tb) in itertools.pairwise(order)}
    if order:
        entry["controller_total_s"] = round(order[-1][1] - order[0][1], 4)
    if st["status"] == "completed":
        r = httpx.get(f"{url}/v1/tasks/{st['task_id']}/result", timeout=60)
        entry["result_bytes"] = len(r.content)
        entry["result_content_type"] = r.headers.get("content-type")
        entry["result"] = r.content
    return entry


def run_scenario(name: str, model_path: Path, request: dict[str, Any],
                 args: argparse.Namespace, out_dir: Path, work: Path) -> dict[str, Any]:
    from launcher import LocalGroup, free_ports, group_config

    wd = work / f"group-{name}"
    shutil.rmtree(wd, ignore_errors=True)  # logs of an earlier run in the same folder
    wd.mkdir(parents=True)
    mooncake_cfg = wd / "mooncake.json"
    mooncake_cfg.write_text(json.dumps(
        {"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "protocol": "tcp"}))
    cfg = group_config(
        "wan_t2v", str(model_path), wd, device=args.device, dtype=args.dtype,
        attention_backend="sdpa", staging_pool_mb=args.pool_mb,
        mooncake_config_path=str(mooncake_cfg), disagg_config={"ring_transport": "tcp"})
    group = LocalGroup(cfg, wd)
    group.env = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    result: dict[str, Any] = {
        "scenario": name, "model_path": str(model_path), "request": request,
        "config": {"device": args.device, "dtype": args.dtype, "staging_pool_mb": args.pool_mb,
                   "ring_transport": "tcp", "mooncake_protocol": "tcp"},
        "requests": [],
    }
    events: EventLog | None = None
    t_start = time.perf_counter()
    try:
        group.start("controller")
        group.wait_http()
        host = cfg["server"]["host"]
        metrics = {}
        for role, port in zip(ROLES, free_ports(len(ROLES), host), strict=True):
            group.start(role, {"server": {"metric_port": port}})
            metrics[role] = f"http://{host}:{port}/metrics"
        group.wait_workers(dict.fromkeys(ROLES, 1), timeout=args.request_timeout)
        result["group_start_s"] = round(time.perf_counter() - t_start, 2)
        log(f"{name}: group up in {result['group_start_s']} s at {group.url}")
        events = EventLog(group.url)
        events.start()
        for i in range(args.requests):  # the first is cold, the others warm (seed + i)
            body = {**request, "seed": request["seed"] + i}
            entry = one_request(group.url, metrics, events, body, args.request_timeout)
            data = entry.pop("result", None)
            if i == 0 and data is not None:
                entry["video_check"] = check_video(data, request["target_video_length"],
                                                   request["height"], request["width"])
                if len(data) < 15 << 20:
                    (out_dir / f"{name}.mp4").write_bytes(data)
            result["requests"].append(entry)
            log(f"{name}: request {i} ({'cold' if i == 0 else 'warm'}): "
                f"{entry['status']['status']} in {entry['wall_s']} s")
        status = httpx.get(f"{group.url}/v1/service/status", timeout=10).json()
        result["service_status_counts"] = status.get("counts")
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-3000:]
        log(f"{name}: FAILED: {result['error']}")
    finally:
        if events is not None:
            events.close()
        group.stop()
    logs = {svc.role + f"-{i}": svc.log() for i, svc in enumerate(group.services)}
    result["log_highlights"] = {
        role: [ln for ln in text.splitlines() if any(k in ln for k in LOG_MARKS)][:12]
        for role, text in logs.items()}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for f in sorted(wd.rglob("*")):
            if f.is_file() and f.suffix in (".log", ".json"):
                tar.add(f, arcname=str(f.relative_to(wd)))
    (out_dir / f"logs-{name}.tar.gz").write_bytes(buf.getvalue())
    return result


def verdict(res: dict[str, Any], device: str) -> list[str]:
    problems = [f"error: {res['error']}"] if res.get("error") else []
    requests = res.get("requests", [])
    if not requests:
        return [*problems, "no request ran"]
    want = "cuda:0" if device == "cuda" else device
    for entry in requests:
        st = entry["status"]
        if st.get("status") != "completed":
            problems.append(f"request seed {entry['seed']}: {st.get('status')!r} "
                            f"({st.get('error')})")
    first = requests[0]["workers"]
    for role in ROLES:
        pool = first.get(role, {}).get("pool")
        if pool is None:
            problems.append(f"{role} exports no diffring_staging_pool_info")
        elif pool["device"] != want or (want.startswith("cuda")
                                        and pool["checksum_algo"] != "wsum64"):
            problems.append(f"{role} pool on {pool['device']} with {pool['checksum_algo']}")
    for phase, role in (("Phase1", "transformer"), ("Phase2", "decoder")):
        if not first.get(role, {}).get("pull", {}).get("bytes"):
            problems.append(f"no {phase} bytes pulled over Mooncake by the {role}")
    vc = requests[0].get("video_check", {})
    if vc and not vc.get("shape_ok"):
        problems.append(f"video check: {vc}")
    return problems


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------
def _step(entry: dict[str, Any], role: str, step: str) -> Any:
    return entry["workers"].get(role, {}).get("steps_s", {}).get(step)


def print_request(label: str, entry: dict[str, Any]) -> None:
    w = entry["workers"]
    print(f"-- {label} (seed {entry['seed']}): {entry['status'].get('status')} in "
          f"{entry['wall_s']} s, result {entry.get('result_bytes')} bytes "
          f"{entry.get('result_content_type')}")
    print(f"encode {_step(entry, 'encoder', 'compute')} s; denoise "
          f"{_step(entry, 'transformer', 'compute')} s, steps {entry['denoise_steps_s']}; "
          f"VAE decode {_step(entry, 'decoder', 'compute')} s; "
          f"MP4 after it {_step(entry, 'decoder', 'encode_media')} s")
    for phase, producer, consumer in (("Phase1", "encoder", "transformer"),
                                      ("Phase2", "transformer", "decoder")):
        pull = w.get(consumer, {}).get("pull", {})
        print(f"{phase}: {pull.get('bytes')} bytes, stage {_step(entry, producer, 'stage')} s "
              f"({producer}), pull {pull.get('seconds')} s = {pull.get('gbps')} GB/s "
              f"({consumer})")
    print(f"peak GiB: {({r: f.get('peak_gib') for r, f in w.items()})}")
    print(f"controller stages (s): {entry.get('controller_stage_s')} "
          f"total {entry.get('controller_total_s')}")


def print_summary(res: dict[str, Any]) -> None:
    print(f"\n==== {res['scenario']} ====", flush=True)
    print(f"request: {json.dumps(res['request'])}; group start {res.get('group_start_s')} s")
    requests = res.get("requests", [])
    if requests:
        for role, f in requests[0]["workers"].items():
            print(f"pool {role:<11} {f.get('pool')}")
        print(f"video check {requests[0].get('video_check')}")
    for i, entry in enumerate(requests):
        print_request("cold" if i == 0 else "warm", entry)
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
    for mod in ("diffusers", "transformers", "fastapi", "uvicorn", "pydantic", "httpx", "av",
                "mooncake"):
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
    ap.add_argument("--requests", type=int, default=2,
                    help="requests per scenario, one after another")
    ap.add_argument("--skip-tiny", action="store_true")
    ap.add_argument("--tiny-size", type=int, nargs=3, default=(64, 64, 9),
                    metavar=("H", "W", "FRAMES"))
    ap.add_argument("--tiny-steps", type=int, default=2)
    ap.add_argument("--real", action="store_true", help="also run the 1.3B-architecture size")
    ap.add_argument("--real-layers", type=int, default=30)
    ap.add_argument("--real-te-layers", type=int, default=2)
    ap.add_argument("--real-size", type=int, nargs=3, default=(480, 832, 81),
                    metavar=("H", "W", "FRAMES"))
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

    def scenario(name: str, model: Path, size: tuple[int, int, int], steps: int, fps: int,
                 prompt: str) -> None:
        nonlocal ok
        h, w, f = size
        req = {"prompt": prompt, "seed": 7, "height": h, "width": w, "target_video_length": f,
               "infer_steps": steps, "target_fps": fps}
        res = run_scenario(name, model, req, args, args.out, args.workdir)
        res["problems"] = verdict(res, args.device)
        ok &= not res["problems"]
        report["scenarios"].append(res)
        print_summary(res)
        print(f"{name} problems: {res['problems']}", flush=True)
        save()

    if not args.skip_tiny:
        t0 = time.perf_counter()
        model = build_tiny(args.workdir / "models")
        log(f"tiny models built in {time.perf_counter() - t0:.1f} s: {model}")
        scenario("tiny", model, args.tiny_size, args.tiny_steps, 8,
                 "A red fox running through fresh snow at sunrise")

    if args.real:
        dest = args.workdir / "models" / f"wan_t2v_1.3b_arch_{args.real_layers}l"
        if not dest.exists():
            t0 = time.perf_counter()
            cmd = [sys.executable, "-m", "scripts.bench.gpu_smoke", "--build-real", str(dest),
                   "--device", args.device, "--dtype", args.dtype,
                   "--real-layers", str(args.real_layers),
                   "--real-te-layers", str(args.real_te_layers)]
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
        scenario("real", dest, args.real_size, args.real_steps, 16,
                 "A red fox running through fresh snow at sunrise, cinematic lighting")

    save()
    log("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
