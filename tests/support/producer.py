"""The producer process of the two-process tensor-plane tests (tests/integration/
test_transfer.py): it stages known tensors in its pool, prints their descriptors as JSON, then
serves commands on stdin; and the handle a test keeps on it (stopped by pid).

    python -m tests.support.producer SEED      (from the repository root)
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict
from typing import Any

import torch

from tensorplane.descriptor import TensorDescriptor
from tensorplane.engine import MooncakeSettings, TransferEngine
from tensorplane.handoff import stage_bytes, stage_tensors
from tensorplane.pool import StagingPool
from tests.support.paths import ROOT

IMAGE_BYTES = bytes(range(256)) * 40 + b"tail"  # odd length, stands in for an encoded image


def make_tensors(seed: int) -> dict[str, torch.Tensor]:
    """The producer's outputs; the consumer regenerates them to compare."""
    g = torch.Generator().manual_seed(seed)
    return {
        "f32": torch.randn(64, 33, generator=g),
        "bf16": torch.randn(7, 129, generator=g).to(torch.bfloat16),
        "u8": torch.randint(0, 256, (3, 50, 50), generator=g, dtype=torch.uint8),
        "i64": torch.randint(-(2**62), 2**62, (1000,), generator=g, dtype=torch.int64),
        "f32_t": torch.randn(40, 30, generator=g).t(),  # non-contiguous
        "big": torch.randn(300_000, generator=g),  # 1.2 MB: many pages
    }


def producer_main(seed: int) -> None:
    """Stage ``make_tensors(seed)`` + IMAGE_BYTES, print descriptors, then serve commands on
    stdin: ``stats`` (print pool stats), ``stage`` (stage a fresh set), ``exit``."""
    torch.set_num_threads(1)
    settings = MooncakeSettings.resolve(None, os.environ)  # the entry point reads env once
    engine = TransferEngine(settings)
    engine.start()
    pool = StagingPool(8 << 20)
    pool.start(engine)

    def stage() -> list[dict[str, Any]]:
        descs = stage_tensors(pool, engine, make_tensors(seed), task_id="t-prod")
        descs.append(stage_bytes(pool, engine, "image", IMAGE_BYTES, task_id="t-prod"))
        return [d.to_dict() for d in descs]

    print(json.dumps({"session": engine.session_id, "descs": stage()}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "stats":
            print(json.dumps(asdict(pool.stats())), flush=True)
        elif cmd == "stage":
            print(json.dumps({"descs": stage()}), flush=True)
        elif cmd == "exit":
            break
    pool.close()
    engine.close()


class Producer:
    """A producer subprocess; always stopped by pid in :meth:`stop`."""

    def __init__(self, seed: int) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")}
        env.update(
            PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
            MOONCAKE_PROTOCOL="tcp",
            MOONCAKE_LOCAL_HOSTNAME="127.0.0.1",
            MOONCAKE_METADATA_SERVER="P2PHANDSHAKE",
        )
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.producer", str(seed)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, env=env,
            cwd=ROOT,
        )
        hello = self.recv(timeout=60)
        self.session: str = hello["session"]
        self.descs = [TensorDescriptor.from_dict(d) for d in hello["descs"]]

    def recv(self, timeout: float = 10) -> Any:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            raise AssertionError(f"producer said nothing within {timeout}s; stderr:\n"
                                 f"{self.log()}")
        return json.loads(line)

    def ask(self, cmd: str) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd.encode() + b"\n")
        self.proc.stdin.flush()
        return self.recv()

    def log(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")[-4000:]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
        if sig == signal.SIGKILL:
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        self.kill(signal.SIGKILL)
        self.stderr.close()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: python -m tests.support.producer SEED (got {sys.argv[1:]})")
    producer_main(int(sys.argv[1]))
