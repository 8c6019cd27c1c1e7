"""Shared body of the request scripts ``scripts/post_<pipeline>.py``.

Posts one task to a controller's front door, shows the denoising steps as a progress bar
(driven by polling ``GET /v1/tasks/{id}/status``: ``step`` / ``steps``, the stage name in the
bar's description), downloads the result when the task completes and prints its path on
stdout. On failure it exits 1 with the server's error message; 130 on Ctrl+C (the task goes
on on the server; the message says how to cancel it).
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

MAX_IMAGE_BYTES = 32 << 20  # the front door's limit (controller/schemas.py)
TERMINAL = ("completed", "failed", "cancelled")


REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # the request scripts run from anywhere
    sys.path.insert(0, str(REPO))

from contracts.pipelines import TaskSpec, task_spec  # noqa: E402


@dataclass(frozen=True)
class Pipeline:
    """A pipeline's example group: its front door and a sample prompt. What the pipeline
    itself is (image or video, input image or not) comes from its :class:`TaskSpec`."""

    spec: TaskSpec
    port: int  # front door of the example group (configs/disagg/)
    prompt: str

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def kind(self) -> str:
        """The front door's endpoint: ``video`` or ``image``."""
        return self.spec.output

    @property
    def needs_image(self) -> bool:
        return self.spec.needs_image


PIPELINES = {
    p.name: p
    for p in (
        Pipeline(
            task_spec("wan_t2v"),
            port=8002,
            prompt="Two anthropomorphic cats in boxing gear fight on a spotlighted stage.",
        ),
        Pipeline(
            task_spec("wan_i2v"),
            port=8004,
            prompt="The cat in the picture turns its head and looks into the camera, soft "
            "daylight.",
        ),
        Pipeline(
            task_spec("qwen_t2i"),
            port=8008,
            prompt="A coffee shop entrance with a chalkboard sign, warm morning light.",
        ),
        Pipeline(
            task_spec("qwen_i2i"),
            port=8012,
            prompt="Change the background to a snowy mountain landscape, keep the subject "
            "unchanged.",
        ),
    )
}


class RequestFailed(Exception):
    """The server refused or failed the task; the message is the server's."""


def parse_args(p: Pipeline, argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=f"Post a {p.name} task to a diffring controller and fetch the result."
    )
    ap.add_argument(
        "--url",
        default=f"http://127.0.0.1:{p.port}",
        help="controller front door (default: %(default)s)",
    )
    ap.add_argument("--prompt", default=p.prompt)
    ap.add_argument("--negative-prompt", default=None)
    if p.needs_image:
        ap.add_argument(
            "--image", required=True, type=Path, help="input image file (sent as base64)"
        )
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="denoising steps (infer_steps)")
    ap.add_argument("--height", type=int, default=None)
    ap.add_argument("--width", type=int, default=None)
    if p.kind == "video":
        ap.add_argument("--frames", type=int, default=None, help="target_video_length")
        ap.add_argument("--fps", type=int, default=None, help="target_fps")
    ap.add_argument("--task-id", default=None, help="client-chosen task id")
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="result file (default: <task_id>.png / .mp4 in this folder)",
    )
    ap.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="seconds to wait for the task (default: %(default)s)",
    )
    ap.add_argument(
        "--api-key",
        default=os.environ.get("DIFFRING_API_KEY"),
        help="the front door's API key, if it has one (default: $DIFFRING_API_KEY)",
    )
    ap.add_argument("--poll-interval", type=float, default=0.5)
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap.parse_args(argv)


def request_body(p: Pipeline, args: argparse.Namespace) -> dict[str, Any]:
    """The JSON body of ``POST /v1/tasks/{kind}/`` (LightX2V's field names)."""
    body: dict[str, Any] = {"prompt": args.prompt}
    optional = {
        "task_id": args.task_id,
        "negative_prompt": args.negative_prompt,
        "seed": args.seed,
        "infer_steps": args.steps,
        "height": args.height,
        "width": args.width,
    }
    if p.kind == "video":
        optional["target_video_length"] = args.frames
        optional["target_fps"] = args.fps
    body.update({k: v for k, v in optional.items() if v is not None})
    if p.needs_image:
        body["image_path"] = encode_image(args.image)
    return body


def encode_image(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise RequestFailed(f"cannot read --image {path}: {exc.strerror}") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise RequestFailed(f"--image {path} is {len(data)} bytes; the limit is {MAX_IMAGE_BYTES}")
    return base64.b64encode(data).decode("ascii")


def _detail(r: httpx.Response) -> str:
    try:
        detail = r.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    return f"HTTP {r.status_code}: {detail if detail is not None else r.text.strip()}"


def submit(client: httpx.Client, p: Pipeline, body: dict[str, Any]) -> str:
    r = client.post(f"/v1/tasks/{p.kind}/", json=body)
    if r.status_code != 200:
        raise RequestFailed(f"the controller refused the task: {_detail(r)}")
    task_id: str = r.json()["task_id"]
    return task_id


def status(client: httpx.Client, task_id: str) -> dict[str, Any]:
    r = client.get(f"/v1/tasks/{task_id}/status")
    if r.status_code != 200:
        raise RequestFailed(f"status of task {task_id}: {_detail(r)}")
    st: dict[str, Any] = r.json()
    return st


class Progress:
    """A tqdm bar over the denoising steps; the stage name is its description."""

    def __init__(self, task_id: str, quiet: bool) -> None:
        from tqdm import tqdm

        self.bar = tqdm(
            total=None,
            desc="queued",
            unit="step",
            disable=True if quiet else None,  # None: no bar when stderr is not a terminal
            file=sys.stderr,
            dynamic_ncols=True,
        )
        self.task_id = task_id
        self.attempt = 1
        self.stage = "queued"

    def update(self, st: dict[str, Any]) -> None:
        stage = str(st.get("stage") or st.get("status") or "?")
        steps = int(st.get("steps") or 0)
        step = int(st.get("step") or 0)
        attempt = int(st.get("attempt") or 1)
        if attempt != self.attempt:  # requeued: the steps start over on another worker
            self.attempt = attempt
            self.bar.write(f"task {self.task_id} was requeued (attempt {attempt})")
            self.bar.reset(total=steps or None)
        elif stage == "denoising" and self.stage != "denoising":
            self.bar.reset(total=steps or None)  # the step rate counts from here
        self.stage = stage
        if steps and self.bar.total != steps:
            self.bar.total = steps
        if stage in ("phase2", "decoding", "completed") and self.bar.total:
            step = int(self.bar.total)
        if step != self.bar.n:
            self.bar.n = step
        pos = st.get("queue_position")
        self.bar.set_postfix_str(f"queue position {pos}" if pos else "", refresh=False)
        desc = stage if attempt == 1 else f"{stage} (attempt {attempt})"
        self.bar.set_description_str(desc, refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def wait(
    client: httpx.Client, task_id: str, timeout: float, interval: float, quiet: bool
) -> dict[str, Any]:
    progress = Progress(task_id, quiet)
    deadline = time.monotonic() + timeout
    try:
        while True:
            st = status(client, task_id)
            progress.update(st)
            if st.get("status") in TERMINAL:
                return st
            if time.monotonic() > deadline:
                raise RequestFailed(
                    f"task {task_id} still {st.get('stage')} after {timeout:g} s; it goes on "
                    f"on the server: GET /v1/tasks/{task_id}/status"
                )
            time.sleep(interval)
    finally:
        progress.close()


def download(client: httpx.Client, task_id: str, out: Path | None) -> Path:
    with client.stream("GET", f"/v1/tasks/{task_id}/result") as r:
        if r.status_code != 200:
            r.read()
            raise RequestFailed(f"result of task {task_id}: {_detail(r)}")
        if out is None:
            ext = ".mp4" if "video" in r.headers.get("content-type", "") else ".png"
            out = Path(f"{task_id}{ext}")
        out.parent.mkdir(parents=True, exist_ok=True)
        part = out.with_name(out.name + ".part")
        with part.open("wb") as f:
            for chunk in r.iter_bytes():
                f.write(chunk)
        os.replace(part, out)  # never leave a half-written result under the real name
    return out.resolve()


def run(p: Pipeline, args: argparse.Namespace) -> Path:
    body = request_body(p, args)
    timeout = httpx.Timeout(30.0, read=120.0)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=args.url.rstrip("/"), timeout=timeout, trust_env=False,
                      headers=headers) as client:
        task_id = submit(client, p, body)
        print(f"task {task_id} accepted by {args.url}", file=sys.stderr)
        try:
            st = wait(client, task_id, args.timeout, args.poll_interval, args.quiet)
        except KeyboardInterrupt:
            print(
                f"\ninterrupted; task {task_id} goes on on the server. Cancel it with:\n"
                f"  curl -X DELETE {args.url.rstrip('/')}/v1/tasks/{task_id}",
                file=sys.stderr,
            )
            raise
        if st["status"] != "completed":
            kind = f" ({st['error_type']})" if st.get("error_type") else ""
            raise RequestFailed(
                f"task {task_id} {st['status']} at stage {st.get('stage')}{kind}: "
                f"{st.get('error') or 'no error message'}"
            )
        return download(client, task_id, args.out)


def main(pipeline: str, argv: list[str] | None = None) -> int:
    p = PIPELINES[pipeline]
    args = parse_args(p, argv)
    try:
        path = run(p, args)
    except RequestFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except httpx.HTTPError as exc:
        print(
            f"error: cannot talk to the controller at {args.url}: {exc} "
            "(is the group running? see scripts/server/disagg/)",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        return 130
    print(path)
    return 0
