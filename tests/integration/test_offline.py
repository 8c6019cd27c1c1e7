"""The offline bundle's pure parts (target tags, skip list, markers) and install_offline.sh's
refusals. Building a real bundle needs the registries and takes a minute: it is done by hand
(docs/offline.md), and its result was installed on the GPU machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

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


# -- source extras: SageAttention2's Hopper kernel, built on the node ----------------------

def test_sage2_extra_is_a_source_and_replaces_pypi_sageattention() -> None:
    roots, sources = ob.bundle_roots(["sage", "fp8", "sage2"],
                                     "mooncake-transfer-engine-cuda13", [])
    names = {r.name for r in roots}
    assert sources == ["sage2"]
    assert "sageattention" not in names  # PyPI's 1.x: the build replaces it
    assert {"torchao", "nvidia-cudnn-frontend", "mooncake-transfer-engine-cuda13"} <= names
    roots, sources = ob.bundle_roots(["sage"], "mooncake-transfer-engine-cuda13", [])
    assert sources == [] and "sageattention" in {r.name for r in roots}
    with pytest.raises(SystemExit, match="expected NAME=PATH"):
        ob.parse_sources(["sage3=/x"])


def test_bundle_source_packs_a_local_tree_with_its_builder(tmp_path: Path) -> None:
    tree = tmp_path / "SageAttention"
    (tree / "csrc").mkdir(parents=True)
    (tree / "csrc" / "dispatch_utils.h").write_text("// header\n")
    out = tmp_path / "bundle"
    entry = ob.bundle_source("sage2", out, tree)
    assert entry["archive"] == "src/sage2.tar.gz" and entry["folder"] == "sage2"
    assert entry["commit"] == ob.SOURCE_EXTRAS["sage2"]["commit"]
    assert len(entry["sha256"]) == 64 and (out / "src" / "sage2.tar.gz").is_file()
    assert (out / "build_sage2.py").read_bytes() == \
        (ROOT / "scripts" / "offline" / "build_sage2.py").read_bytes()


def _bundle_with_sage2(tmp_path: Path) -> Path:
    """A bundle of no wheels and the sage2 source extra (a stand-in tree), for this Python."""
    tree = tmp_path / "tree"
    (tree / "csrc").mkdir(parents=True)
    bundle = tmp_path / "bundle"
    (bundle / "wheels").mkdir(parents=True)
    (bundle / "requirements.txt").write_text("# nothing to install\n")
    entry = ob.bundle_source("sage2", bundle, tree)
    (bundle / "manifest.json").write_text(json.dumps(
        {"python": "{}.{}".format(*sys.version_info[:2]), "sources": {"sage2": entry}}))
    return bundle


def test_install_without_a_toolchain_installs_the_rest_and_names_what_is_missing(
        tmp_path: Path) -> None:
    """This machine's torch is a CPU build: the kernel cannot be built, which the install
    says (with why) and reports as exit status 3 after installing everything else."""
    bundle = _bundle_with_sage2(tmp_path)
    proc = run_install(str(bundle), "--python", sys.executable)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "is a CPU build: the kernel needs a CUDA torch" in proc.stderr
    assert "cannot build the sage2 kernel on this node" in proc.stderr
    assert "installed, except the kernels of: sage2" in proc.stderr
    assert (bundle / "env.sh").is_file()  # the rest is installed and usable


def test_install_uses_a_wheel_built_once_for_this_python_and_torch(tmp_path: Path) -> None:
    """A wheel in built/sage2/<python and torch>/ (left by a first install on a node of the
    same image) is installed without building: no toolchain needed."""
    import torch

    bundle = _bundle_with_sage2(tmp_path)
    stamp = "py{}.{}-torch{}".format(*sys.version_info[:2], torch.__version__)
    built = bundle / "built" / "sage2" / stamp
    built.mkdir(parents=True)
    wheel = built / "sageattention-2.2.0+sm90-py3-none-any.whl"
    _stand_in_wheel(wheel)
    _stand_in_wheel(bundle / "wheels" / "standin-1.0-py3-none-any.whl", "standin", "1.0")
    site = tmp_path / "site"
    proc = run_install(str(bundle), "--python", sys.executable, "--target", str(site))
    assert f"installing {wheel}, built once for {stamp}" in proc.stdout, proc.stderr
    assert (site / "sageattention" / "_qattn_sm90.py").is_file()
    assert proc.returncode == 0, proc.stderr


def _stand_in_wheel(path: Path, name: str = "sageattention", version: str = "2.2.0+sm90"
                    ) -> None:
    """A pure-Python wheel (by default named like the build's, with the module the install
    checks)."""
    import zipfile

    dist = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": "", f"{name}/_qattn_sm90.py": "",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
        zf.writestr(f"{dist}/RECORD", "".join(f"{n},,\n" for n in [*files, f"{dist}/RECORD"]))


# -- build_sage2.py's parts that need no GPU -----------------------------------------------

def _builder() -> Any:
    sys.path.insert(0, str(ROOT / "scripts" / "offline"))
    try:
        import build_sage2
    finally:
        sys.path.pop(0)
    return build_sage2


_HEADER = "".join(
    f"#define {macro}({arg}, {name}, ...) \\\n"
    f"  if ({arg} == 1) {{ constexpr int {name} = 1; __VA_ARGS__ }} \\\n"
    f"  else if ({arg} == 2) {{ constexpr int {name} = 2; __VA_ARGS__ }}\n\n"
    for macro, arg, name in [("DISPATCH_HEAD_DIM", "head_dim", "HEAD_DIM"),
                             ("DISPATCH_CAUSAL", "is_causal", "IS_CAUSAL"),
                             ("DISPATCH_QK_QUANT_GRAN", "qk_quant_gran", "QK_QUANT_GRAN"),
                             ("DISPATCH_RETURN_LSE", "return_lse", "RETURN_LSE"),
                             ("DISPATCH_PYTORCH_DTYPE_TO_CTYPE_FP16", "pytorch_dtype",
                              "c_type"),
                             ("DISPATCH_BLOCK_SIZE", "block_size", "BLOCK_SIZE")])
"""Dispatch macros of the form the builder rewrites (one line each case, as a stand-in)."""


def test_build_narrows_the_dispatch_to_the_one_case_served(tmp_path: Path) -> None:
    header = tmp_path / "dispatch_utils.h"
    header.write_text(_HEADER)
    _builder().narrow_dispatch(header)
    text = header.read_text()
    assert "if (head_dim == 128) { \\\n    constexpr int HEAD_DIM = 128;" in text
    assert "if (is_causal == 0)" in text and "constexpr bool IS_CAUSAL = false;" in text
    assert "if (qk_quant_gran == 3)" in text and "if (return_lse == 0)" in text
    assert "pytorch_dtype == at::ScalarType::BFloat16" in text
    assert "using c_type = nv_bfloat16;" in text
    # The others are left as they are, and every narrowed one refuses the rest by name.
    assert "#define DISPATCH_BLOCK_SIZE(block_size, BLOCK_SIZE, ...) \\\n  if (block_size == 1)" \
        in text
    assert text.count("throw std::invalid_argument") == 5
    header.write_text(_HEADER.replace("DISPATCH_CAUSAL", "DISPATCH_MASK"))
    with pytest.raises(SystemExit):
        _builder().narrow_dispatch(header)


def test_build_check_names_a_cpu_torch() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "offline" / "build_sage2.py"),
                           "--check"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3
    assert "is a CPU build: the kernel needs a CUDA torch" in proc.stderr
