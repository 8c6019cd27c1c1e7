#!/usr/bin/env python
"""Model-check the ring protocol (rings/ring.pml) with spin.

    python -m scripts.chaos.check_ring_model            # the quick set the test-suite runs
    python -m scripts.chaos.check_ring_model --long     # plus the large configurations
    python -m scripts.chaos.check_ring_model --only tcp-2x2

Every configuration is an exhaustive safety search (pan built with -DSAFETY: assertions and
invalid end states, no cycle checks) with -DCOLLAPSE state compression, which is lossless:
no hashing that could skip states, no bitstate. A positive configuration passes when pan
reports 0 errors over the full state space; a negative one (a deliberately broken variant of
the model) passes when pan reports an error. Needs spin and gcc (scripts/bootstrap.sh
installs spin).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from scripts import ROOT

MODEL = ROOT / "rings" / "ring.pml"
MEMLIM_MB = 2048


@dataclass(frozen=True)
class ModelConfig:
    name: str
    defines: tuple[str, ...]
    what: str
    expect_error: bool = False
    long: bool = False


CONFIGS = (
    ModelConfig(
        "tcp-2x2",
        ("-DFIRST_ITEMS=1",),
        "2 producers x 1 item, 2 consumers, 2 slots; any peer crashes before any round trip; "
        "one claim-timeout give-up of an idle peer's ticket",
    ),
    ModelConfig(
        "tcp-wrap",
        ("-DNCONS=1",),
        "3 items (2 + 1), 2 producers, 1 consumer, 2 slots: the ring wraps and fills; a "
        "producer crashes before any round trip; one idle give-up",
    ),
    ModelConfig(
        "rdma-2x1",
        ("-DPER_VERB", "-DFIRST_ITEMS=1", "-DNCONS=1"),
        "every verb a step (rdma): 2 producers x 1 item, 1 consumer, 2 slots; a producer "
        "crashes before any verb; one idle give-up",
    ),
    ModelConfig(
        "broken-pop",
        ("-DBROKEN_POP", "-DFIRST_ITEMS=1"),
        "negative: an orphan is claimed by a read and a write instead of a CAS",
        expect_error=True,
    ),
    ModelConfig(
        "broken-watch",
        ("-DBROKEN_WATCH", "-DFIRST_ITEMS=1"),
        "negative: the host gives an undeclared ticket up without waiting for TAKING peers",
        expect_error=True,
    ),
    ModelConfig(
        "tcp-3x2",
        ("-DMAX_IDLE=0",),
        "3 items, 2 producers, 2 consumers, 2 slots; any peer crashes before any round trip",
        long=True,
    ),
    ModelConfig(
        "tcp-3x2-idle",
        (),
        "as tcp-3x2, plus one idle give-up",
        long=True,
    ),
    ModelConfig(
        "rdma-2x2",
        ("-DPER_VERB", "-DFIRST_ITEMS=1", "-DMAX_IDLE=0"),
        "every verb a step: 2 producers x 1 item, 2 consumers; any peer crashes before any verb",
        long=True,
    ),
)


@dataclass
class ModelResult:
    config: ModelConfig
    errors: int
    states: int
    depth: int
    seconds: float
    complete: bool
    output: str

    @property
    def ok(self) -> bool:
        if self.config.expect_error:
            return self.errors > 0
        return self.errors == 0 and self.complete

    def line(self) -> str:
        verdict = "OK" if self.ok else "FAILED"
        found = f"{self.errors} error(s)" if self.errors else "no error"
        if self.errors > 0:
            scope = "stopped at the first error"
        else:
            scope = "full state space" if self.complete else "search incomplete"
        return (
            f"{verdict:6} {self.config.name:13} {found:11} {self.states:>11,} states  "
            f"depth {self.depth:>4}  {self.seconds:6.1f} s  {scope}"
        )


def tools_missing() -> str | None:
    """What to install, if spin or gcc is missing."""
    missing = [tool for tool in ("spin", "gcc") if shutil.which(tool) is None]
    if not missing:
        return None
    return (
        f"{' and '.join(missing)} not found: install the Debian packages "
        f"({' '.join(missing)}), "
        "e.g. by running scripts/bootstrap.sh"
    )


def _run(cmd: list[str], cwd: Path, timeout: float) -> str:
    proc = subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )
    out = proc.stdout + proc.stderr
    if proc.returncode != 0 and cmd[0] != "./pan":
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-2000:]}")
    return out


def check(
    config: ModelConfig, workdir: Path, timeout: float = 3600, memlim_mb: int = MEMLIM_MB
) -> ModelResult:
    """Build and run pan for one configuration in ``workdir``."""
    workdir.mkdir(parents=True, exist_ok=True)
    shutil.copy(MODEL, workdir / MODEL.name)
    t0 = time.monotonic()
    _run(["spin", *config.defines, "-a", MODEL.name], workdir, timeout)
    # -w: pan.c's own undo code trips gcc's array-bounds warnings, which say nothing here.
    # -O1: compiling pan.c at -O2 takes twice as long for no faster search at these sizes.
    _run(
        [
            "gcc",
            "-O1",
            "-w",
            "-DSAFETY",
            "-DCOLLAPSE",
            f"-DMEMLIM={memlim_mb}",
            "-o",
            "pan",
            "pan.c",
        ],
        workdir,
        timeout,
    )
    out = _run(["./pan", "-m100000"], workdir, timeout)
    seconds = time.monotonic() - t0
    errors = re.search(r"errors: (\d+)", out)
    states = re.search(r"(\d+) states, stored", out)
    depth = re.search(r"depth reached (\d+)", out)
    truncated = any(s in out for s in ("max search depth too small", "MEMLIM", "out of memory"))
    return ModelResult(
        config,
        int(errors.group(1)) if errors else -1,
        int(states.group(1)) if states else 0,
        int(depth.group(1)) if depth else 0,
        seconds,
        errors is not None and not truncated,
        out,
    )


def check_all(
    configs: list[ModelConfig], workdir: Path, jobs: int = 2, memlim_mb: int = MEMLIM_MB
) -> list[ModelResult]:
    """Run configurations ``jobs`` at a time (each is one spin, one gcc, one pan process)."""
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(lambda c: check(c, workdir / c.name, memlim_mb=memlim_mb), configs))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--long", action="store_true", help="also the large configurations")
    ap.add_argument("--only", action="append", help="run only this configuration (repeatable)")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument(
        "--memlim", type=int, default=MEMLIM_MB, help="MB per pan (the large ones need ~6000)"
    )
    args = ap.parse_args()
    problem = tools_missing()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    chosen = [
        c
        for c in CONFIGS
        if (args.only and c.name in args.only) or (not args.only and (args.long or not c.long))
    ]
    with tempfile.TemporaryDirectory(prefix="ring-model-") as tmp:
        results = check_all(chosen, Path(tmp), args.jobs, args.memlim)
    for result in results:
        print(result.line())
        print(f"       {result.config.what}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
