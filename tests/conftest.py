"""Shared fixtures: processes started by a test are stopped by it, by pid."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TOKEN = "test-cluster-token"

from contracts.pipelines import TASKS, task_spec  # noqa: E402
from contracts.request import GenerationRequest  # noqa: E402
from launcher import (  # noqa: E402
    PORT_RANGE_ENV,
    free_ports,
    parse_port_range,
    port_busy,
    role_files,
)
from rings.soak import stop_process as stop  # noqa: E402

if TYPE_CHECKING:
    import numpy as np
    import torch

    from controller.ownership.coordinator import Coordinator
    from controller.ownership.registry import WorkerInfo

TEST_PORTS = "20000-31999"
"""The ports the suite's groups take (``DIFFRING_PORT_RANGE``, unless the caller set its own):
below the kernel's usual ephemeral range (32768-60999, where bind-to-0 and outgoing
connections take theirs) and above Mooncake's (15000-16999), split between the pytest-xdist
workers. A loaded CI run once had a controller answer another worker's health check: both
had been given the same port."""


def ephemeral_start() -> int | None:
    """The first port of the kernel's ephemeral range (None: not Linux)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except OSError:
        return None


def pytest_configure(config: pytest.Config) -> None:
    workerinput = getattr(config, "workerinput", None)  # set in a pytest-xdist worker
    if workerinput is None and getattr(config.option, "numprocesses", None):
        return  # xdist's controller: its workers (which inherit its environment) split it
    spec = os.environ.get(PORT_RANGE_ENV)
    if spec is None:
        eph = ephemeral_start()
        if eph is None:
            return  # not Linux: the kernel's choice
        if eph <= parse_port_range(TEST_PORTS)[1]:
            return  # this host's kernel hands out these ports itself: leave it the choice
        spec = TEST_PORTS
    lo, hi = parse_port_range(spec)
    index, count = ((0, 1) if workerinput is None
                    else (int(workerinput["workerid"].removeprefix("gw")),
                          int(workerinput["workercount"])))
    width = (hi - lo + 1) // count
    if width < 64:
        raise pytest.UsageError(f"{PORT_RANGE_ENV}={spec}: under 64 ports per worker")
    lo += index * width
    os.environ[PORT_RANGE_ENV] = f"{lo}-{lo + width - 1}"


coordinators: list[Coordinator] = []
"""Coordinators made in-process by a test: each has a task-store writer thread, closed after
the test by :func:`_close_coordinators` (closing twice is harmless)."""


@pytest.fixture(autouse=True)
def _close_coordinators() -> Iterator[None]:
    yield
    while coordinators:
        coordinators.pop().close()


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request: pytest.FixtureRequest,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast half (``pytest -m "not integration"``) stays in-process: a test whose module
    is not marked ``integration`` fails as soon as it starts a process."""
    import multiprocessing.process

    if request.node.get_closest_marker("integration") is not None:
        return

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError(f"{request.node.nodeid} starts a process: give its module "
                             "`pytestmark = pytest.mark.integration`")

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)


LONG_MODULES = (
    "test_e2e.py", "test_lora.py", "test_e2e_edit_plus.py", "test_group_checkpoints.py",
    "test_group_layouts.py", "test_bench_serving.py", "test_models.py", "test_group_faults.py",
    "test_e2e_recovery.py", "test_resume_e2e.py", "test_result_writes.py",
    "test_stage_memory.py", "test_live_openai_media.py",
    "test_model_variants.py", "test_stage_options.py", "test_startup_signals.py",
)
"""Modules that take about a minute or more on a loaded 2-core machine, longest first. They
run first: scripts/test.sh hands whole modules to two pytest processes in collection order,
and a long module handed out last would run alone at the end. (A module missing here only
makes a run's tail longer.)"""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep theirs


class Clock:
    """A monotonic clock a test drives instead of sleeping: ``clock()`` reads it,
    ``clock.advance(s)`` moves it on (leases and liveness then expire on the test's word)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def make_coordinator(output_dir: Path | None, ring: Any, *, pipeline: str = "qwen_t2i",
                     census: Any = None, clock: Any = None, **config: Any) -> Coordinator:
    """An in-process coordinator over ``ring`` with its task store in
    ``<output_dir>/.journal`` (none without ``output_dir``), closed after the test."""
    from controller.config import CoordinatorConfig
    from controller.ownership.coordinator import Coordinator
    from controller.tasks.table import open_table

    co = Coordinator(
        CoordinatorConfig(pipeline=pipeline, output_dir=output_dir or Path("/nonexistent"),
                          **config),
        open_table(output_dir / ".journal" if output_dir else None),
        ring,
        census=census,
        clock=clock or time.monotonic,
    )
    coordinators.append(co)
    return co


def complete(co: Coordinator, w: WorkerInfo, tid: str, attempt: int, data: bytes) -> bool:
    """A decoder's completion of a PNG (a coroutine: the result file is written off the loop)."""
    return asyncio.run(co.on_complete(w, tid, attempt, "png", "image/png", data))


def run_controller_to_exit(
    tmp: Path, cfg: dict[str, Any], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run a controller that is expected to refuse to start; its exit status and output."""
    path = tmp / f"refused-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(cfg))
    return subprocess.run(
        [sys.executable, "run_service.py", "--service", "controller", "--config", str(path)],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        timeout=timeout,
    )


def wait_port(port: int, proc: subprocess.Popen[Any] | None = None, timeout: float = 120
              ) -> None:
    """Until something listens on ``port`` (a generous bound: a process starting on a loaded
    2-core machine may take tens of seconds); raise if ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


@dataclass
class Controller:
    proc: subprocess.Popen[str]
    config_path: Path
    config: dict[str, Any]
    ports: dict[str, int]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def controller_config(
    tmp: Path, slots: int = 8, slot_size: int = 4096, **disagg: Any
) -> dict[str, Any]:
    ctl, req, p1, p2, http = free_ports(5)
    return {
        "disagg_mode": "controller",
        "disagg_config": {
            "control_port": ctl,
            "rdma_request_handshake_port": req,
            "rdma_phase1_handshake_port": p1,
            "rdma_phase2_handshake_port": p2,
            "rdma_buffer_slots": slots,
            "rdma_buffer_slot_size": slot_size,
            "cluster_token": TOKEN,
            **disagg,
        },
        "server": {"host": "127.0.0.1", "port": http},
    }


def start_controller(
    tmp: Path, cfg: dict[str, Any], extra_args: list[str] | None = None
) -> Controller:
    path = tmp / f"controller-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(cfg))
    log_path = path.with_suffix(".log")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "run_service.py"),
            "--service",
            "controller",
            "--config",
            str(path),
        ]
        + (extra_args or []),
        stdout=log_path.open("w"),
        stderr=subprocess.STDOUT,
        text=True,
        cwd=str(ROOT),
        env=env,
    )
    d = cfg["disagg_config"]
    ports = {
        "request": d["rdma_request_handshake_port"],
        "phase1": d["rdma_phase1_handshake_port"],
        "phase2": d["rdma_phase2_handshake_port"],
    }
    try:
        for port in ports.values():
            wait_port(port, proc)
        wait_port(d["control_port"], proc)  # opened after the rings (and the task store)
    except Exception:
        stop(proc)
        raise RuntimeError(f"controller did not start:\n{log_path.read_text()}") from None
    return Controller(proc, path, cfg, ports, log_path)


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[Controller]:
    ctl = start_controller(tmp_path, controller_config(tmp_path, slots=3, slot_size=512))
    try:
        yield ctl
    finally:
        stop(ctl.proc)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random-weight models of every pipeline, built once per run (offline): with
    pytest-xdist, in the run's common temp folder, by whichever worker comes first (the
    others wait on the lock, then find the build up to date: build_all is idempotent)."""
    from modelkit.tiny import build_all

    env = os.environ.get("DIFFRING_TINY_MODELS")
    return built_once(tmp_path_factory, "tiny-models", lambda out: build_all(out, seed=0),
                      Path(env) if env else None)


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str,
               build: Callable[[Path], object], out: Path | None = None) -> Path:
    """``build(folder)`` once per run: with pytest-xdist in the run's common temp folder, by
    whichever worker comes first (the others wait on the lock, then find the build up to
    date: ``build`` must be idempotent)."""
    import fcntl

    if out is None:
        out = (tmp_path_factory.getbasetemp().parent / name
               if os.environ.get("PYTEST_XDIST_WORKER") else tmp_path_factory.mktemp(name))
    out.mkdir(parents=True, exist_ok=True)
    with (out.parent / f"{out.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        build(out)
    return out


@pytest.fixture(scope="session")
def input_png() -> bytes:
    """A deterministic, non-square 40x48 input image (gradients in each channel)."""
    import io

    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:48, 0:40]
    rgb = np.stack([x * 6, y * 5, (x * y) % 251], axis=-1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="session")
def input_png_2() -> bytes:
    """A second input image of another aspect ratio (64x40, landscape), for the multi-image
    edit (Picture 2): its condition sizes differ from the first image's."""
    import io

    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:40, 0:64]
    rgb = np.stack([(x * y) % 253, 250 - x * 3, y * 6], axis=-1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


def wait_log(svc: Any, text: str, timeout: float = 120) -> None:
    """Wait until ``text`` is in the log of ``svc`` (a started service: ``log()`` and
    ``proc``); raise, with the log, if the process exits first or ``timeout`` passes (a
    generous bound: this waits for an event, it does not time one)."""
    deadline = time.monotonic() + timeout
    while text not in svc.log():
        if svc.proc.poll() is not None:
            raise AssertionError(f"exited with {svc.proc.returncode} before logging "
                                 f"{text!r}:\n{svc.log()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {text!r} after {timeout:g} s:\n{svc.log()[-3000:]}")
        time.sleep(0.05)


# -- the start scripts and the launcher, run as an operator runs them -----------------------
MOONCAKE_PORTS = range(12000, 17001)
"""Where a Mooncake engine with P2P handshake binds its RPC and TCP-transport ports (seen:
12001 as the default, 15xxx-16xxx picked at random)."""


def free_offset(group: str, subdir: str) -> int:
    """A PORT_OFFSET under which every port of the group is free. The shifted ports stay
    below Linux's ephemeral range (32768+), so other tests' free_ports() cannot race us, and
    out of the range Mooncake picks its own ports from (MOONCAKE_PORTS), so the engines of
    tests running beside this one cannot take one between this check and the bind."""
    prep = role_files.prepare(group, ROOT / "configs" / "disagg" / subdir,
                                Path("/nonexistent"))
    ports = [(host, port) for _what, host, port in prep.ports()]
    top = 32767 - max(port for _host, port in ports)
    rng = random.Random()
    for _ in range(200):
        offset = rng.randrange(1000, top)
        if any(port + offset in MOONCAKE_PORTS for _host, port in ports):
            continue
        if not any(port_busy(host, port + offset) for host, port in ports):
            return offset
    raise RuntimeError("no free port offset found")


class Launched:
    """A start script run in its own session, its output in a file."""

    def __init__(self, script: Path, env: dict[str, str], log_dir: Path) -> None:
        self.log_dir = log_dir
        self.out_path = log_dir.parent / "launcher.out"
        with self.out_path.open("wb") as out:
            self.proc = subprocess.Popen(
                ["bash", str(script)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=str(ROOT),
                env=env,
                start_new_session=True,  # our SIGINT reaches the script alone
            )

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def pids(self) -> dict[str, int]:
        path = self.log_dir / "pids"
        if not path.exists():
            return {}
        return {
            role: int(pid)
            for role, pid in (ln.split() for ln in path.read_text().split("\n") if ln.strip())
        }

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output():
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"launcher exited with {self.proc.returncode}:\n{self.output()}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} after {timeout} s:\n{self.output()}")
            time.sleep(0.2)

    def cleanup(self) -> None:
        """Whatever happened: stop the script, then any service it left, by pid."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in self.pids().values():
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead too
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def launcher_env(tmp_path: Path, model: Path, offset: int) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.endswith("_GPU") and not k.startswith("GPU_") and k != "model_path"
    }
    env.update(
        model_path=str(model),
        ENCODER_GPU="cpu",
        TRANSFORMER_GPU="cpu",
        DECODER_GPU="cpu",
        PORT_OFFSET=str(offset),
        LOG_DIR=str(tmp_path / "logs"),
        OUTPUT_DIR=str(tmp_path / "results"),
        PYTHON=sys.executable,
        READY_TIMEOUT="120",
        METRICS_TIMEOUT="5",
        STOP_TIMEOUT="20",
    )
    return env

# -- LightX2V's shapes: its published disaggregation stage configs (configs/disagg/{wan,qwen}/
# of its repository), key for key, and its request scripts' payloads ----------------------
def lightx2v_stage_configs() -> dict[str, dict[str, Any]]:
    """``<prefix>_disagg_<role>.json`` name -> the object LightX2V publishes there."""
    def disagg(room: int, sender: int, receiver: int, phase2: tuple[int, int] | None = None,
               device_name: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {"bootstrap_addr": "127.0.0.1", "bootstrap_room": room,
                             "sender_engine_rank": sender, "receiver_engine_rank": receiver,
                             "protocol": "rdma", "local_hostname": "localhost",
                             "metadata_server": "P2PHANDSHAKE"}
        if device_name:
            d["device_name"] = ""
        if phase2 is not None:
            d["decoder_engine_rank"], d["decoder_bootstrap_room"] = phase2
        return d

    def wan(steps: int, shift: int, i2v: bool) -> dict[str, dict[str, Any]]:
        base: dict[str, Any] = {"infer_steps": steps, "target_video_length": 81,
                                "text_len": 512, "target_height": 480, "target_width": 832}
        dit = {"self_attn_1_type": "sage_attn2", "cross_attn_1_type": "sage_attn2",
               "cross_attn_2_type": "sage_attn2", "sample_guide_scale": 5,
               "sample_shift": shift, "enable_cfg": True}
        tail: dict[str, Any] = {"cpu_offload": False, "fps": 16}
        if i2v:
            tail["clip_embed_dim"] = 329216
        room = 2 if i2v else 0
        name = "wan_i2v" if i2v else "wan_t2v"
        return {
            f"{name}_disagg_encoder": {**base, **dit, **tail, "disagg_mode": "encoder",
                                       "disagg_config": disagg(room, 0, 1)},
            f"{name}_disagg_transformer": {**base, **dit, **tail, "disagg_mode": "transformer",
                                           "disagg_config": disagg(room, 0, 1,
                                                                   (2, room + 1))},
            f"{name}_disagg_decode": {**base, **tail, "disagg_mode": "decode",
                                      "disagg_config": disagg(room + 1, 1, 2)},
        }

    def qwen(task: str) -> dict[str, dict[str, Any]]:
        t2i = task == "t2i"
        steps = 50 if t2i else 40
        size = {"target_height": 1536, "target_width": 2752} if t2i else {
            "target_height": 1664, "target_width": 1664}
        geo = {"vae_z_dim": 16, "vae_stride": [1, 8, 8], "target_video_length": 1, **size}
        template = {"prompt_template_encode": "<|im_start|>system\nDescribe ...<|im_end|>\n"
                    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n",
                    "prompt_template_encode_start_idx": 34 if t2i else 64}
        cfg = {"enable_cfg": True, "sample_guide_scale": 4.0}
        text = {"text_encoder_dim": 3584, "text_len": 4096, "infer_steps": steps}
        extra: dict[str, Any] = ({"aspect_ratio": "16:9", "max_custom_size": 3072} if t2i else
                                 {"resize_mode": "adaptive"})
        edit: dict[str, Any] = {} if t2i else {"CONDITION_IMAGE_SIZE": 147456,
                                               "USE_IMAGE_ID_IN_PROMPT": True}
        room = 0 if t2i else 1
        name = f"qwen_image_{task}_disagg"
        transformer = {"task": task, "disagg_mode": "transformer", **text, **extra, **template,
                       "attn_type": "flash_attn2" if t2i else "flash_attn3", **cfg, **edit,
                       **geo, "disagg_config": disagg(room, 0, 1, (2, 2), device_name=True)}
        if t2i:
            transformer["dit_original_ckpt"] = "/path/to/qwen-2512/dit.safetensors"
        decode: dict[str, Any] = {"task": task, "disagg_mode": "decode", "infer_steps": steps,
                                  "vae_scale_factor": 8, **geo}
        if t2i:
            decode["max_custom_size"] = 3072
        return {
            f"{name}_encoder": {"task": task, "disagg_mode": "encoder",
                                "text_encoder_type": "lightllm_kernel", **text, **extra,
                                **template, "attn_type": "flash_attn3", **cfg, **edit, **geo,
                                "disagg_config": disagg(room, 0, 1, device_name=True)},
            f"{name}_transformer": transformer,
            f"{name}_decode": {**decode, "disagg_config": disagg(2, 1, 2)},
        }

    return {**wan(50, 5, False), **wan(40, 3, True), **qwen("t2i"), **qwen("i2i")}


@pytest.fixture(scope="session")
def wan_pairs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``<task>-diffusers`` and ``<task>-original`` for wan_t2v and wan_i2v: the same tiny
    random weights in diffusers' layout and in the original Wan2.1 layout (written through
    the published key mappings: modelkit/original.py), built once per run."""
    from modelkit.original import build_wan_pair

    def build(out: Path) -> None:
        for task in ("wan_t2v", "wan_i2v"):
            build_wan_pair(out, task)

    return built_once(tmp_path_factory, "wan-pairs", build)


# -- the model helpers (tests of the stage adapters against diffusers' pipelines) ------------

# The pipelines with a diffusers reference (the synthetic one has no model: test_synthetic.py).
DIFFUSERS_TASKS = tuple(t for t in TASKS if task_spec(t).family != "synthetic")
VIDEO_TASKS = ("wan_t2v", "wan_i2v")
IMAGE_INPUT_TASKS = ("wan_i2v", "qwen_i2i", "qwen_i2i_plus")
EDIT_TASKS = ("qwen_i2i", "qwen_i2i_plus")

# Small but not degenerate: 2x2 DiT patches over a 4x4 latent, 3 latent frames for Wan, CFG on.
SMALL: dict[str, dict[str, Any]] = {
    "wan_t2v": {"height": 32, "width": 32, "num_frames": 9, "infer_steps": 3, "fps": 8},
    "wan_i2v": {"height": 32, "width": 32, "num_frames": 9, "infer_steps": 3, "fps": 8},
    "qwen_t2i": {"height": 32, "width": 48, "infer_steps": 3},
    "qwen_i2i": {"height": 32, "width": 32, "infer_steps": 2},
    "qwen_i2i_plus": {"height": 32, "width": 32, "infer_steps": 2},
}
PROMPT = "A red fox running through fresh snow"
NEGATIVE = "blurred details, low quality"
SEED = 1234


def small_request(task: str, **changes: Any) -> GenerationRequest:
    fields: dict[str, Any] = {
        "task": task,
        "prompt": PROMPT,
        "negative_prompt": NEGATIVE,
        "seed": SEED,
    }
    fields.update(SMALL[task])
    fields.update(changes)
    return GenerationRequest(**fields)


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------
_STAGES: dict[tuple[str, str, str], Any] = {}


def stage(kind: str, models: Path, task: str, dtype: str = "float32") -> Any:
    """Loaded stages, cached for the session (loading is the slow part of small tests)."""
    import workers.models as wm

    adapters = {"encoder": wm.EncoderAdapter, "transformer": wm.TransformerAdapter,
                "decoder": wm.DecoderAdapter}
    key = (kind, task, dtype)
    if key not in _STAGES:
        obj = adapters[kind].for_task(models / task, task, device="cpu", dtype=dtype)
        obj.load()
        _STAGES[key] = obj
    return _STAGES[key]


def wire(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a transfer does: tensor -> (dtype, shape, raw bytes) -> a new tensor. bfloat16 has
    no numpy type, so the bytes are taken through a uint8 view."""
    import torch

    out = {}
    for name, tensor in tensors.items():
        assert tensor.is_contiguous(), f"{name} is not contiguous"
        raw = tensor.detach().cpu().view(torch.uint8).numpy().tobytes()
        assert len(raw) == tensor.numel() * tensor.element_size()
        rebuilt = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        out[name] = rebuilt.view(tensor.dtype).reshape(tensor.shape)
        assert torch.equal(out[name], tensor.cpu())
    return out


def diffusers_reference(
    models: Path, req: GenerationRequest, image_png: bytes | list[bytes] | None, dtype: str,
    setup: Callable[[Any], None] | None = None, folder: Path | None = None,
) -> np.ndarray:
    """diffusers' own one-process pipeline on the same folder (``models / task``, or
    ``folder``), seed and sizes; a list of images goes to the pipeline as a list.
    ``setup(pipe)`` may change the pipeline first (load adapters, enable a cache)."""
    import io

    import diffusers
    import numpy as np
    import torch
    from PIL import Image

    from workers.models import get_family

    task = req.task
    folder = folder or models / task
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    extra: dict[str, Any] = {}
    if task in EDIT_TASKS:
        from workers.models.families.qwen_text import QwenEditProcessor

        extra["processor"] = QwenEditProcessor.from_pretrained(folder / "processor")
    pipeline_class = get_family(task).pipeline_class
    assert pipeline_class is not None
    pipe = getattr(diffusers, pipeline_class).from_pretrained(folder, dtype=torch_dtype, **extra)
    pipe.set_progress_bar_config(disable=True)
    if setup is not None:
        setup(pipe)
    kwargs: dict[str, Any] = {
        "prompt": req.prompt,
        "negative_prompt": req.negative_prompt,
        "height": req.height,
        "width": req.width,
        "num_inference_steps": req.infer_steps,
        "generator": torch.Generator("cpu").manual_seed(req.seed),
        "output_type": "np",
    }
    if isinstance(image_png, list):
        kwargs["image"] = [Image.open(io.BytesIO(i)).convert("RGB") for i in image_png]
    elif image_png is not None:
        kwargs["image"] = Image.open(io.BytesIO(image_png)).convert("RGB")
    if task in VIDEO_TASKS:
        kwargs.update(num_frames=req.num_frames, guidance_scale=req.guidance_scale)
        return np.asarray(pipe(**kwargs).frames[0])
    kwargs.update(true_cfg_scale=req.true_cfg_scale)
    return np.asarray(pipe(**kwargs).images[0])


# -- the planned GPU commands of docs/benchmarks.md ---------------------------------------------

def planned_commands(heading: str = "## Serving under 24 GiB caps (issue 20)",
                     doc: str = "docs/benchmarks.md") -> list[list[str]]:
    """The benchmark commands of one section of ``doc`` (by default the issue-20 runs of
    docs/benchmarks.md), as argument lists. The section ends at the next heading of its
    level or above."""
    import re
    import shlex

    text = (ROOT / doc).read_text()
    section = text.split(heading, 1)[1]
    level = heading.split(" ", 1)[0]
    section = re.split(rf"\n#{{1,{len(level)}}} ", section, maxsplit=1)[0]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words and "=" in words[0] and not words[0].startswith("-"):
                words.pop(0)  # leading VAR=value assignments
            if words[:2] == ["python3", "-m"] and words[2].startswith("scripts.bench."):
                commands.append(words[2:])
    return commands
