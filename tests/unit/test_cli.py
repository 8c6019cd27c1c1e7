"""The ``diffring`` command in-process: ``--help`` at every level under its own name, the
front door found without ``--url``, the request bodies (``--small``), progress lines without
a terminal; the launcher's GPU fallback; what the torch installer says it installs."""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from diffring_cli import client, target
from diffring_cli.main import app, submit_body
from launcher import current
from launcher.launch import LaunchError, parse_args, resolve_devices

SUBCOMMANDS = ("serve", "group", "inspect", "submit", "status", "list", "cancel", "result")


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_help_names_each_subcommand(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``diffring serve --help`` printed run_service's usage without the word serve."""
    result = CliRunner().invoke(app, [command, "--help"], prog_name="diffring")
    text = result.output + capsys.readouterr().out
    assert result.exit_code == 0, text
    assert f"diffring {command}" in text.splitlines()[0] or f"usage: diffring {command}" in text


def test_top_level_help_lists_every_command_and_completion() -> None:
    result = CliRunner().invoke(app, ["--help"], prog_name="diffring")
    assert result.exit_code == 0
    for command in SUBCOMMANDS:
        assert f"  {command} " in result.output
    assert "--install-completion" in result.output  # typer's, for free


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(current.STATE_ENV, str(tmp_path))
    return tmp_path


def test_the_front_door_is_found_without_a_url(state: Path, tmp_path: Path) -> None:
    assert target.front_door(None) == (target.DEFAULT_URL, target.front_door(None)[1])
    assert target.front_door(None, pipeline="wan_t2v",
                             default="http://127.0.0.1:8002")[0] == "http://127.0.0.1:8002"
    current.record(current.RunningGroup("wan_t2v", "http://127.0.0.1:18002", os.getpid(), "x"))
    assert target.front_door(None)[0] == "http://127.0.0.1:18002"
    assert target.front_door(None, pipeline="wan_t2v")[0] == "http://127.0.0.1:18002"
    assert target.front_door(None, pipeline="qwen_t2i")[0] == target.DEFAULT_URL
    assert target.front_door("http://h:1/")[0] == "http://h:1"  # --url wins
    cfg = tmp_path / "controller.json"
    cfg.write_text('{"server": {"host": "0.0.0.0", "port": 9123}}')
    assert target.front_door(None, cfg)[0] == "http://127.0.0.1:9123"
    # A second group: which one is meant must be said.
    current.record(current.RunningGroup("qwen_t2i", "http://127.0.0.1:18008", os.getppid(),
                                        "y"))
    with pytest.raises(target.NoTarget, match="2 groups run"):
        target.front_door(None)
    assert target.front_door(None, pipeline="qwen_t2i")[0] == "http://127.0.0.1:18008"
    # A launcher that is gone (SIGKILLed) leaves a record that no longer counts.
    current.forget(os.getppid())
    current.record(current.RunningGroup("qwen_t2i", "http://127.0.0.1:18008", 2**22 + 1, "z"))
    assert [g.pid for g in current.running()] == [os.getpid()]
    assert not (current.state_dir() / f"{2**22 + 1}.json").exists()


def test_submit_bodies() -> None:
    small = submit_body("wan_t2v", prompt="p", small=True, infer_steps=2, seed=None)
    assert small == {"height": 32, "width": 32, "target_video_length": 9, "infer_steps": 2,
                     "target_fps": 8, "prompt": "p"}
    assert submit_body("qwen_t2i", prompt="p") == {"prompt": "p"}
    with pytest.raises(client.RequestFailed, match="--frames applies to video"):
        submit_body("qwen_t2i", prompt="p", target_video_length=9)


class NotATerminal(io.StringIO):
    def isatty(self) -> bool:
        return False


def test_progress_lines_without_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request script piped to a file printed nothing for 20 minutes: now a line per
    stage, the first and last step, and a step every few seconds in between."""
    err = NotATerminal()
    monkeypatch.setattr(sys, "stderr", err)
    now = [100.0]
    monkeypatch.setattr(client.time, "monotonic", lambda: now[0])
    p = client.Progress("t1", quiet=False)
    states: list[dict[str, Any]] = [
        {"stage": "queued", "waiting_for": "encoder", "queue_position": 2},
        {"stage": "queued", "waiting_for": "encoder", "queue_position": 2},
        {"stage": "encoding"},
        {"stage": "phase1", "waiting_for": "transformer", "queue_position": 1},
        *({"stage": "denoising", "step": k, "steps": 50} for k in range(1, 51)),
        {"stage": "completed", "step": 50, "steps": 50},
    ]
    for st in states:
        p.update(st)
        now[0] += 0.5  # a step every half second: one line every 5 s
    p.close()
    lines = err.getvalue().splitlines()
    assert lines[:3] == ["task t1: queued, waiting for encoder (position 2)", "task t1: encoding",
                         "task t1: phase1, waiting for transformer (position 1)"]
    steps = [ln for ln in lines if "denoising" in ln]
    assert steps[0] == "task t1: denoising step 1/50" and steps[-1].endswith("50/50")
    assert 5 <= len(steps) <= 8 and lines[-1] == "task t1: completed"


def test_gpu_variables_fall_back_to_the_cpu_with_a_notice() -> None:
    said: list[str] = []
    args = parse_args(["wan_t2v", "--model-path", "m", "--encoder-device", "0",
                       "--transformer-device", "1", "--decoder-device", "cuda:0"])
    assert resolve_devices(args, said.append, gpu_count=lambda: 0) == {
        "encoder": "cpu", "transformer": "cpu", "decoder": "cpu"}
    assert said == ["notice: torch sees no GPU here; ENCODER_GPU=0 TRANSFORMER_GPU=1 "
                    "DECODER_GPU=cuda:0 run on the CPU instead"]
    said.clear()
    assert resolve_devices(args, said.append, gpu_count=lambda: 2) == {
        "encoder": "cuda:0", "transformer": "cuda:1", "decoder": "cuda:0"}
    assert said == []
    with pytest.raises(LaunchError, match="torch sees 1 GPU"):
        resolve_devices(args, said.append, gpu_count=lambda: 1)
    both = parse_args(["--group", "qwen_t2i", "--model-path", "m"])
    assert both.group == "qwen_t2i"


def test_the_torch_installer_says_what_pip_would_take(tmp_path: Path) -> None:
    from scripts import install_torch
    wheel = tmp_path / "torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl"
    wheel.write_bytes(b"x" * 3_000_000)
    cpu = [{"metadata": {"name": "torch", "version": "2.13.0+cpu"},
            "download_info": {"url": wheel.as_uri()}},
           {"metadata": {"name": "sympy", "version": "1.14.0"},
            "download_info": {"url": "https://files.example/sympy.whl"}}]
    assert install_torch.describe(cpu) == ("a CPU build: torch 2.13.0+cpu, sympy 1.14.0; 3 MB "
                                           "of local files")
    cuda = [{"metadata": {"name": "torch", "version": "2.13.0"}, "download_info": {}},
            {"metadata": {"name": "nvidia-cublas-cu12", "version": "12.9"},
             "download_info": {}}]
    assert install_torch.describe(cuda).startswith("a CUDA build (several GB")
