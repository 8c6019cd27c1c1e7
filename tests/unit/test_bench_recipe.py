"""The planned GPU runs of issue 33 (docs/benchmarks.md, "Planned: the distilled recipe at FP8
speed"): every command parses with ``--dry-run``, its selectors name modes, each mode's
service config passes the services' own parser and each mode's request fields the request's
checks, and the table's modes are all there. In-process: nothing starts."""

from __future__ import annotations

import pytest

from tests.support.bench import planned_commands

HEADING = "## Planned: the distilled recipe at FP8 speed (issue 33)"


def test_planned_recipe_commands_parse_and_their_plans_are_complete(
        capsys: pytest.CaptureFixture[str]) -> None:
    from scripts.bench import bench_serving, lora_kit
    from scripts.bench.bench_gpu import SECTIONS

    commands = planned_commands(HEADING)
    mains = {"scripts.bench.bench_serving": bench_serving.main,
             "scripts.bench.lora_kit": lora_kit.main}
    gpu = [c for c in commands if c[0] == "scripts.bench.bench_gpu"]  # the streamed decode's
    assert gpu and all(set(c[c.index("--sections") + 1].split(",")) <= set(SECTIONS)
                       for c in gpu)
    commands = [c for c in commands if c not in gpu]
    assert {c[0] for c in commands} == set(mains) and len(commands) >= 6
    for module, *argv in commands:
        argv = [a.replace("$OUT", "/tmp/out") for a in argv]
        assert mains[module]([*argv, "--dry-run"]) == 0, argv
    printed = capsys.readouterr().out
    modes = {line.split(":")[0] for line in printed.splitlines() if line.startswith(
        ("disagg@", "baseline@")) and " requests:" not in line}
    assert modes >= {"disagg@plain", "disagg@fused", "baseline@plain", "disagg@lora",
                     "disagg@lora24g"}
    for expected in ('"linear": "fp8"', '"compile": true', '"recipe": "wan2.1-distill-4step"',
                     '"recipe": "qwen-image-lightning-8step"',
                     '"lora_fuse": [{"name": "distill", "strength": 1.0}]',
                     '"max_vram_gb": 24', 'requests: {"loras": [{"name": "distill"'):
        assert expected in printed, expected
    assert "adapter: wan-14b rank 64" in printed and "adapter: qwen-image rank 64" in printed


def test_a_mode_whose_request_fields_are_refused_stops_the_dry_run() -> None:
    from scripts.bench import bench_serving

    with pytest.raises(SystemExit, match="mode disagg@lora: its request fields are refused"):
        bench_serving.main(["--arch", "wan-14b", "--device", "cuda:0", "--modes",
                            "disagg@lora", "--body", 'loras=[{"name": "../x"}]', "--dry-run"])
    with pytest.raises(SystemExit, match="no mode is named"):
        bench_serving.main(["--arch", "wan-14b", "--modes", "disagg", "--body",
                            'nope:seed=1', "--dry-run"])


def test_the_reported_recipe_commands_parse(capsys: pytest.CaptureFixture[str]) -> None:
    """BENCHMARKS.md's measured recipe table: its commands still run (``--dry-run``)."""
    from scripts.bench import bench_serving, lora_kit

    commands = planned_commands("### The distilled recipe at FP8 speed: Wan2.1-T2V-14B",
                                doc="BENCHMARKS.md")
    mains = {"scripts.bench.bench_serving": bench_serving.main,
             "scripts.bench.lora_kit": lora_kit.main}
    assert [c[0] for c in commands].count("scripts.bench.bench_serving") == 2
    for module, *argv in commands:
        assert mains[module]([*argv, "--dry-run"]) == 0, argv
    printed = capsys.readouterr().out
    assert 'disagg@lora requests: {"loras": [{"name": "distill"' in printed
    assert '"lora_fuse": [{"name": "distill", "strength": 1.0}]' in printed
