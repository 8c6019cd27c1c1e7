"""``diffring serve | inspect | submit``.

    diffring serve --service controller|encoder|transformer|decoder|all --config FILE
    diffring inspect [--config FILE] [--controller HOST] [--slots] [--json] [--watch S]
    diffring submit --kind image|video --prompt TEXT [--image FILE] [--out FILE]

``serve`` is ``run_service.py`` (same flags, same environment); ``inspect`` is
``python -m rings inspect`` with the addresses and token of a service's file
(:mod:`diffring_cli.inspect`); ``submit`` talks to a front door over HTTP only.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import httpx

from contracts.errors import ConfigError
from diffring_cli.client import RequestFailed, encode_image, run_task

DEFAULT_URL = "http://127.0.0.1:8000"


def _submit_parser(sub: Any) -> None:
    ap = sub.add_parser(
        "submit", help="post a task, show its progress, save the result",
        description="Post a task to a controller's front door (LightX2V's task API), show a "
        "progress bar from its server-sent events, and write the result file.")
    ap.add_argument("--url", default=DEFAULT_URL, help="front door (default: %(default)s)")
    ap.add_argument("--kind", choices=("image", "video"), required=True,
                    help="what the controller makes: image (Qwen-Image) or video (Wan2.1)")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--negative-prompt", default=None)
    ap.add_argument("--image", type=Path, default=None,
                    help="input image (I2V / I2I controllers), sent as base64")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="denoising steps (infer_steps)")
    ap.add_argument("--height", type=int, default=None)
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--frames", type=int, default=None, help="video: target_video_length")
    ap.add_argument("--fps", type=int, default=None, help="video: target_fps")
    ap.add_argument("--task-id", default=None, help="client-chosen task id")
    ap.add_argument("--out", type=Path, default=None,
                    help="result file (default: <task_id>.png / .mp4 in this folder)")
    ap.add_argument("--timeout", type=float, default=3600.0,
                    help="seconds to wait for the task (default: %(default)s)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--api-key", default=os.environ.get("DIFFRING_API_KEY"),
                    help="the front door's API key, if it has one (default: $DIFFRING_API_KEY)")


def submit_body(args: argparse.Namespace) -> dict[str, Any]:
    """The JSON body of ``POST /v1/tasks/{kind}/`` from the ``submit`` flags."""
    if args.kind == "image" and (args.frames is not None or args.fps is not None):
        raise RequestFailed("--frames and --fps apply to --kind video only")
    body: dict[str, Any] = {"prompt": args.prompt}
    optional = {"task_id": args.task_id, "negative_prompt": args.negative_prompt,
                "seed": args.seed, "infer_steps": args.steps, "height": args.height,
                "width": args.width, "target_video_length": args.frames,
                "target_fps": args.fps}
    body.update({k: v for k, v in optional.items() if v is not None})
    if args.image is not None:
        body["image_path"] = encode_image(args.image)
    return body


def submit(args: argparse.Namespace) -> int:
    try:
        path = run_task(args.url, args.kind, submit_body(args), args.out, args.timeout,
                        args.quiet, api_key=args.api_key)
    except RequestFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except httpx.HTTPError as exc:
        print(f"error: cannot talk to the controller at {args.url}: {exc} (is it running? "
              "`diffring serve --service controller`)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(
        prog="diffring", description="Disaggregated diffusion serving: run a service, inspect "
        "the rings, submit a task.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="serve|inspect|submit")
    sub.add_parser("serve", add_help=False,
                   help="start a service (the flags of run_service.py; `serve --help`)")
    sub.add_parser("inspect", add_help=False,
                   help="look at a running controller's rings (`inspect --help`)")
    _submit_parser(sub)
    # serve and inspect hand every flag after their name to the command they stand for.
    if argv and argv[0] == "serve":
        import run_service

        return run_service.main(argv[1:])
    if argv and argv[0] == "inspect":
        from diffring_cli.inspect import main as inspect_main

        try:
            return inspect_main(argv[1:])
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    args = ap.parse_args(argv)
    return submit(args)
