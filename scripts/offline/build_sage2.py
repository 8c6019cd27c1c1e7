#!/usr/bin/env python3
"""Build SageAttention2's Hopper kernel (INT8 QK, FP8 PV, sm_90a) into a wheel, on the node.

    python3 build_sage2.py --src SAGEATTENTION_SOURCE_DIR --out WHEEL_DIR [--jobs N]
    python3 build_sage2.py --check          # the toolchain only: exit 3 naming what is missing

``install_offline.sh`` runs it for a bundle made with ``--extras sage2`` (the source is in
the bundle; PyPI has no SageAttention 2 wheel), then installs the wheel; the DiT's
``attention_backend: "sage2"`` (workers/models/dit/sage2_attention.py) calls what it builds.

Why a build of our own rather than the project's ``setup.py``: upstream builds every
kernel family for every GPU it is given (the sm80 and sm89 kernels too, for an sm90 target)
with every instantiation of head size (64, 128), causal mask, quantisation granularity,
log-sum-exp output and output dtype. The DiTs served here need one of each: head size 128,
non-causal, per-thread INT8 granularity, no LSE, bf16. So this script copies the source,
narrows those dispatch macros (``csrc/dispatch_utils.h``) to the one case, and builds only
the two extensions the sm90 path imports (``_qattn_sm90`` and the quantisation kernels
``_fused``) for ``sm_90a``, with upstream's compiler flags. The Python package is
upstream's, unchanged. Any other case raises upstream's own "Unsupported ..." error, which
the backend never reaches: it refuses other head sizes and dtypes at load.

Only the standard library and the node's torch are imported: this file is copied into the
bundle and runs there without the project.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

VERSION = "2.2.0+sm90"
"""Upstream's version and a local label saying this is the trimmed Hopper-only build."""
MIN_NVCC = (12, 3)
"""sm_90a's wgmma needs CUDA 12.3 (upstream refuses older for 9.0 too)."""

# The one case each narrowed dispatch macro keeps: (macro, C++ kept, what it takes).
_NARROWED = {
    "DISPATCH_HEAD_DIM": ("head_dim == 128", "constexpr int {NAME} = 128;"),
    "DISPATCH_CAUSAL": ("is_causal == 0", "constexpr bool {NAME} = false;"),
    "DISPATCH_QK_QUANT_GRAN": ("qk_quant_gran == 3", "constexpr int {NAME} = 3;"),
    "DISPATCH_RETURN_LSE": ("return_lse == 0", "constexpr bool {NAME} = false;"),
    "DISPATCH_PYTORCH_DTYPE_TO_CTYPE_FP16": ("pytorch_dtype == at::ScalarType::BFloat16",
                                             "using {NAME} = nv_bfloat16;"),
}
_SOURCES = {
    "_qattn_sm90": ["csrc/qattn/pybind_sm90.cpp", "csrc/qattn/qk_int_sv_f8_cuda_sm90.cu"],
    "_fused": ["csrc/fused/pybind.cpp", "csrc/fused/fused.cu"],
}

_SETUP = '''
import os
import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CUDAExtension

abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
cxx = ["-O3", "-std=c++17", "-DENABLE_BF16", f"-D_GLIBCXX_USE_CXX11_ABI={{abi}}"]
nvcc = ["-O3", "-std=c++17", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
        "--use_fast_math", "-diag-suppress=174", f"-D_GLIBCXX_USE_CXX11_ABI={{abi}}",
        "--threads=" + os.environ.get("NVCC_THREADS", "2"),
        "-gencode", "arch=compute_90a,code=sm_90a"]
exts = [CUDAExtension(name=f"sageattention.{{name}}", sources=sources,
                      extra_compile_args={{"cxx": cxx, "nvcc": nvcc}},
                      extra_link_args={libcuda!r} if name == "_qattn_sm90" else [])
        for name, sources in {sources!r}.items()]
setup(name="sageattention", version={version!r}, license="Apache 2.0",
      description="SageAttention2, Hopper kernel only (built by diffring's build_sage2.py)",
      packages=["sageattention", "sageattention.triton"], python_requires=">=3.9",
      ext_modules=exts, cmdclass={{"build_ext": BuildExtension.with_options(use_ninja=True)}})
'''


def fail(msg: str) -> None:
    print(f"build_sage2: {msg}", file=sys.stderr)
    raise SystemExit(3)


def nvcc_path() -> str:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").is_file():
        return str(Path(home) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    if Path("/usr/local/cuda/bin/nvcc").is_file():
        return "/usr/local/cuda/bin/nvcc"
    fail("no CUDA compiler: nvcc is not on PATH, in $CUDA_HOME/bin or /usr/local/cuda/bin. "
         f"Install the CUDA toolkit (>= {MIN_NVCC[0]}.{MIN_NVCC[1]}, the major version of "
         "torch's CUDA) and set CUDA_HOME, or install a wheel built once on a node like this "
         "one (bundle/built/).")
    raise AssertionError  # unreachable: fail() exits


def libcuda_link_args(nvcc: str) -> list[str]:
    """How to link the driver library (the kernel encodes its TMA descriptors with
    ``cuTensorMapEncodeTiled``): the toolkit's stub when it has one, else the driver's own
    ``libcuda.so.1`` by path (GPU nodes have the driver; a bare ``-lcuda`` finds neither when
    the driver's folder is outside the linker's search path). ``SAGE2_LIBCUDA`` overrides."""
    if os.environ.get("SAGE2_LIBCUDA"):
        return [os.environ["SAGE2_LIBCUDA"]]
    home = Path(nvcc).resolve().parent.parent
    for stubs in (home / "lib64" / "stubs", home / "targets" / "x86_64-linux" / "lib" / "stubs",
                  home / "lib" / "stubs"):
        if (stubs / "libcuda.so").is_file():
            return [f"-L{stubs}", "-lcuda"]
    listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    for line in listing.splitlines():
        if line.strip().startswith("libcuda.so") and "=>" in line:
            return [line.split("=>", 1)[1].strip()]
    for folder in ("/usr/local/nvidia/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/lib64"):
        if Path(folder, "libcuda.so.1").exists():
            return [str(Path(folder, "libcuda.so.1"))]
    fail("no libcuda to link: neither the toolkit's stubs/libcuda.so nor the driver's "
         "libcuda.so.1 was found (install the NVIDIA driver or the full CUDA toolkit, or set "
         "SAGE2_LIBCUDA to the library's path)")
    raise AssertionError


def check_toolchain() -> dict[str, str]:
    """What the build needs, each missing piece named: torch with CUDA, nvcc of torch's CUDA
    major version and >= 12.3, the driver library to link, a C++ compiler and ninja."""
    try:
        import torch
    except ImportError:
        fail("this Python has no torch; the kernel is built against the node's CUDA torch")
    if torch.version.cuda is None:
        fail(f"torch {torch.__version__} is a CPU build: the kernel needs a CUDA torch")
    nvcc = nvcc_path()
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    if m is None:
        fail(f"{nvcc} --version printed no release: {out.strip()[:200]}")
        raise AssertionError
    have = (int(m.group(1)), int(m.group(2)))
    if have < MIN_NVCC:
        fail(f"nvcc {have[0]}.{have[1]} is too old for sm_90a; need >= "
             f"{MIN_NVCC[0]}.{MIN_NVCC[1]}")
    torch_major = int(str(torch.version.cuda).split(".")[0])
    if have[0] != torch_major:
        fail(f"nvcc {have[0]}.{have[1]} does not match torch's CUDA {torch.version.cuda}: "
             "install the toolkit of the same major version")
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        fail("no C++ compiler (c++ / g++): apt-get install g++")
    if shutil.which("ninja") is None:
        try:
            import ninja  # noqa: F401  (the pip package puts the binary on its own path)
        except ImportError:
            fail("ninja is not installed: pip install ninja (or apt-get install ninja-build)")
    return {"nvcc": nvcc, "nvcc_version": f"{have[0]}.{have[1]}", "cxx": str(cxx),
            "libcuda": " ".join(libcuda_link_args(nvcc)),
            "torch": torch.__version__, "torch_cuda": str(torch.version.cuda)}


def narrow_dispatch(header: Path) -> None:
    """Rewrite the dispatch macros of ``_NARROWED`` to their one kept case."""
    text = header.read_text()
    for macro, (cond, decl) in _NARROWED.items():
        pattern = re.compile(rf"#define {macro}\((\w+), (\w+), \.\.\.\)(?:[^\n]*\\\n)*[^\n]*\n")
        m = pattern.search(text)
        if m is None:
            fail(f"{header} has no macro {macro}(x, NAME, ...): the source is not the release "
                 "this script was written for")
            raise AssertionError
        arg, name = m.group(1), m.group(2)
        kept_cond = re.sub(r"^\w+", arg, cond)
        body = (f"#define {macro}({arg}, {name}, ...) \\\n"
                f"  if ({kept_cond}) {{ \\\n"
                f"    {decl.format(NAME=name)} \\\n"
                f"    __VA_ARGS__ \\\n"
                f"  }} else {{ \\\n"
                f"    throw std::invalid_argument(\"Unsupported {macro} case: this build "
                f"(diffring build_sage2.py) has {kept_cond} only\"); \\\n"
                f"  }}\n")
        text = text[:m.start()] + body + text[m.end():]
    header.write_text(text)


def build(src: Path, out: Path, jobs: int, libcuda: list[str]) -> Path:
    for rel in ["csrc/dispatch_utils.h", "sageattention/core.py",
                *[s for sources in _SOURCES.values() for s in sources]]:
        if not (src / rel).is_file():
            fail(f"{src} is not a SageAttention source tree: {rel} is missing")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sage2-build-") as tmp:
        tree = Path(tmp) / "src"
        shutil.copytree(src / "csrc", tree / "csrc")
        shutil.copytree(src / "sageattention", tree / "sageattention",
                        ignore=shutil.ignore_patterns("__pycache__"))
        for name in ("LICENSE", "README.md"):
            if (src / name).is_file():
                shutil.copy2(src / name, tree / name)
        narrow_dispatch(tree / "csrc" / "dispatch_utils.h")
        (tree / "setup.py").write_text(_SETUP.format(sources=_SOURCES, version=VERSION,
                                                   libcuda=libcuda))
        env = dict(os.environ, MAX_JOBS=str(jobs), TORCH_CUDA_ARCH_LIST="9.0a")
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
               "--no-index", "--disable-pip-version-check", "-w", str(out), str(tree)]
        print(f"build_sage2: {' '.join(cmd)} (MAX_JOBS={jobs})", flush=True)
        if subprocess.run(cmd, env=env).returncode != 0:
            fail("the build failed (the compiler's messages are above)")
    wheels = sorted(out.glob("sageattention-*.whl"), key=lambda p: p.stat().st_mtime)
    if not wheels:
        fail(f"pip reported success but left no sageattention wheel in {out}")
    return wheels[-1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=Path, help="SageAttention source tree")
    ap.add_argument("--out", type=Path, help="folder for the wheel")
    ap.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1))
    ap.add_argument("--check", action="store_true", help="check the toolchain only")
    args = ap.parse_args(argv)
    found = check_toolchain()
    print("build_sage2: toolchain " + ", ".join(f"{k} {v}" for k, v in found.items()))
    if args.check:
        return 0
    if args.src is None or args.out is None:
        ap.error("--src and --out are needed to build")
    wheel = build(args.src, args.out, args.jobs, found["libcuda"].split())
    print(f"build_sage2: built {wheel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
