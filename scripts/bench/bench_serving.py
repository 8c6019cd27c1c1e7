#!/usr/bin/env python3
"""Serving throughput: the one-process baseline against a disaggregated group, N concurrent.

    # CPU, tiny models (built if missing)
    python -m scripts.bench.bench_serving --pipeline qwen_t2i --concurrency 1,2,4,8 --out out/bench
    # GPU, real-size random-weight architectures built on the fly
    python -m scripts.bench.bench_serving --arch wan-1.3b --device cuda:0 --dtype bfloat16 \\
        --steps 8 --concurrency 1,2,4,8 --out $OUT
    # Qwen-Image-Edit-2511 (QwenImageEditPlusPipeline), two 1024x1024 input pictures
    python -m scripts.bench.bench_serving --arch qwen-image-edit-2511 --device cuda:0 \\
        --images 2 --steps 8 --concurrency 1,2,4 --out $OUT
    # scale-out over G GPUs (BENCHMARKS.md, "Multi-GPU scale-out")
    python -m scripts.bench.bench_serving --arch wan-1.3b --device cuda --gpus 8 --steps 8 \\
        --out $OUT
    # one request's DiT over several GPUs: a transformer group (docs/parallel.md)
    python -m scripts.bench.bench_serving --arch wan-14b --devices cuda:0,cuda:1,cuda:2 \\
        --dit-parallel cfg=2 --steps 4 --concurrency 1 --out $OUT
    # memory caps: full-size text encoders; the uncapped group, a group and the baseline
    # capped at 24 GiB per process (docs/benchmarks.md, "Planned: issue 20")
    python -m scripts.bench.bench_serving --arch wan-14b --text-encoders full \\
        --device cuda:0 --modes disagg,disagg@24g,baseline@24g \\
        --set 24g:encoder.max_vram_gb=24 --set 24g:transformer.max_vram_gb=24 \\
        --set 24g:decoder.max_vram_gb=24 --set 'disagg@24g:transformer.weight_storage="fp8"' \\
        --set 'baseline@24g:transformer.offload="block"' --steps 2 --concurrency 1 --out $OUT

For each mode (``baseline``: ``run_service.py --service all``; ``disagg``: a controller plus
its workers, all on this machine, started by ``launcher.LocalGroup``) it sends warm-up
requests, then for each N in ``--concurrency`` keeps N requests in flight (closed loop: a
client posts its next request when its last one completed) until ``--requests`` requests of
that level completed. ``--modes`` may hold tagged modes with service settings of their own
(``--set SELECTOR:KEY=JSON``; ``bench_serving_modes``), e.g. a group and a baseline under a
memory cap beside the uncapped group; ``--dry-run`` checks each mode's config and stops.

Scale-out (``--gpus G`` or ``--devices LIST``; devices and placements: ``bench_serving_layout``):
the baseline is G ``--service all`` replicas, one per device, request i going to replica
i mod G (client-side round robin); the disaggregated group places its workers by
``--placement`` (default: the encoder, the decoder and ``--transformers`` DiT workers on the
first device, ``--transformers`` DiT workers on every other one), each worker's ``device`` set
in its own config file. Before its G-replica levels the baseline measures one replica alone
(replica 0 at N = 2: one request running, one queued, so it never waits for the client;
``--single-requests`` requests) unless ``--single-qps`` gives that figure; a row's efficiency
is its QPS over G x that. N defaults to G, 2G, 4G.

Wan2.2-A14B's split placement: a mode with ``transformer.experts="high"`` starts every second
DiT worker with ``"low"`` instead (``--transformers 2``: one of each; refused with fewer).

Transformer groups (``--dit-parallel cfg=2,ulysses=2``, contracts/parallel.py): each DiT
worker of the placement is one group spanning G consecutive devices from its own (default
placement: the encoder and the decoder on d0, the group on d1..dG when the run has G + 1
devices, else everything from d0); the baseline is then one ``--service all`` on d0, the
one-device figure the group is compared to. The report adds the DiT's seconds per step and
the group's speedup over the baseline at each N.

Per level: requests, QPS, P50/P95/P99 latency, the busy fraction of each stage, the DiT's
seconds per step and each stage's peak GPU memory (its process's largest per-request peak,
``diffring_stage_peak_max_bytes``; a baseline's stages share one process); scale-out adds
DiT busy per device, Mooncake bytes and milliseconds per Phase1 / Phase2 pull, their share of a
request, and the efficiency (``bench_serving_report`` defines each). Latency is the server's
(``created_at`` to ``end_time`` of the task's status); QPS is requests over the level's wall
time (first accepted to last completed).

Output: a markdown table on stdout and in ``OUT/bench_serving.md``, everything in
``OUT/bench_serving.json``, and ``OUT/bench_serving.png`` (QPS and P95 against N; scale-out:
the efficiency too).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from contracts.pipelines import TASK_SPECS
from launcher import LocalGroup, free_ports, group_config
from scripts import ROOT
from scripts.bench import bench_serving_layout as layout
from scripts.bench import bench_serving_modes as modes_
from scripts.bench.bench_models import add_model_args, arch_pipeline, model_folder
from scripts.bench.bench_serving_layout import Endpoint, Plan, make_plan
from scripts.bench.bench_serving_load import (
    TINY_SIZE,
    closed_loop,
    compare_probes,
    fetch_pixels,
    percentile,
    post,
    request_body,
)
from scripts.bench.bench_serving_modes import Mode
from scripts.bench.bench_serving_report import (
    efficiency,
    environment,
    group_lines,
    level_stats,
    plot,
    scrape,
    table,
)


# ------------------------------------------------------------------------------- groups
@dataclass
class Deployment:
    """A started mode: its processes, the front doors clients use, the metrics endpoints."""

    group: LocalGroup
    urls: list[str]
    endpoints: list[Endpoint]

    @property
    def url(self) -> str:
        return self.urls[0]


def wait_health(group: LocalGroup, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        group.check_alive()
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        time.sleep(0.2)
    raise TimeoutError(f"front door {url} did not answer within {timeout} s")


@contextlib.contextmanager
def running(mode: str, cfg: dict[str, Any], workdir: Path, workers: list[tuple[str, int]],
            devices: list[str], timeout: float, dit: tuple[str, int] | None = None,
            serial: bool = False) -> Iterator[Deployment]:
    """Start a baseline (one ``--service all`` replica per device) or a disaggregated group
    (a controller and ``workers``: (role, device index)); yields it once all of it is up.
    ``dit``: (layout, devices) of each DiT worker as a transformer group (``--dit-parallel``).
    ``serial``: each worker starts once the ones before it registered (loaded), so that
    only one of them holds its weights in host memory on the way to the GPU at a time."""
    group = LocalGroup(cfg, workdir)
    host = cfg["server"]["host"]
    parallel, span = dit or (None, 1)
    # A mode whose DiT workers are set to experts 'high' is Wan2.2-A14B's split placement:
    # every second DiT worker holds the low-noise expert instead (a pair per two workers).
    split = mode != "baseline" and cfg.get("transformer", {}).get("experts") == "high"
    if split and sum(role == "transformer" for role, _ in workers) < 2:
        raise SystemExit("a split mode (transformer.experts 'high') needs two DiT workers or "
                         "more, every second one holding the low-noise expert: give "
                         "--transformers 2 (or a --placement with two t)")
    dits = 0
    urls: list[str] = []
    endpoints: list[Endpoint] = []
    try:
        if mode == "baseline":
            # Replica 0 keeps the config's port (group.url); each has its own results folder
            # (the task journal lives there).
            ports = [cfg["server"]["port"], *free_ports(len(devices) - 1, host)]
            for i, (dev, port) in enumerate(zip(devices, ports, strict=True)):
                (mport,) = free_ports(1, host)
                group.start("all", {"device": dev, "output_dir": str(workdir / f"results-{i}"),
                                    "server": {"port": port, "metric_port": mport}})
                urls.append(f"http://{host}:{port}")
                endpoints.append(Endpoint(f"http://{host}:{mport}/metrics", "all", i))
            for url in urls:
                wait_health(group, url, timeout)
        else:
            group.start("controller")
            group.wait_http(timeout=120)
            urls.append(group.url)
            for role, index in workers:
                (mport,) = free_ports(1, host)
                extra: dict[str, Any] = {"device": devices[index],
                                         "server": {"metric_port": mport}}
                if role == "transformer" and span > 1:
                    extra["devices"] = devices[index:index + span]
                    extra["transformer"] = {"parallel": parallel}
                if role == "transformer" and split:
                    extra["transformer"] = {**extra.get("transformer", {}),
                                            "experts": SPLIT_PAIR[dits % 2]}
                    dits += 1
                group.start(role, extra)
                endpoints.append(Endpoint(f"http://{host}:{mport}/metrics", role, index))
                if serial:
                    group.wait_workers(layout.counts(workers[:len(endpoints)]),
                                       timeout=timeout)
            group.wait_workers(layout.counts(workers), timeout=timeout)
        yield Deployment(group, urls, endpoints)
    finally:
        group.stop(timeout=120)


SPLIT_PAIR = ("high", "low")
"""The experts of a split mode's DiT workers, in start order."""


# ------------------------------------------------------------------------------- load
def run_level(dep: Deployment, urls: list[str], kind: str, body: dict[str, Any], conc: int,
              n: int, active: list[int], n_devices: int, timeout: float,
              seed0: int) -> dict[str, Any]:
    before = scrape(dep.endpoints)
    statuses = closed_loop(urls, kind, body, conc, n, timeout, seed0, "bench request")
    after = scrape(dep.endpoints)
    created = [s["created_at"] for s in statuses]
    ended = [s["end_time"] for s in statuses]
    lat = sorted(e - c for c, e in zip(created, ended, strict=True))
    wall = max(ended) - min(created)
    return {
        "concurrency": conc, "requests": n, "wall_s": wall, "qps": n / wall,
        "p50_s": percentile(lat, 50), "p95_s": percentile(lat, 95), "p99_s": percentile(lat, 99),
        "mean_s": statistics.fmean(lat), "latencies_s": lat,
        **level_stats(dep.endpoints, before, after, active, wall, n_devices),
    }


def _level_log(mode: str, row: dict[str, Any]) -> None:
    dits = " ".join("-" if b is None else f"{b:.0%}" for b in row["dit_busy_by_device"])
    peaks = "/".join("-" if (g := row["peak_gib"][r]) is None else f"{g:.1f}"
                     for r in layout.ROLES)
    log(f"{row.get('label', mode)} N={row['concurrency']}: {row['requests']} requests, "
        f"QPS {row['qps']:.3f}, P50 {row['p50_s']:.2f} s, DiT busy {row['busy']['DiT']:.1%} "
        f"(by device: {dits}), peak GiB e/t/d {peaks}")


def run_mode(mode_: Mode, args: argparse.Namespace, cfg: dict[str, Any], body: dict[str, Any],
             levels: list[tuple[int, int]], log_dir: Path, plan: Plan) -> dict[str, Any]:
    """Start the mode, warm it up, run its levels, stop it; its services' logs go to
    ``log_dir`` whatever happened."""
    baseline = mode_.kind == "baseline"
    counts = dict.fromkeys(layout.ROLES, len(plan.baseline_devices)) if baseline \
        else layout.counts(plan.workers)
    workdir = Path(tempfile.mkdtemp(prefix=f"bench-{mode_.name}-", dir=args.workdir))
    t0 = time.perf_counter()
    out: dict[str, Any] = {"mode": mode_.name, "kind": mode_.kind, "workers": counts,
                           "levels": [], "probe": None}
    devices = plan.baseline_devices if baseline else plan.devices
    dit = (plan.dit_parallel, plan.dit_span) if plan.dit_parallel else None
    started: list[LocalGroup] = []
    try:
        with running(mode_.kind, cfg, workdir, plan.workers, devices, args.start_timeout,
                     dit=dit, serial=args.serial_start) as dep:
            started.append(dep.group)
            out["start_s"] = time.perf_counter() - t0
            out["probe"] = _measure(mode_, args, dep, body, levels, plan, counts, out)
    finally:
        for svc in started[0].services if started else []:
            dest = log_dir / f"{mode_.name}-{svc.log_path.name}"
            dest.write_bytes(svc.log_path.read_bytes())
    return out


def _measure(mode_: Mode, args: argparse.Namespace, dep: Deployment, body: dict[str, Any],
             levels: list[tuple[int, int]], plan: Plan, counts: dict[str, int],
             out: dict[str, Any]) -> Any:
    """A started mode's warm-up and levels (rows into ``out``); returns the probe's pixels."""
    kind = TASK_SPECS[args.pipeline].output
    mode, baseline, g = mode_.name, mode_.kind == "baseline", len(plan.devices)
    probe = None
    log(f"{mode}: ready in {out['start_s']:.1f} s; warm-up x{args.warmup}")
    if args.warmup > 0:
        # The first warm-up request has a fixed seed: its output is compared across modes.
        st = post(dep.url, kind, {**body, "prompt": "bench fidelity probe", "seed": 7},
                  args.request_timeout)
        probe = fetch_pixels(dep.url, st["task_id"], kind)
        # The rest: --warmup per replica / per DiT worker, as many at once, so that each
        # one has run a request before the levels (the probe went to replica 0).
        width = len(dep.urls) if baseline else counts["transformer"]
        if args.warmup * width > 1:
            closed_loop(dep.urls[1:] + dep.urls[:1], kind, body, width,
                        args.warmup * width - 1, args.request_timeout, 1000, "warm-up")
    everyone = list(range(len(dep.endpoints)))
    if plan.scale_out and baseline and args.single_qps is None:
        row = run_level(dep, [dep.url], kind, body, 2, args.single_requests, [0], g,
                        args.request_timeout, seed0=500)
        row.update(single=True, label="baseline x1")
        _level_log(mode, row)
        out["levels"].append(row)
    for conc, n in levels:
        dep.group.check_alive()
        row = run_level(dep, dep.urls, kind, body, conc, n, everyone, g,
                        args.request_timeout, seed0=conc * 1000)
        compute = row["stage_seconds"].get("stage/transformer/compute")
        if compute:
            row["dit_s_per_step"] = compute / (n * args.steps)
        _level_log(mode, row)
        out["levels"].append(row)
    return probe


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--pipeline", choices=sorted(TINY_SIZE), help="default: the --arch's")
    add_model_args(ap)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (with --gpus: the "
                    "first of G)")
    ap.add_argument("--gpus", type=int, help="scale out over G devices: cuda:N..cuda:N+G-1 "
                    "from --device cuda:N, or G x cpu from --device cpu")
    ap.add_argument("--devices", help="scale out over these devices, e.g. cuda:0,cuda:1 or "
                    "cpu,cpu (instead of --gpus)")
    ap.add_argument("--placement", help="scale-out: the disaggregated workers per device "
                    "index, e.g. '0:e+d,1-7:t' (default: 0:e+t+d, one t on each other device; "
                    "see scripts/bench/bench_serving_layout.py)")
    ap.add_argument("--single-qps", type=float, help="scale-out: the one-replica baseline QPS "
                    "to compute the efficiency against, instead of measuring it")
    ap.add_argument("--single-requests", type=int, default=4,
                    help="scale-out: requests of the one-replica baseline level (at N = 2)")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, else float32")
    ap.add_argument("--modes", default="baseline,disagg",
                    help="in order; baseline or disagg, each optionally @TAG (several modes "
                         "of a kind, each with its own --set), e.g. disagg,disagg@24g")
    ap.add_argument("--ratios", help="ratio rows A/B,... (mode names; default: each disagg "
                    "mode over the first baseline)")
    ap.add_argument("--serial-start", action="store_true",
                    help="start a group's workers one after another (each once the last "
                         "loaded): less host memory while large folders load")
    ap.add_argument("--dry-run", action="store_true",
                    help="print each mode's service config (checked as a service would) "
                         "and stop: nothing is built or started")
    ap.add_argument("--concurrency", help="N per level (default 1,2,4,8; scale-out: G,2G,4G)")
    ap.add_argument("--requests", default="auto",
                    help="requests per level: a list matching --concurrency, or 'auto' "
                         "(2N, at least 2)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="warm-up requests per mode and per replica / DiT worker")
    ap.add_argument("--encoders", type=int, default=1)
    ap.add_argument("--transformers", type=int, default=1,
                    help="DiT workers (scale-out: per device)")
    ap.add_argument("--decoders", type=int, default=1)
    ap.add_argument("--dit-parallel", metavar="LAYOUT",
                    help="each DiT worker a transformer group, e.g. cfg=2, ulysses=2, "
                         "cfg=2,ulysses=2 (docs/parallel.md); the baseline: one device")
    ap.add_argument("--height", type=int)
    ap.add_argument("--width", type=int)
    ap.add_argument("--frames", type=int)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--images", type=int, default=2, help="input pictures per request of an "
                    "image-conditioned pipeline, each of the output's size (default 2: a "
                    "multi-image edit; 1 for the one-image pipelines)")
    ap.add_argument("--set", action="append", default=[], metavar="[SELECTOR:]KEY=JSON",
                    help="service config field for every service of the modes SELECTOR names "
                         "(a mode, a kind or a tag; none: all), KEY dotted for a section's, "
                         "e.g. --set cfg_batch=true --set 24g:encoder.max_vram_gb=24 "
                         "--set 'baseline:transformer.offload=\"block\"'")
    ap.add_argument("--body", action="append", default=[], metavar="[SELECTOR:]KEY=JSON",
                    help="a request field of the modes SELECTOR names (all without one), e.g. "
                         "'lora:loras=[{\"name\": \"distill\"}]' (the --set syntax)")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "bench_serving")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--request-timeout", type=float, default=1800)
    ap.add_argument("--keep-logs", action="store_true", help="OUT/bench_serving_logs.tar.gz")
    return ap.parse_args(argv)


def mode_label(mode: Mode, plan: Plan) -> str:
    g = len(plan.devices)
    if mode.kind == "baseline":
        label = f"baseline x{g}" if plan.scale_out else "baseline"
    else:
        counts = layout.counts(plan.workers)
        label = "disagg " + "/".join(str(counts[r]) for r in layout.ROLES)
        if plan.dit_parallel:
            label += f" DiT {plan.dit_parallel}"
    return label if mode.tag is None else f"{label} @{mode.tag}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = make_plan(args)
    modes = modes_.parse_modes(args.modes)
    settings = [modes_.parse_set(item) for item in args.set]
    modes_.check_selectors(settings, modes)
    fields = [modes_.parse_set(item) for item in args.body]
    modes_.check_selectors(fields, modes)
    ratios = modes_.parse_ratios(args.ratios, modes)
    g = len(plan.devices)
    if args.arch:
        args.pipeline = args.pipeline or arch_pipeline(args.arch)
    args.pipeline = args.pipeline or "qwen_t2i"
    if args.pipeline not in TINY_SIZE:
        raise SystemExit(f"pipeline {args.pipeline} has no default size here (serve one of "
                         f"{', '.join(sorted(TINY_SIZE))})")
    device = plan.devices[0]
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    default_conc = f"{g},{2 * g},{4 * g}" if plan.scale_out else "1,2,4,8"
    conc = [int(c) for c in (args.concurrency or default_conc).split(",")]
    if args.requests == "auto":
        reqs = [max(2, 2 * c) for c in conc]
    else:
        reqs = [int(r) for r in args.requests.split(",")]
        if len(reqs) != len(conc):
            raise SystemExit("--requests needs one count per --concurrency level")
    levels = list(zip(conc, reqs, strict=True))
    base = {"device": device, "dtype": dtype}
    overrides = {m.name: modes_.settings_for(m.name, m.matches, settings, base) for m in modes}
    extra = {m.name: modes_.settings_for(m.name, m.matches, fields) for m in modes}
    if args.dry_run:
        return modes_.dry_run(args, modes, overrides, ratios, extra)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    model, built = model_folder(args, device, dtype, log)
    body, (height, width, frames) = request_body(args)

    results = []
    log_dir = Path(tempfile.mkdtemp(prefix="bench-logs-"))
    failed: dict[str, str] = {}
    for mode in modes:
        workdir = Path(tempfile.mkdtemp(prefix=f"bench-{mode.name}-cfg-", dir=args.workdir))
        cfg = group_config(args.pipeline, str(model), workdir, **overrides[mode.name])
        try:
            res = run_mode(mode, args, cfg, {**body, **extra[mode.name]}, levels, log_dir,
                           plan)
        except (RuntimeError, TimeoutError, OSError, httpx.HTTPError) as exc:
            # One mode's failure (out of memory under its cap, a service that exits) must not
            # lose the other modes' rows: it is reported, and the run exits with status 1.
            failed[mode.name] = f"{type(exc).__name__}: {exc}"[-3000:]
            log(f"{mode.name} failed: {failed[mode.name]}")
            res = {"mode": mode.name, "kind": mode.kind, "levels": [], "probe": None,
                   "error": failed[mode.name]}
        res["label"] = mode_label(mode, plan)
        results.append(res)
        # What is done so far, should a later mode outlast the machine's time.
        (args.out / "bench_serving.partial.json").write_text(json.dumps(
            [{k: v for k, v in r.items() if k != "probe"} for r in results], default=str))

    probes = {r["mode"]: r.pop("probe") for r in results}
    kinds = {r["kind"]: r["mode"] for r in reversed(results)}  # the first of each kind
    fidelity = None
    if probes.get(kinds.get("baseline")) is not None and \
            probes.get(kinds.get("disagg")) is not None:
        fidelity = compare_probes(probes[kinds["baseline"]], probes[kinds["disagg"]])
    first = results[0]["mode"]
    fidelity_by_mode = {name: compare_probes(probes[first], probe)
                        for name, probe in probes.items()
                        if name != first and probe is not None and probes[first] is not None}
    scaling = efficiency(results, g, args.single_qps) if plan.scale_out else None
    if plan.scale_out and scaling is None:
        log("no one-replica baseline (mode baseline not run, no --single-qps): no efficiency")
    title = (f"{args.arch or args.pipeline} {height}x{width}"
             + (f"x{frames}" if TASK_SPECS[args.pipeline].output == "video" else "")
             + f", {args.steps} steps, {device} {dtype}")
    if args.arch and args.text_encoders == "full":
        title += ", full-size text encoders"
    if plan.scale_out:
        title += (f"; {g} devices ({', '.join(f'd{i}={d}' for i, d in enumerate(plan.devices))})"
                  f"; disagg: {layout.describe(plan.workers)}")
    md = f"{title}\n\n{table(results, plan.devices if plan.scale_out else None, ratios)}\n"
    if scaling is not None:
        md += (f"\neff = QPS / ({g} x {scaling['single_replica_qps']:.3f}), one-replica "
               f"baseline QPS {scaling['source']}\n")
    if plan.dit_parallel:
        title += (f"; DiT group {plan.dit_parallel} over {plan.dit_span} devices "
                  f"({layout.describe(plan.workers)}), baseline on {plan.devices[0]}")
        md = f"{title}\n\n{table(results, None, ratios)}\n\n{group_lines(results)}"
    for name, error in failed.items():
        md += f"\n- {name} failed: {error.splitlines()[0] if error else ''}\n"
    report = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "title": title, "pipeline": args.pipeline, "model": str(model), "built": built,
        "request": body, "config_overrides": overrides, "levels": levels,
        "devices": plan.devices, "placement": plan.workers, "scaling": scaling,
        "environment": environment(plan.devices), "results": results,
        "fidelity_probe": fidelity, "fidelity_by_mode": fidelity_by_mode, "failed": failed,
    }
    (args.out / "bench_serving.json").write_text(json.dumps(report, indent=1, default=str))
    (args.out / "bench_serving.md").write_text(md)
    try:
        plot(results, args.out / "bench_serving.png", title,
             scaling["reference_qps"] if scaling else None)
    except ImportError as exc:
        log(f"no plot: {exc} (pip install matplotlib)")
    if args.keep_logs:
        with tarfile.open(args.out / "bench_serving_logs.tar.gz", "w:gz") as tar:
            tar.add(log_dir, arcname="logs")
    print(md)
    if fidelity is not None:
        print(f"fidelity probe (seed 7, baseline vs disagg): {fidelity}")
    for name, cmp in fidelity_by_mode.items():
        print(f"fidelity probe (seed 7, {name} vs {first}): {cmp}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
