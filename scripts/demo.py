#!/usr/bin/env python
"""The main job: the whole three-stage pipeline on tiny local models, for all four tasks.

For each of Wan2.1 T2V, Wan2.1 I2V, Qwen-Image T2I and Qwen-Image-Edit I2I: start a
controller and one encoder, transformer and decoder worker (separate processes, rings over
tcp, tensors over Mooncake), post one request over HTTP, wait for it, and print where the
PNG / MP4 landed. Tiny random-weight models of the real architectures are built locally
first (nothing is downloaded). Every process started here is stopped here.
"""

from __future__ import annotations

import argparse
import base64
import io
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from contracts.pipelines import task_spec
from launcher import LocalGroup, group_config, submit
from scripts import ROOT

# One small request per pipeline; whether it is a video and takes an input image is the
# pipeline's own (contracts.pipelines).
REQUESTS: dict[str, dict[str, Any]] = {
    "wan_t2v": {"prompt": "a paper boat drifting on a pond", "height": 32, "width": 32,
                "target_video_length": 9, "infer_steps": 4, "target_fps": 8},
    "wan_i2v": {"prompt": "the picture comes alive", "height": 32, "width": 32,
                "target_video_length": 9, "infer_steps": 4, "target_fps": 8},
    "qwen_t2i": {"prompt": "a lighthouse at dusk", "height": 64, "width": 64, "infer_steps": 4},
    "qwen_i2i": {"prompt": "make it winter", "height": 32, "width": 32, "infer_steps": 4},
}


def input_image() -> str:
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:64, 0:64]
    rgb = np.stack([x * 4, y * 4, (x + y) * 2], axis=-1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=str(ROOT / "out" / "demo"))
    ap.add_argument("--pipelines", default=",".join(REQUESTS))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = ROOT / "out" / "tiny-models"
    print(f"building tiny models in {models} ...", flush=True)
    from modelkit.tiny import build_all

    build_all(models, seed=0)

    results: list[tuple[str, str, float]] = []
    for pipeline in args.pipelines.split(","):
        spec, body = task_spec(pipeline), REQUESTS[pipeline]
        kind = spec.output
        if spec.needs_image:
            body = {**body, "image_path": input_image()}
        workdir = out / "work" / pipeline
        shutil.rmtree(workdir, ignore_errors=True)
        workdir.mkdir(parents=True)
        group = LocalGroup(group_config(pipeline, str(models / pipeline), workdir), workdir)
        print(f"[{pipeline}] starting controller + encoder + transformer + decoder ...",
              flush=True)
        t0 = time.monotonic()
        try:
            group.start_all()
            st = submit(group.url, kind, {**body, "seed": 42}, timeout=600)
        except Exception:
            for svc in group.services:
                print(f"--- {svc.role} log ---\n{svc.log()[-2000:]}", file=sys.stderr)
            raise
        finally:
            group.stop()
        if st["status"] != "completed":
            print(f"[{pipeline}] {st['status']}: {st['error']}", file=sys.stderr)
            return 1
        src = Path(group.config["output_dir"]) / st["save_result_path"]
        dst = out / f"{pipeline}{src.suffix}"
        shutil.copyfile(src, dst)
        results.append((pipeline, str(dst), time.monotonic() - t0))
        print(f"[{pipeline}] completed: {dst}", flush=True)
    print("\nresults:")
    for pipeline, path, secs in results:
        print(f"  {pipeline:9} {path}  ({secs:.1f} s including start-up)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
