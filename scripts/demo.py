#!/usr/bin/env python
"""The main job: a controller with its three rings, probed, inspected and soaked."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rings.config import ServiceConfig  # noqa: E402
from rings.ring import Ring  # noqa: E402
from rings.soak import run_soak  # noqa: E402
from rings.verbs import connect  # noqa: E402


def main() -> int:
    cfg = ServiceConfig()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "controller.json"
        path.write_text(json.dumps({"disagg_mode": "controller"}))
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "run_service.py"), "--config", str(path)], cwd=ROOT
        )
        try:
            d = cfg.disagg_config
            token = d.resolve_token({})
            for name in ("request", "phase1", "phase2"):
                host, port = d.ring_address(name)
                for _ in range(100):
                    try:
                        verbs = connect("tcp", host, port, layout=d.layout(name), ring=name,
                                        token=token)
                        break
                    except Exception:
                        time.sleep(0.1)
                ring = Ring(verbs)
                ring.push({"kind": "probe", "task_id": f"demo-{name}"}, timeout=5)
                print(f"ring {name}: pushed and popped {ring.pop(timeout=5)}")
                verbs.close()
            subprocess.run([sys.executable, "-m", "rings", "inspect"], cwd=ROOT, check=True)
        finally:
            proc.terminate()
            proc.wait(15)
    res = run_soak(4, 4, 20000, capacity=3)
    print(res.report())
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
