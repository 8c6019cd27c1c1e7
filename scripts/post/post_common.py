"""Shared body of the request scripts ``scripts/post/post_<pipeline>.py``.

Posts one task to a controller's front door, shows the denoising steps as a progress bar
driven by the task's server-sent events (``GET /v1/tasks/{id}/events``: the stage name in the
bar's description, a tick per step; a controller without them is polled), downloads the
result when the task completes and prints its path on stdout. On failure it exits 1 with the
server's error message; 130 on Ctrl+C (the task goes on on the server; the message says how
to cancel it). The HTTP side is :mod:`diffring_cli.client`, which ``diffring submit`` uses
too.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from contracts.pipelines import TaskSpec, task_spec
from diffring_cli.client import SMALL_REQUESTS, RequestFailed, encode_image, run_task
from diffring_cli.target import NoTarget, front_door


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
        Pipeline(
            task_spec("qwen_i2i_plus"),
            port=8016,
            prompt="The person from Picture 1 wears the jacket from Picture 2, same pose.",
        ),
    )
}


def parse_args(p: Pipeline, argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=f"Post a {p.name} task to a diffring controller and fetch the result."
    )
    ap.add_argument(
        "--url",
        default=os.environ.get("DIFFRING_URL"),
        help=f"controller front door (default: $DIFFRING_URL, else the {p.name} group started "
        f"on this machine, else http://127.0.0.1:{p.port})",
    )
    ap.add_argument("--prompt", default=p.prompt)
    ap.add_argument("--small", action="store_true",
                    help="a small request (a few steps, a tiny size): seconds on a tiny "
                    "model on a CPU; the defaults (50 steps, full size) take minutes there")
    ap.add_argument("--negative-prompt", default=None)
    if p.needs_image:
        ap.add_argument(
            "--image", required=True, type=Path, action="append" if p.spec.multi_image
            else "store", help="input image file (sent as base64)" + (
                "; repeat it for Picture 2, 3, ..." if p.spec.multi_image else ""),
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
    ap.add_argument("--poll-interval", type=float, default=0.5,
                    help="status polling interval, for controllers without the events route")
    ap.add_argument("--api-key", default=os.environ.get("DIFFRING_API_KEY"),
                    help="the front door's API key, if it has one (default: $DIFFRING_API_KEY)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap.parse_args(argv)


def request_body(p: Pipeline, args: argparse.Namespace) -> dict[str, Any]:
    """The JSON body of ``POST /v1/tasks/{kind}/`` (LightX2V's field names)."""
    body: dict[str, Any] = dict(SMALL_REQUESTS[p.name]) if args.small else {}
    body["prompt"] = args.prompt
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
        images = args.image if isinstance(args.image, list) else [args.image]
        encoded = [encode_image(i) for i in images]
        body["image_path"] = encoded[0] if len(encoded) == 1 else encoded
    return body


def run(p: Pipeline, args: argparse.Namespace) -> Path:
    return run_task(args.url, p.kind, request_body(p, args), args.out, args.timeout,
                    args.quiet, args.poll_interval, api_key=args.api_key)


def main(pipeline: str, argv: list[str] | None = None) -> int:
    p = PIPELINES[pipeline]
    args = parse_args(p, argv)
    try:
        args.url, _why = front_door(args.url, None, p.name, f"http://127.0.0.1:{p.port}")
    except NoTarget as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        path = run(p, args)
    except RequestFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except httpx.HTTPError as exc:
        print(
            f"error: cannot talk to the controller at {args.url}: {exc} "
            f"(is the group running? `diffring group {p.name} --model-path DIR`, or "
            "scripts/server/disagg/)",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        return 130
    print(path)
    return 0
