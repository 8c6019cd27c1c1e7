"""The client side of ``scripts/bench/bench_serving.py``: the request it posts, closed-loop
load (N requests in flight, each client posting its next one when its last completed), and
the fidelity probe's pixels."""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from contracts.pipelines import TASK_SPECS

# Default request geometry: tiny models on a CPU, real sizes with --arch.
TINY_SIZE = {"wan_t2v": (32, 32, 9), "wan_i2v": (32, 32, 9), "qwen_t2i": (64, 64, 1),
             "qwen_i2i_plus": (32, 32, 1), "wan22_a14b_t2v": (32, 32, 9),
             "wan22_a14b_i2v": (32, 32, 9), "wan22_5b_t2v": (64, 64, 9),
             "wan22_5b_i2v": (64, 64, 9)}
# Wan2.2-TI2V-5B: its published 1280x704 at 121 frames.
REAL_SIZE = {"wan_t2v": (480, 832, 81), "wan_i2v": (480, 832, 81), "qwen_t2i": (1024, 1024, 1),
             "qwen_i2i_plus": (1024, 1024, 1), "wan22_a14b_t2v": (480, 832, 81),
             "wan22_a14b_i2v": (480, 832, 81), "wan22_5b_t2v": (704, 1280, 121),
             "wan22_5b_i2v": (704, 1280, 121)}


def post(url: str, kind: str, body: Mapping[str, Any], timeout: float) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/tasks/{kind}/", json=dict(body), timeout=60)
    r.raise_for_status()
    task_id = r.json()["task_id"]
    deadline = time.monotonic() + timeout
    while True:
        st: dict[str, Any] = httpx.get(f"{url}/v1/tasks/{task_id}/status", timeout=60).json()
        if st["status"] in ("completed", "failed", "cancelled"):
            if st["status"] != "completed":
                raise RuntimeError(f"task {task_id} {st['status']}: {st.get('error')}")
            return st
        if time.monotonic() > deadline:
            raise TimeoutError(f"task {task_id} still {st['stage']} after {timeout} s")
        time.sleep(0.02)


def closed_loop(urls: list[str], kind: str, body: Mapping[str, Any], conc: int, n: int,
                timeout: float, seed0: int, prompt: str) -> list[dict[str, Any]]:
    """``n`` requests, ``conc`` in flight; request i goes to ``urls[i % len(urls)]``."""
    lock = threading.Lock()
    next_index = [0]
    statuses: list[dict[str, Any]] = []

    def client() -> None:
        while True:
            with lock:
                i = next_index[0]
                if i >= n:
                    return
                next_index[0] += 1
            st = post(urls[i % len(urls)], kind,
                      {**body, "prompt": f"{prompt} {seed0 + i}", "seed": seed0 + i}, timeout)
            with lock:
                statuses.append(st)

    with ThreadPoolExecutor(conc) as pool:
        for fut in [pool.submit(client) for _ in range(conc)]:
            fut.result()
    return statuses


def percentile(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(np.asarray(values), q))


def fetch_pixels(url: str, task_id: str, kind: str) -> Any:
    import io

    import numpy as np

    data = httpx.get(f"{url}/v1/tasks/{task_id}/result", timeout=120).content
    if kind == "image":
        from PIL import Image

        return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    from workers.models.media import read_mp4

    return read_mp4(data)


def request_body(args: argparse.Namespace) -> tuple[dict[str, Any], tuple[int, int, int]]:
    """The request every client posts (its prompt and seed vary), and its geometry."""
    sizes = REAL_SIZE if args.arch else TINY_SIZE
    height, width, frames = sizes[args.pipeline]
    height, width = args.height or height, args.width or width
    frames = args.frames or frames
    body: dict[str, Any] = {"height": height, "width": width, "infer_steps": args.steps}
    spec = TASK_SPECS[args.pipeline]
    if spec.output == "video":
        body.update(target_video_length=frames, target_fps=16)
    if spec.needs_image:
        from scripts.bench.bench_inputs import input_images

        body["image_path"] = input_images(args.images if spec.multi_image else 1, height,
                                          width)
    return body, (height, width, frames)


def compare_probes(a: Any, b: Any) -> dict[str, Any]:
    """Pixels of two modes' fidelity probes (the same request): equal, or how far apart."""
    import numpy as np

    x, y = (np.asarray(p, dtype=np.int16) for p in (a, b))
    same = x.shape == y.shape
    return {"same_shape": same, "max_abs_diff": int(np.abs(x - y).max()) if same else None,
            "equal": bool(same and np.array_equal(x, y))}
