"""The ``diffring`` command: one command for a group's whole life.

    diffring group PIPELINE --model-path DIR [...]   start a group here (python -m launcher)
    diffring serve --service ROLE --config FILE      start one service (run_service.py)
    diffring submit --prompt TEXT [--small] [...]    post a task, follow it, save the result
    diffring status TASK | list | cancel TASK | result TASK
    diffring inspect [--config FILE] [...]           the rings of a running controller

Built on typer (click): subcommands, ``--help`` at every level and shell completion
(``--install-completion``) come with it. ``serve``, ``group`` and ``inspect`` hand every
argument to the command they stand for (``run_service``, the launcher, ``rings inspect``),
whose own ``--help`` is shown under their name here. The client commands talk HTTP only
(:mod:`diffring_cli.client`); without ``--url`` they find the front door as
:mod:`diffring_cli.target` says (the group started on this machine, first).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import httpx
import typer

from contracts.errors import ConfigError
from contracts.pipelines import task_spec
from diffring_cli import client
from diffring_cli.client import SMALL_REQUESTS, RequestFailed, encode_image
from diffring_cli.target import NoTarget, front_door

T = TypeVar("T")

app = typer.Typer(
    name="diffring", no_args_is_help=True, pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help, wrapped by click (and [default: ...] kept)
    help="Disaggregated diffusion serving: start a group or a service, submit tasks and "
    "follow them, look at the rings.")

# serve, group and inspect take their command's own arguments, --help included.
_PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}

Url = Annotated[str | None, typer.Option(
    envvar="DIFFRING_URL", show_default=False,
    help="the front door [default: the group started on this machine, else "
    "http://127.0.0.1:8000]")]
Config = Annotated[Path | None, typer.Option(
    help="a controller's config file: its front door", show_default=False)]
ApiKey = Annotated[str | None, typer.Option(
    envvar="DIFFRING_API_KEY", show_default=False,
    help="the front door's API key, if it has one")]
AsJson = Annotated[bool, typer.Option("--json", help="the server's JSON answer as it is")]


def _fail(message: str, code: int = 1) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _door(url: str | None, config: Path | None, pipeline: str | None = None) -> str:
    try:
        found, _why = front_door(url, config, pipeline)
    except (NoTarget, ConfigError) as exc:
        _fail(str(exc), 2)
    return found


def _talk(url: str, what: Callable[[], T]) -> T:
    """Run ``what()``, turning the client's failures into one line and exit status 1."""
    try:
        return what()
    except RequestFailed as exc:
        _fail(str(exc))
    except httpx.HTTPError as exc:
        _fail(f"cannot talk to the controller at {url}: {exc} (is a group running? "
              "`diffring group PIPELINE --model-path DIR`)")


def _ask(url: str | None, config: Path | None, api_key: str | None,
         call: Callable[[httpx.Client], T]) -> tuple[str, T]:
    """(the front door, ``call`` made with a client of it), failures as :func:`_talk`'s."""
    door = _door(url, config)

    def go() -> T:
        with client.connect(door, api_key) as c:
            return call(c)

    return door, _talk(door, go)


# -- the commands that stand for another ----------------------------------------------------------
@app.command(context_settings=_PASS_THROUGH, add_help_option=False)
def serve(ctx: typer.Context) -> None:
    """Start one service: the flags of run_service.py (`diffring serve --help`)."""
    import run_service

    raise typer.Exit(run_service.main(ctx.args, prog="diffring serve"))


@app.command(context_settings=_PASS_THROUGH, add_help_option=False)
def group(ctx: typer.Context) -> None:
    """Start a group on this machine (a controller, an encoder, a transformer and a decoder)
    from its role files, in the foreground until Ctrl+C: what the start scripts do
    (`diffring group --help`)."""
    from launcher.launch import main as launch

    raise typer.Exit(launch(ctx.args, prog="diffring group"))


@app.command(context_settings=_PASS_THROUGH, add_help_option=False)
def inspect(ctx: typer.Context) -> None:
    """Look at a running controller's rings (`diffring inspect --help`)."""
    from diffring_cli.inspect import main as inspect_main

    try:
        code = inspect_main(ctx.args)
    except ConfigError as exc:
        _fail(str(exc), 2)
    raise typer.Exit(code)


# -- the client commands --------------------------------------------------------------------------
def submit_body(pipeline: str, *, prompt: str, small: bool = False, **fields: Any
                ) -> dict[str, Any]:
    """The JSON body of ``POST /v1/tasks/{kind}/``: ``fields`` in LightX2V's names (those
    left None out), over the pipeline's small request when ``small``."""
    spec = task_spec(pipeline)
    if spec.output == "image":
        for name, flag in (("target_video_length", "--frames"), ("target_fps", "--fps")):
            if fields.get(name) is not None:
                raise RequestFailed(f"{flag} applies to video pipelines; {pipeline} makes "
                                    "images")
    body: dict[str, Any] = dict(SMALL_REQUESTS[pipeline]) if small else {}
    if spec.output == "image":
        body.pop("target_video_length", None)
        body.pop("target_fps", None)
    body["prompt"] = prompt
    body.update({k: v for k, v in fields.items() if v is not None})
    return body


@app.command()
def submit(
    prompt: Annotated[str, typer.Option(help="what to make (or how to edit the image)")],
    url: Url = None, config: Config = None, api_key: ApiKey = None,
    kind: Annotated[str | None, typer.Option(
        help="image or video [default: what the controller serves]",
        show_default=False)] = None,
    small: Annotated[bool, typer.Option(
        "--small", help="a small request (a few steps, a tiny size): seconds on a tiny model on a "
        "CPU")] = False,
    negative_prompt: Annotated[str | None, typer.Option()] = None,
    image: Annotated[list[Path] | None, typer.Option(
        help="input image (I2V / edit), sent as base64; repeat it for Picture 2, 3, ...")
    ] = None,
    seed: Annotated[int | None, typer.Option()] = None,
    steps: Annotated[int | None, typer.Option(help="denoising steps (infer_steps)")] = None,
    height: Annotated[int | None, typer.Option()] = None,
    width: Annotated[int | None, typer.Option()] = None,
    frames: Annotated[int | None, typer.Option(help="video: target_video_length")] = None,
    fps: Annotated[int | None, typer.Option(help="video: target_fps")] = None,
    priority: Annotated[str | None, typer.Option(help="low, normal or high")] = None,
    task_id: Annotated[str | None, typer.Option(help="client-chosen task id")] = None,
    out: Annotated[Path | None, typer.Option(
        help="result file [default: <task_id>.png / .mp4 here]", show_default=False)] = None,
    timeout: Annotated[float, typer.Option(help="seconds to wait for the task")] = 3600.0,
    wait: Annotated[bool, typer.Option(
        help="follow the task and save its result; --no-wait: print its id and return")
    ] = True,
    quiet: Annotated[bool, typer.Option(help="no progress bar or lines")] = False,
) -> None:
    """Post a task to a controller's front door, follow it (a progress bar, or lines when
    stderr is not a terminal), write the result file and print its path."""
    door = _door(url, config)

    def go() -> Path | str:
        with client.connect(door, api_key) as c:
            pipeline = client.served_pipeline(c)
        served = task_spec(pipeline).output
        if kind is not None and kind != served:
            raise RequestFailed(f"the controller at {door} serves {pipeline} ({served} "
                                f"results), not {kind}: leave --kind out")
        images = [encode_image(p) for p in image or []]
        body = submit_body(
            pipeline, prompt=prompt, small=small, negative_prompt=negative_prompt, seed=seed,
            infer_steps=steps, height=height, width=width, target_video_length=frames,
            target_fps=fps, priority=priority, task_id=task_id,
            image_path=(images[0] if len(images) == 1 else images) if images else None)
        if not wait:
            with client.connect(door, api_key) as c:
                return client.submit(c, served, body)
        return client.run_task(door, served, body, out, timeout, quiet, api_key=api_key)

    try:
        typer.echo(_talk(door, go))
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


def _show_status(st: dict[str, Any]) -> str:
    what = f"{st['status']} ({st['stage']}"
    if st.get("steps"):
        what += f", step {st['step']}/{st['steps']}"
    if st.get("waiting_for"):
        what += f", waiting for {st['waiting_for']}"
        if st.get("queue_position"):
            what += f" at position {st['queue_position']}"
    what += ")"
    lines = [f"task {st['task_id']}: {what}"]
    if st.get("attempt", 1) > 1:
        lines.append(f"  attempt {st['attempt']}")
    if st.get("worker"):
        lines.append(f"  worker {st['worker']}")
    if st.get("error") and st["status"] != "completed":
        lines.append(f"  error: {st['error']}")
    if st["status"] == "completed":
        lines.append(f"  result: {st.get('save_result_path')} (diffring result "
                     f"{st['task_id']})")
    return "\n".join(lines)


@app.command()
def status(task_id: str, url: Url = None, config: Config = None, api_key: ApiKey = None,
           as_json: AsJson = False) -> None:
    """A task's status: stage, denoising step k/n, the queue it waits in, error."""
    _, st = _ask(url, config, api_key, lambda c: client.status(c, task_id))
    typer.echo(json.dumps(st, indent=2) if as_json else _show_status(st))


@app.command(name="list")
def list_(url: Url = None, config: Config = None, api_key: ApiKey = None,
          status: Annotated[str | None, typer.Option(
              help="pending, processing, completed, failed or cancelled")] = None,
          limit: Annotated[int, typer.Option(help="how many")] = 20,
          order: Annotated[str, typer.Option(help="newest or oldest first")] = "newest",
          as_json: AsJson = False) -> None:
    """The tasks, newest first."""
    door, page = _ask(url, config, api_key, lambda c: client.list_tasks(
        c, status=status, limit=limit, order=order))
    if as_json:
        typer.echo(json.dumps(page, indent=2))
        return
    now = time.time()
    typer.echo(f"{page['total']} task(s) at {door}, {order} first:")
    for t in page["tasks"]:
        step = f"{t['step']}/{t['steps']}" if t.get("steps") else ""
        where = f"#{t['queue_position']} for {t['waiting_for']}" if t.get("waiting_for") else ""
        typer.echo(f"  {t['task_id']:<34} {t['status']:<10} {t['stage']:<9} {step:>7} "
                   f"{where:<16} {now - t['created_at']:7.0f} s ago")


@app.command()
def cancel(task_id: str, url: Url = None, config: Config = None,
           api_key: ApiKey = None) -> None:
    """Cancel a task: a queued one never starts, a running one stops at the next step."""
    _, answer = _ask(url, config, api_key, lambda c: client.cancel(c, task_id))
    typer.echo(f"task {task_id}: {answer['stop_status']} ({answer['reason']})")


@app.command()
def result(task_id: str, url: Url = None, config: Config = None, api_key: ApiKey = None,
           out: Annotated[Path | None, typer.Option(
               help="where to write it [default: <task_id>.png / .mp4 here]",
               show_default=False)] = None) -> None:
    """Save a completed task's result file and print its path."""
    typer.echo(_ask(url, config, api_key, lambda c: client.download(c, task_id, out))[1])


def main(argv: list[str] | None = None) -> int:
    """The console script (and ``python -m diffring_cli``): the exit status."""
    try:
        app(args=argv, prog_name="diffring", standalone_mode=True)
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
