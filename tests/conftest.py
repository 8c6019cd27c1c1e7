"""The suite's fixtures and hooks: the tiny models and input images, a controller, the port
range of each pytest-xdist worker, the order of the modules, and the guards every test runs
under (coordinators closed, no process started by a unit test). Plain helpers are in
``tests/support/``; processes started by a test are stopped by it, by pid."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# The repository on the path before anything of it is imported (a plain ``pytest`` command
# does not put the working directory there).
if str(Path(__file__).resolve().parent.parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from launcher import PORT_RANGE_ENV, parse_port_range
from rings.soak import stop_process
from tests.support.controller import Controller, controller_config, start_controller
from tests.support.coordinators import coordinators
from tests.support.ports import TEST_PORTS, ephemeral_start


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
    "test_wan22.py",
)
"""Modules that take about a minute or more on a loaded 2-core machine, longest first. They
run first: scripts/test.sh hands whole modules to two pytest processes in collection order,
and a long module handed out last would run alone at the end. (A module missing here only
makes a run's tail longer.)"""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep theirs


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[Controller]:
    ctl = start_controller(tmp_path, controller_config(tmp_path, slots=3, slot_size=512))
    try:
        yield ctl
    finally:
        stop_process(ctl.proc)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random-weight models of every pipeline, built once per run (offline)."""
    env = os.environ.get("DIFFRING_TINY_MODELS")
    from modelkit.tiny import build_all

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


@pytest.fixture(scope="session")
def wan22_pairs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``<name>-diffusers`` and ``<name>-original`` for wan22_a14b_t2v, wan22_a14b_i2v and
    wan22_5b (TI2V-5B's one folder): the same tiny random weights in diffusers' layout and in
    the original Wan2.2 layout (A14B's ``high_noise_model/`` and ``low_noise_model/``,
    TI2V-5B's ``Wan2.2_VAE.pth``; modelkit/original.py), built once per run."""
    from modelkit.original import build_wan22_pair

    def build(out: Path) -> None:
        for task in ("wan22_a14b_t2v", "wan22_a14b_i2v", "wan22_5b"):
            build_wan22_pair(out, task)

    return built_once(tmp_path_factory, "wan22-pairs", build)
