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
from diffring_cli.client import SMALL_REQUESTS
from launcher import LocalGroup, group_config, submit
from scripts import ROOT

# One small request per pipeline (the `--small` of `diffring submit` and the request
# scripts); whether it is a video and takes an input image is the pipeline's own
# (contracts.pipelines).
PROMPTS = {
    "wan_t2v": "a paper boat drifting on a pond",
    "wan_i2v": "the picture comes alive",
    "qwen_t2i": "a lighthouse at dusk",
    "qwen_i2i": "make it winter",
}
REQUESTS: dict[str, dict[str, Any]] = {
    name: {"prompt": prompt, **SMALL_REQUESTS[name]} for name, prompt in PROMPTS.items()}


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

    pipelines = args.pipelines.split(",")
    build_all(models, seed=0, tasks=pipelines)

    results: list[tuple[str, str, float]] = []
    for pipeline in pipelines:
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
    print("\nmade (each by a controller and an encoder, a DiT and a decoder process, tensors "
          "handed over by Mooncake):")
    for pipeline, path, secs in results:
        print(f"  {pipeline:9} {path}  ({secs:.1f} s including start-up)")
    print(f"""
The models in {models} have random weights, so the pictures and videos are noise: what the
demo shows is the serving, not the art. Next:
  1. run a group yourself (terminal 1) and post to it (terminal 2), on this CPU:
       .venv/bin/diffring group wan_t2v --model-path {models / 'wan_t2v'}
       .venv/bin/diffring submit --small --prompt "a paper boat"
  2. while it runs, open its status page and API docs: http://127.0.0.1:8002/ and /docs
  3. run the test-suite: bash scripts/test.sh   (real checkpoints on GPUs: README.md,
     "Running a group")""")
    return 0


if __name__ == "__main__":
    sys.exit(main())
