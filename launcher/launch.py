"""Run one group on this machine from its role files, in the foreground, until a signal.

    python -m launcher wan_t2v --model-path DIR [--config-dir DIR]     (or diffring group)
        [--encoder-device N|cuda:N|cpu] [--transformer-device ...] [--decoder-device ...]
        [--port-offset N] [--log-dir DIR] [--output-dir DIR] [--mooncake-config FILE]
        [--ready-timeout S] [--metrics-timeout S] [--metrics-required] [--stop-timeout S]
        [--lightx2v-ports] [--split]

What the start scripts (``scripts/server/disagg/``) run; their environment variables map onto
these options (``scripts/server/disagg/common.sh`` lists them). It loads and checks the four
role files (:mod:`launcher.role_files`), refuses ports already in use, starts the
controller and waits for its ``/health``, starts one encoder, one transformer and one decoder
(each ``--model_path`` and ``--device``), waits until each has registered with the controller
and each metrics port answers, prints the URLs and stays in the foreground. SIGINT, SIGTERM
or SIGHUP stops the group (:meth:`LocalGroup.stop`: workers first, so they drain, then the
controller; SIGKILL after ``--stop-timeout``); a second signal kills it at once. If a
service dies, its log tail is printed and the rest of the group is stopped. Exit status: 1
when the group could not start or a service died, else 128 + the signal's number.

Every service runs in a session of its own (a Ctrl+C in the terminal reaches only this
launcher) and gets SIGTERM should the launcher be killed. Logs, a ``pids`` file (``ROLE PID``
per line) and, when ``DIFFRING_CLUSTER_TOKEN`` is unset, the fresh token shared by the group
(``cluster_token``, mode 600, for workers started by hand) go to ``--log-dir``.

``--split`` (Wan2.2-A14B): the split placement, one expert per DiT worker. The group's
transformer files are ``<pipeline>_transformer_high.json`` and
``<pipeline>_transformer_low.json`` (``transformer.experts`` ``high`` / ``low``) in place
of ``<pipeline>_transformer.json``; one high-noise and one low-noise DiT worker start,
each on its device (``--transformer-device HIGH,LOW``, e.g. ``cuda:1,cuda:2``; one device:
both there), each with its own metrics port and log (``transformer_high.log``,
``transformer_low.log``).
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from contracts import task_store
from contracts.pipelines import TASK_SPECS
from contracts.roles import Role
from launcher import current
from launcher.local import ROOT, LocalGroup, Service
from launcher.ports import port_busy
from launcher.role_files import SPLIT_HALVES, GroupError, Prepared, prepare, probe_host, role_of

WORKERS = tuple(role.value for role in Role)
SIGNALS = {signal.SIGINT: ("INT", 130), signal.SIGTERM: ("TERM", 143),
           signal.SIGHUP: ("HUP", 129)}  # HUP: the terminal closed, the services would not know


class LaunchError(Exception):
    """The group cannot be started as asked; the message says what to change."""


class _Gone(Exception):
    def __init__(self, services: list[Service]) -> None:
        self.services = services


class _Interrupted(Exception):
    pass


class Launch:
    """One run of a group: start, wait, watch, stop."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.name: str = args.group
        self.recorded = False
        self.group: LocalGroup | None = None
        self.ready = False
        self.stopping = False
        self.signal: tuple[str, int] | None = None
        self.wake = threading.Event()
        self.pids_file: Path | None = None

    def say(self, msg: str) -> None:
        try:
            print(f"[{self.name}] {msg}", file=sys.stderr, flush=True)
        except OSError:  # nobody reads our output any more: the group must still be stopped
            pass

    # -- signals: a handler only records the signal and wakes the waits ---------------------
    def on_signal(self, signum: int, _frame: FrameType | None) -> None:
        name, code = SIGNALS[signal.Signals(signum)]
        if self.stopping:
            self.say(f"second {name}: killing the group now")
            if self.group is not None:
                self.group.kill()
            os._exit(code)
        if self.signal is None:
            self.signal = (name, code)
        self.wake.set()

    def _check(self) -> None:
        if self.signal is not None:
            raise _Interrupted()
        assert self.group is not None
        gone = [s for s in self.group.services if s.status() is not None]
        if gone:
            raise _Gone(gone)

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> int:
        a = self.args
        model = Path(a.model_path).resolve()
        if not model.is_dir():
            raise LaunchError(f"model_path {model} is not a folder")
        log_dir = Path(a.log_dir or ROOT / "out" / "logs" / self.name).resolve()
        log_dir.mkdir(parents=True, exist_ok=True)
        devices = resolve_devices(a, self.say)
        config_dir = Path(a.config_dir or ROOT / "configs" / "disagg" /
                          TASK_SPECS[self.name].family)
        output_dir = str(Path(a.output_dir).resolve()) if a.output_dir else None
        try:
            prep = prepare(self.name, config_dir.resolve(), log_dir, a.port_offset, output_dir,
                           lightx2v_ports=a.lightx2v_ports, split=a.split)
        except GroupError as exc:
            raise LaunchError(str(exc)) from None
        results = (ROOT / prep.loaded["controller"].output_dir).resolve()
        if task_store.in_use(results):
            raise LaunchError(
                f"another controller uses the task store in {task_store.store_folder(results)} "
                f"(results folder {results}): a group of {self.name} runs already. Stop it, "
                "or give this one a results folder of its own with OUTPUT_DIR=DIR (and its "
                "own ports with PORT_OFFSET=N)")
        busy = [(w, h, p) for w, h, p in prep.ports() if port_busy(h, p)]
        if busy:
            for what, host, port in busy:
                self.say(f"error: port {port} ({what}, {host}) is in use")
            raise LaunchError("another group (or a previous run's services) holds these ports; "
                              "stop it, or shift every port of this group with PORT_OFFSET=N")
        mooncake = Path(a.mooncake_config or ROOT / "configs" / "mooncake_config.json").resolve()
        if not mooncake.is_file():
            raise LaunchError(f"MOONCAKE_CONFIG_PATH={mooncake}: no such file")
        env = {"MOONCAKE_CONFIG_PATH": str(mooncake)}
        token = os.environ.get("DIFFRING_CLUSTER_TOKEN")
        if not token:
            env["DIFFRING_CLUSTER_TOKEN"] = token = secrets.token_hex(16)
            fd = os.open(log_dir / "cluster_token", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                os.fchmod(fd, 0o600)  # an older file keeps its mode through O_CREAT
                f.write(token + "\n")
        if os.environ.get("DIFFRING_API_KEY"):  # the readiness checks read a guarded route
            env["DIFFRING_API_KEY"] = os.environ["DIFFRING_API_KEY"]
        ctl = prep.loaded["controller"].server
        self.group = LocalGroup(
            # Only the front door's address and key are read from this config: every service
            # starts from its own role file.
            {"server": {"host": probe_host(ctl.host), "port": ctl.port, "api_key": ctl.api_key}},
            log_dir, env=env, files=prep.configs, log_dir=log_dir, detached=True,
            args={k: ["--model_path", str(model), "--device", devices[k]] for k in devices})
        self.pids_file = log_dir / "pids"
        self.pids_file.write_text("")
        for signum in SIGNALS:
            signal.signal(signum, self.on_signal)
        self.say(f"model {model}; devices: " + ", ".join(
            f"{k.replace('_', ' ')} {d}" for k, d in devices.items()))
        if a.port_offset:
            self.say(f"PORT_OFFSET={a.port_offset}: configs in {log_dir / 'config'}")
        try:
            return self._serve(prep, log_dir)
        finally:
            if not self.stopping:
                self.stop()

    def _serve(self, prep: Prepared, log_dir: Path) -> int:
        assert self.group is not None
        metrics = metric_urls(prep)
        workers = [k for k in prep.configs if k != "controller"]
        try:
            self._start("controller")
            self._wait_ready({}, {}, 0.0)
            for key in workers:
                self._start(key)
            counts: dict[str, int] = {}
            for key in workers:
                counts[role_of(key)] = counts.get(role_of(key), 0) + 1
            self._wait_ready(counts, metrics, self.args.metrics_timeout)
        except _Interrupted:
            return self._stopped_by_signal()
        except _Gone as gone:
            for svc in gone.services:
                self._log_tail(svc, 40)
            return self._startup_failed()
        except LaunchError as exc:
            self.say(f"error: {exc}")
            for svc in self.group.services:
                self.say(f"last lines of {svc.log_path}:")
                self._print_tail(svc, 10)
            return self._startup_failed()
        self.ready = True
        self._banner(prep, metrics, log_dir)
        current.record(current.RunningGroup(self.name, self.group.url, os.getpid(),
                                            str(log_dir)))
        self.recorded = True
        while True:  # in the foreground until a signal or a service's death
            try:
                self._check()
            except _Interrupted:
                return self._stopped_by_signal()
            except _Gone as gone:
                svc = gone.services[0]
                self._log_tail(svc, 40)
                self.say(f"{svc.label} is gone; stopping the group")
                self.stop()
                return 1
            self.wake.wait(1.0)

    def _start(self, key: str) -> None:
        """Start the service of role file ``key`` (a role, or a half of a split group's
        transformer: ``transformer_high``)."""
        assert self.group is not None and self.pids_file is not None
        # Signals are not blocked here: a child inherits the signal mask through exec, and
        # would never see the SIGTERM that asks it to drain. The handler only records a
        # first signal, so the pid is written down before anything acts on it.
        svc = self.group.start(role_of(key), name=key)
        with self.pids_file.open("a") as f:
            f.write(f"{key} {svc.proc.pid}\n")
        self.say(f"started {key.replace('_', ' ')} (pid {svc.proc.pid}), log {svc.log_path}")

    def _wait_ready(self, roles: dict[str, int], metrics: dict[str, str],
                    metrics_timeout: float) -> None:
        """Until the controller answers ``/health``, ``roles`` (role -> how many) are
        registered and each
        metrics URL answers (given ``metrics_timeout`` more once the services are up; a
        silent one is only a warning unless ``--metrics-required``)."""
        import httpx

        assert self.group is not None
        done: set[str] = set()
        start = time.monotonic()
        deadline = start + self.args.ready_timeout
        metrics_deadline: float | None = None

        def mark(key: str, msg: str) -> None:
            if key not in done:
                done.add(key)
                self.say(f"  ready ({time.monotonic() - start:5.1f} s): {msg}")

        def answers(url: str) -> bool:
            try:
                return httpx.get(url, timeout=2.0, trust_env=False).status_code == 200
            except httpx.HTTPError:
                return False

        while True:
            self._check()
            if "health" not in done and self.group.healthy():
                mark("health", f"controller {self.group.url}/health")
            if "health" in done and roles:
                have = self.group.registered() or {}
                for role, n in roles.items():
                    if have.get(role, 0) >= n:
                        mark(role, f"{role} registered with the controller" if n == 1 else
                             f"{n} {role}s registered with the controller")
            for role, url in metrics.items():
                if f"metrics:{role}" not in done and answers(url):
                    mark(f"metrics:{role}", f"{role} metrics {url}")
            missing = [k for k in ["health", *roles] if k not in done]
            silent = [r for r in metrics if f"metrics:{r}" not in done]
            if not missing and not silent:
                return
            now = time.monotonic()
            if not missing:
                metrics_deadline = metrics_deadline or now + metrics_timeout
                if now >= metrics_deadline:
                    urls = ", ".join(metrics[r] for r in silent)
                    if self.args.metrics_required:
                        raise LaunchError(f"metrics endpoint(s) not answering: {urls}")
                    self.say(f"warning: metrics endpoint(s) not answering (yet): {urls}")
                    return
            if now >= deadline:
                what = ["controller /health" if k == "health" else f"{k} registration"
                        for k in missing] + [f"{r} metrics" for r in silent]
                raise LaunchError(f"not ready after {self.args.ready_timeout:g} s: still "
                                  f"waiting for {', '.join(what)}")
            self.wake.wait(0.25)

    # -- stopping ----------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop everything started here, workers first. Before the group is ready no worker
        holds a task, so an aborted start-up does not wait the whole stop timeout."""
        self.stopping = True
        if self.recorded:
            current.forget(os.getpid())
            self.recorded = False
        if self.group is None:
            return
        grace = self.args.stop_timeout if self.ready else min(5.0, self.args.stop_timeout)
        self.group.stop(grace, say=self.say)

    def _stopped_by_signal(self) -> int:
        assert self.signal is not None
        self.say(f"{self.signal[0]} received")
        self.stop()
        return self.signal[1]

    def _startup_failed(self) -> int:
        self.say("start-up failed; stopping the rest of the group")
        self.stop()
        return 1

    def _log_tail(self, svc: Service, lines: int) -> None:
        self.say(f"{svc.label} (pid {svc.proc.pid}) exited with status {svc.status()}; "
                 f"last lines of {svc.log_path}:")
        self._print_tail(svc, lines)

    def _print_tail(self, svc: Service, lines: int) -> None:
        try:
            tail = svc.log().splitlines()[-lines:]
            print("\n".join(tail), file=sys.stderr, flush=True)
        except OSError:
            pass

    def _banner(self, prep: Prepared, metrics: dict[str, str], log_dir: Path) -> None:
        assert self.group is not None
        url = self.group.url
        kind = TASK_SPECS[self.name].output
        results = (ROOT / prep.loaded["controller"].output_dir).resolve()
        # The command as this shell can run it: bare when it is on the PATH.
        cli = "diffring" if shutil.which("diffring") else str(
            Path(sys.executable).with_name("diffring"))
        rows = "\n".join(f"  {'metrics' if i == 0 else '':<11} {key.replace('_', ' '):<11} "
                         f"{metrics.get(key, 'off')}"
                         for i, key in enumerate(prep.configs))
        stage_ports = prep.loaded["controller"].server.lightx2v_ports
        lightx2v = "" if not stage_ports else "\n  LightX2V    " + ", ".join(
            f"{r} {p}" for r, p in stage_ports.items()) + "   (its three-POST request scripts)"
        self.say(f"""group ready
  front door  {url}   (POST /v1/tasks/{kind}/, GET /v1/tasks/{{id}}/status){lightx2v}
  API docs    {url}/docs
{rows}
  results     {results}
  logs        {log_dir}   (pids: {self.pids_file})
  try         {cli} submit --small --prompt '...'   (finds this group)
              {cli} list | status TASK | cancel TASK
Ctrl+C stops the group.""")


def metric_urls(prep: Prepared) -> dict[str, str]:
    """Role file -> its ``/metrics`` URL (those without a metrics port left out)."""
    out = {}
    for key, cfg in prep.loaded.items():
        if cfg.server.metric_port is not None:
            out[key] = f"http://{probe_host(cfg.server.host)}:{cfg.server.metric_port}/metrics"
    return out


def visible_gpus() -> int:
    """The GPUs the torch the services will use sees: a CPU-only build sees none even where
    nvidia-smi lists some, and then cuda:N would fail in every worker."""
    probe = subprocess.run([sys.executable, "-c",
                            "import torch; print(torch.cuda.device_count())"],
                           capture_output=True, text=True)
    out = probe.stdout.strip()
    return int(out) if probe.returncode == 0 and out.isdigit() else 0


def resolve_devices(args: argparse.Namespace, say: Callable[[str], None] | None = None,
                    gpu_count: Callable[[], int] = visible_gpus) -> dict[str, str]:
    """Each worker's device from its option: N -> cuda:N, cuda:N, cpu; unset: encoder and
    decoder on GPU 0, the transformer on GPU 1 when two or more are visible (else 0), cpu
    when none is. A GPU asked for where torch sees none is the CPU, with a one-line notice
    (so the README's command, which names GPUs, runs as written on a CPU machine); a GPU
    past the ones it sees is an error. A split group (``args.split``) has
    ``transformer_high`` and ``transformer_low`` in place of ``transformer``:
    ``--transformer-device HIGH,LOW``, one device for both, or unset: GPUs 1 and 2 (the
    last one torch sees where it sees fewer)."""
    split = bool(getattr(args, "split", False))
    given: dict[str, str | None] = {r: getattr(args, f"{r}_device") for r in WORKERS}
    halves = (given["transformer"] or "").split(",")
    if len(halves) > 2 or (len(halves) == 2 and not split):
        raise LaunchError(f"--transformer-device {given['transformer']} (TRANSFORMER_GPU): "
                          "two devices, HIGH,LOW, are for a split group's two DiT workers "
                          "(--split, EXPERTS=split)")
    if split:
        del given["transformer"]
        given["transformer_high"] = halves[0] or None
        given["transformer_low"] = halves[-1] or None
        given = {k: given[k] for k in ("encoder", *SPLIT_HALVES, "decoder")}
    gpus = 0
    if any(v != "cpu" for v in given.values()):
        gpus = gpu_count()
    default = {"encoder": 0, "transformer": 1, "transformer_high": 1, "transformer_low": 2,
               "decoder": 0}
    devices = {}
    for key, value in given.items():
        role = role_of(key)
        if not value:
            devices[key] = "cpu" if gpus == 0 else f"cuda:{min(default[key], gpus - 1)}"
        elif value == "cpu":
            devices[key] = value
        elif re.fullmatch(r"(cuda:)?\d+", value):
            index = int(value.removeprefix("cuda:"))
            if gpus == 0:
                devices[key] = "cpu"
            elif index >= gpus:
                raise LaunchError(f"--{role}-device {value} ({role.upper()}_GPU): torch sees "
                                  f"{gpus} GPU(s) here, cuda:0 to cuda:{gpus - 1}")
            else:
                devices[key] = f"cuda:{index}"
        else:
            raise LaunchError(f"--{role}-device {value} ({role.upper()}_GPU): give N, cuda:N "
                              "or cpu")
    moved = list(dict.fromkeys(f"{role_of(k).upper()}_GPU={v}" for k, v in given.items()
                               if v and v != "cpu" and devices[k] == "cpu"))
    if moved and say is not None:
        say(f"notice: torch sees no GPU here; {' '.join(moved)} run on the CPU instead")
    return devices


def parse_args(argv: list[str] | None, prog: str | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("pipeline", nargs="?", choices=sorted(TASK_SPECS),
                    help="the pipeline (or --group); its role files are "
                    "<config-dir>/<pipeline>_<role>.json")
    ap.add_argument("--group", choices=sorted(TASK_SPECS), help="the pipeline, as a flag")
    ap.add_argument("--model-path", required=True,
                    help="model folder (diffusers or original Wan2.1 layout)")
    ap.add_argument("--config-dir", help="folder of the four role files "
                    "(default configs/disagg/<family>)")
    for role in WORKERS:
        ap.add_argument(f"--{role}-device", help="N (cuda:N), cuda:N or cpu")
    ap.add_argument("--port-offset", type=int, default=0, help="added to every port")
    ap.add_argument("--log-dir", help="logs, pids, effective configs (default out/logs/GROUP)")
    ap.add_argument("--output-dir", help="results folder (default: the role files')")
    ap.add_argument("--mooncake-config", help="default configs/mooncake_config.json")
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--metrics-timeout", type=float, default=15.0,
                    help="extra seconds for /metrics once the services are up")
    ap.add_argument("--metrics-required", action="store_true",
                    help="a silent metrics endpoint fails the start-up")
    ap.add_argument("--lightx2v-ports", action="store_true",
                    help="open LightX2V's per-stage API ports (its request scripts' table, "
                    "e.g. 8002/8003/8006 for wan_t2v; the front door moves to the encoder's) "
                    "so that its three-POST request scripts work unchanged")
    ap.add_argument("--stop-timeout", type=float, default=30.0,
                    help="seconds each shutdown phase may take before SIGKILL")
    ap.add_argument("--split", action="store_true",
                    help="Wan2.2-A14B's split placement: one high-noise and one low-noise DiT "
                    "worker, from <pipeline>_transformer_high.json and "
                    "<pipeline>_transformer_low.json; --transformer-device HIGH,LOW")
    args = ap.parse_args(argv)
    if args.group and args.pipeline and args.group != args.pipeline:
        ap.error(f"two pipelines named: {args.pipeline} and --group {args.group}")
    args.group = args.group or args.pipeline
    if args.group is None:
        ap.error(f"name the pipeline: one of {', '.join(sorted(TASK_SPECS))}")
    return args


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """``python -m launcher`` (``prog``: the name its help shows, e.g. ``diffring group``)."""
    args = parse_args(argv, prog)
    launch = Launch(args)
    try:
        return launch.run()
    except LaunchError as exc:
        launch.say(f"error: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
