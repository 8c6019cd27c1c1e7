"""The offline bundle's pure parts (target tags, skip list, markers) and install_offline.sh's
refusals. Building a real bundle needs the registries and takes a minute: it is done by hand
(docs/offline.md), and its result was installed on the GPU machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from scripts.offline import offline_bundle as ob
from tests.support.paths import ROOT

pytestmark = pytest.mark.integration  # starts processes or servers


def test_platform_tags_cover_older_manylinux() -> None:
    tags = ob.platform_tags("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_17_x86_64" in tags
    assert {"manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"} <= set(tags)
    assert "manylinux_2_29_x86_64" not in tags
    assert ob.platform_tags("linux_x86_64") == ["linux_x86_64"]


def test_default_skip_list_keeps_torch_out_and_the_project_in() -> None:
    skip = ob.read_skip(ROOT / "scripts" / "offline" / "offline_skip.txt", ["extra-one"])
    for name in ("torch", "nvidia-cudnn-cu13", "Transformers", "numpy", "extra_one"):
        assert ob.skipped(name, skip), name
    for name in ("diffusers", "av", "fastapi", "mooncake-transfer-engine-cuda13", "pydantic"):
        assert not ob.skipped(name, skip), name


def test_roots_and_target_markers() -> None:
    roots = {r.name for r in ob.project_roots(["sage"])}
    assert {"diffusers", "av", "torch", "sageattention"} <= roots
    env = ob.target_env("3.12")
    assert Requirement("x; python_version >= '3.12'").marker.evaluate(env)  # type: ignore[union-attr]
    assert not Requirement("x; sys_platform == 'win32'").marker.evaluate(env)  # type: ignore[union-attr]


def run_install(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(ROOT / "scripts" / "offline" / "install_offline.sh"), *args],
                          capture_output=True, text=True, timeout=120)


def test_install_refuses_what_is_not_a_bundle(tmp_path: Path) -> None:
    proc = run_install(str(tmp_path))
    assert proc.returncode == 2 and "not a bundle" in proc.stderr


def test_install_refuses_another_python(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text(json.dumps({"python": "2.7"}))
    proc = run_install(str(tmp_path), "--python", sys.executable)
    assert proc.returncode == 2 and "bundle is for Python 2.7" in proc.stderr
    assert "--python 3." in proc.stderr  # says how to rebuild it
