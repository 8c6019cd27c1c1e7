"""A newcomer's first hour: the README's "first hour" commands, read from the README and run
as written, from the repository root, on this CPU machine -- the tiny model, the group
started by its start script with the GPU variables the README gives (no GPU here: the CPU,
with a notice), the request script and ``diffring submit`` with ``--small``, then
``diffring status``, ``list`` and ``cancel``. Their output is not a terminal here, so they
must print progress lines.

Only the environment is the test's: PORT_OFFSET (its ports are free), OUTPUT_DIR and LOG_DIR
(its own task store and logs), XDG_STATE_HOME (where the launcher records the running group,
so the clients find it, and nobody else's). Beside it, a second copy of the group given only
another PORT_OFFSET is refused before it starts anything, naming OUTPUT_DIR.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.paths import ROOT
from tests.support.scripts import Launched, free_offset

pytestmark = pytest.mark.integration  # starts processes or servers

MARK = "<!-- tested as written: tests/integration/test_newcomer.py (terminal {}) -->"


def readme_block(terminal: int) -> str:
    """The bash block after the README's marker for ``terminal``."""
    text = (ROOT / "README.md").read_text()
    start = text.index(MARK.format(terminal))
    m = re.compile(r"```bash\n(.*?)```", re.S).search(text, start)
    assert m is not None
    return m.group(1)


def newcomer_env(tmp_path: Path) -> dict[str, str]:
    """This machine's environment, less what would steer the commands (a group's variables
    set by the caller), plus the test's own places."""
    env = {k: v for k, v in os.environ.items()
           if not k.endswith("_GPU") and not k.startswith("GPU_")
           and k not in ("model_path", "DIFFRING_URL", "PORT_OFFSET", "OUTPUT_DIR", "LOG_DIR")}
    env.update(PORT_OFFSET=str(free_offset("wan_t2v", "wan")), OUTPUT_DIR=str(tmp_path / "results"),
               LOG_DIR=str(tmp_path / "logs"), XDG_STATE_HOME=str(tmp_path / "state"),
               READY_TIMEOUT="300", STOP_TIMEOUT="30")
    return env


@pytest.fixture
def results() -> Iterator[list[Path]]:
    made = [ROOT / "out" / "cat.mp4", ROOT / "out" / "fox.mp4"]
    for path in made:
        path.unlink(missing_ok=True)
    yield made
    for path in made:
        path.unlink(missing_ok=True)


@pytest.mark.timeout(900)  # a model build and four services starting on a loaded machine
def test_the_readme_first_hour_runs_as_written(tmp_path: Path, results: list[Path]) -> None:
    env = newcomer_env(tmp_path)
    script = tmp_path / "terminal-1.sh"
    script.write_text(readme_block(1))
    group = Launched(script, env, tmp_path / "logs")
    try:
        group.wait_for("group ready", timeout=600)
        out = group.output()
        assert "notice: torch sees no GPU here" in out and "run on the CPU" in out
        assert list((tmp_path / "state" / "diffring" / "groups").glob("*.json"))

        # A second copy with only another PORT_OFFSET: refused before anything starts.
        second = subprocess.run(
            ["bash", "scripts/server/disagg/wan/start_wan_t2v_disagg.sh"],
            env={**env, "model_path": "out/tiny-models/wan_t2v",
                 "PORT_OFFSET": str(free_offset("wan_t2v", "wan")),
                 "LOG_DIR": str(tmp_path / "logs-2")},
            cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert second.returncode == 1, second.stderr
        assert "OUTPUT_DIR" in second.stderr and "started controller" not in second.stderr

        done = subprocess.run(["bash", "-e", "-c", readme_block(2)], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        for path in results:
            assert path.read_bytes()[4:8] == b"ftyp", path  # an MP4
        # Not a terminal: lines, not a bar (the request script and diffring submit).
        assert len(re.findall(r"task \S+: denoising step \d+/4", done.stderr)) >= 4
        lines = done.stdout.splitlines()
        assert lines[0] == str(results[0]) and lines[1] == str(results[1])
        assert re.fullmatch(r"task \S+: (pending|processing) \(.*\)", lines[2])
        assert any(re.search(r"\d+ task\(s\) at http://127\.0\.0\.1:\d+, newest first", ln)
                   for ln in lines)
        assert re.fullmatch(r"task \S+: success \(.*\)", lines[-1])
    finally:
        if group.proc.poll() is None:  # Ctrl+C in terminal 1: its whole process group
            os.killpg(group.proc.pid, signal.SIGINT)
            group.proc.wait(120)
        group.cleanup()
    assert "group stopped" in group.output()
    assert not list((tmp_path / "state" / "diffring" / "groups").glob("*.json"))
