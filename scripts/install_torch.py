#!/usr/bin/env python
"""Install the CPU build of torch into this Python's environment, before the project.

    python scripts/install_torch.py [--version 2.13.0] [--index-url URL]

Run by scripts/bootstrap.sh with the virtual environment's Python, before the project is
installed (so it uses the standard library only). Why a step of its own: PyPI's ``torch`` is
the CUDA build, which brings several GB of NVIDIA wheels that a CPU machine never uses, and
the project's own ``torch>=2.4`` would take it if nothing came first. In order:

1. torch of that version already installed: nothing to do.
2. PyTorch's CPU wheel index (``--index-url``, default below) answers: install from it.
3. Otherwise (no route to it): ask pip what a plain ``pip install torch==VERSION`` would
   take here (a dry run: pip's own configuration counts, e.g. a local CPU wheel), say it --
   CPU or CUDA build, the packages, the size of the files where pip knows it -- and install
   that.

After the install it prints what is installed and its size on disk. Exit status: pip's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path
from typing import Any

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PROBE_TIMEOUT_S = 5.0


def say(msg: str) -> None:
    print(f"[torch] {msg}", flush=True)


def installed_version() -> str | None:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def reachable(index: str) -> bool:
    """Whether the index answers (one short request, not pip's retries)."""
    try:
        with urllib.request.urlopen(f"{index.rstrip('/')}/torch/", timeout=PROBE_TIMEOUT_S):
            return True
    except (urllib.error.URLError, OSError, ValueError):
        return False


def pip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pip", *args], text=True,
                          capture_output=True)


def plan(version: str) -> list[dict[str, Any]]:
    """What ``pip install torch==version`` would install here: pip's installation report
    of a dry run (``[]`` when pip cannot say)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        done = pip("install", "--dry-run", "--quiet", "--report", str(report),
                   f"torch=={version}")
        if done.returncode != 0 or not report.exists():
            return []
        items: list[dict[str, Any]] = json.loads(report.read_text()).get("install", [])
        return items


def describe(items: list[dict[str, Any]]) -> str:
    """One paragraph: the build (CPU or CUDA), the packages, the download size where the
    files are local (pip's report gives no size for a remote file)."""
    names = [f"{i['metadata']['name']} {i['metadata']['version']}" for i in items]
    cuda = any(i["metadata"]["name"].lower().startswith("nvidia-") for i in items) or any(
        "+cu" in i["metadata"]["version"] for i in items)
    size = 0
    for item in items:
        url = item.get("download_info", {}).get("url", "")
        if url.startswith("file://"):
            path = Path(urllib.request.url2pathname(url[len("file://"):]))
            size += path.stat().st_size if path.exists() else 0
    build = "a CUDA build (several GB with its NVIDIA libraries)" if cuda else "a CPU build"
    where = f"; {size / 1e6:.0f} MB of local files" if size else ""
    return f"{build}: {', '.join(names)}{where}"


def report_installed() -> None:
    """The torch now installed, its build and its size on disk (with the NVIDIA wheels and
    triton, if any came with it)."""
    total = 0
    names = []
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name == "torch" or name.startswith("nvidia-") or name == "triton":
            names.append(f"{dist.metadata['Name']} {dist.version}")
            for f in dist.files or []:
                path = Path(str(dist.locate_file(f)))
                if path.is_file():
                    total += path.stat().st_size
    version = installed_version() or "?"
    build = "CUDA" if any(n.lower().startswith("nvidia-") for n in names) or "+cu" in version \
        else "CPU"
    say(f"installed: {', '.join(sorted(names))} ({build} build), {total / 1e6:.0f} MB on disk")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", default="2.13.0")
    ap.add_argument("--index-url", default=CPU_INDEX,
                    help="PyTorch's CPU wheel index (default: %(default)s)")
    args = ap.parse_args(argv)
    have = installed_version()
    if have is not None and have.split("+")[0] == args.version:
        report_installed()
        return 0
    if reachable(args.index_url):
        say(f"installing torch=={args.version} (CPU build) from {args.index_url}")
        done = pip("install", "--quiet", "--index-url", args.index_url,
                   f"torch=={args.version}")
    else:
        items = plan(args.version)
        say(f"{args.index_url} does not answer; `pip install torch=={args.version}` takes "
            + (describe(items) if items else "what pip finds (it could not say beforehand)"))
        done = pip("install", "--quiet", f"torch=={args.version}")
    if done.returncode != 0:
        sys.stderr.write(done.stdout + done.stderr)
        return done.returncode
    report_installed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
