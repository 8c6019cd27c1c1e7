"""The planned GPU runs of issue 34 (docs/benchmarks.md, "Planned: Wan2.2 experts and
TI2V-5B"): every command parses with ``--dry-run``, its selectors name modes, each mode's
service config passes the services' own parser (the ``experts`` placement, the 24 GiB caps,
the FP8 options) and each mode's request fields the request's checks, and the table's modes
are all there. In-process: nothing is built or started."""

from __future__ import annotations

import pytest

from tests.support.bench import planned_commands

HEADING = "## Planned: Wan2.2 experts and TI2V-5B (issue 34)"


def test_planned_wan22_commands_parse_and_their_plans_are_complete(
        capsys: pytest.CaptureFixture[str]) -> None:
    from scripts.bench import bench_serving

    commands = planned_commands(HEADING)
    assert {c[0] for c in commands} == {"scripts.bench.bench_serving"} and len(commands) == 8
    for _module, *argv in commands:
        argv = [a.replace("$OUT", "/tmp/out") for a in argv]
        assert bench_serving.main([*argv, "--dry-run"]) == 0, argv
    printed = capsys.readouterr().out
    modes = {line.split(":")[0] for line in printed.splitlines() if line.startswith(
        ("disagg@", "baseline@")) and " requests:" not in line}
    assert modes >= {"disagg@both", "baseline@both", "disagg@fp8", "disagg@swap",
                     "disagg@swap24g", "disagg@fp8c", "disagg@plain", "disagg@tiled",
                     "disagg@split"}
    for expected in ('"experts": "swap"', '"experts": "high"', '"max_vram_gb": 24',
                     '"weight_storage": "fp8"', '"linear": "fp8"', '"compile": true',
                     '"vae_tiling": true', '"flow_shift": 5.0',
                     'requests: {"guidance_scale": 1.0}'):
        assert expected in printed, expected
    # Every arch of the plan is a Wan2.2 folder modelkit.real builds.
    from modelkit.real import ARCHS, PIPELINE

    archs = {argv[argv.index("--arch") + 1] for _m, *argv in commands}
    assert archs <= set(ARCHS) and {PIPELINE[a] for a in archs} == {"wan22_a14b_t2v",
                                                                    "wan22_5b_t2v"}
