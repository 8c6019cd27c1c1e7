"""Start one diffring service.

    python run_service.py --service controller|encoder|transformer|decoder|all [--config FILE]

The environment is read here, once, and handed down; nothing below reads it again.
Precedence: command line > environment > config file > defaults.

    python run_service.py --service ROLE --config FILE --check   # check, start nothing

Environment: DIFFRING_CONFIG (config file), DIFFRING_MODEL_PATH, DIFFRING_DEVICE,
DIFFRING_CLUSTER_TOKEN, DIFFRING_API_KEY (front door), DIFFRING_FAULTS (fault points to arm:
contracts/faults.py), MOONCAKE_CONFIG_PATH and the MOONCAKE_* overrides of the Mooncake
config (MOONCAKE_PROTOCOL, MOONCAKE_METADATA_SERVER, MOONCAKE_DEVICE_NAME,
MOONCAKE_LOCAL_HOSTNAME).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import NoReturn

from contracts import faults
from contracts.cluster_token import require_token
from contracts.config import ServiceConfig
from contracts.errors import DiffringError
from contracts.pipelines import task_spec
from contracts.roles import Role

SERVICES = ("controller", *(role.value for role in Role), "all")
ENV_VARS = (
    "DIFFRING_CONFIG",
    "DIFFRING_MODEL_PATH",
    "DIFFRING_DEVICE",
    "DIFFRING_CLUSTER_TOKEN",
    "DIFFRING_API_KEY",
    "DIFFRING_FAULTS",
    "MOONCAKE_CONFIG_PATH",
    "MOONCAKE_LOCAL_HOSTNAME",
    "MOONCAKE_METADATA_SERVER",
    "MOONCAKE_PROTOCOL",
    "MOONCAKE_DEVICE_NAME",
)
"""Every environment variable a service reads (here, once; deployment manifests are checked
against this list)."""
_MODE_ALIASES = {"decode": "decoder", "encode": "encoder"}


def _parse(argv: list[str] | None, prog: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--service", choices=SERVICES, help="role; defaults to the file's disagg_mode")
    p.add_argument("--config", "--config_json", help="JSON config file (diffring's keys, or a "
                   "LightX2V stage config: its keys are mapped, --check lists how)")
    p.add_argument("--model_cls", "--model-cls", help="model family (LightX2V's flag; wins "
                   "over the file's model_cls)")
    p.add_argument("--task", help="task within the family (LightX2V's flag: t2v, i2v, t2i, "
                   "i2i, i2i_plus; wins over the file's task)")
    p.add_argument("--host", help="front-door bind address (controller, all)")
    p.add_argument("--port", type=int, help="front-door port (controller, all)")
    p.add_argument("--metric_port", "--metric-port", type=int, help="Prometheus metrics port")
    p.add_argument("--model_path", "--model-path", help="model folder (workers, all)")
    p.add_argument("--device", help="cpu or cuda:N (workers, all)")
    p.add_argument("--devices", help="transformer group: one device per rank, e.g. "
                   "cuda:0,cuda:1 (layout: the transformer section's parallel)")
    p.add_argument("--log-level", default="INFO")
    p.add_argument(
        "--check",
        action="store_true",
        help="check this service's configuration (addresses, ports, token, RDMA devices, "
        "Mooncake, model folder, device) and exit: 0 when nothing fails",
    )
    return p.parse_args(argv)


def build_config(args: argparse.Namespace, env: dict[str, str]) -> tuple[str, ServiceConfig]:
    """Merge command line > environment > file > defaults into (service, config)."""
    import dataclasses

    given = {k: v for k, v in (("model_cls", args.model_cls), ("task", args.task)) if v}
    cfg = ServiceConfig.load(args.config or env.get("DIFFRING_CONFIG"), role=args.service,
                             overrides=given)
    service = args.service or _MODE_ALIASES.get(cfg.disagg_mode or "", cfg.disagg_mode)
    if service not in SERVICES:
        raise DiffringError(
            f"no service given: pass --service {'|'.join(SERVICES)} or set disagg_mode in the "
            "config file"
        )
    server = cfg.server
    if args.host or args.port is not None or args.metric_port is not None:
        server = dataclasses.replace(
            server,
            host=args.host or server.host,
            port=args.port if args.port is not None else server.port,
            metric_port=args.metric_port if args.metric_port is not None else server.metric_port,
        )
    if env.get("DIFFRING_API_KEY"):
        try:
            server = dataclasses.replace(server, api_key=env["DIFFRING_API_KEY"])
        except DiffringError as exc:
            raise DiffringError(f"DIFFRING_API_KEY: {exc}") from None
    changes: dict[str, object] = {"server": server}
    if args.devices:
        if service != "transformer":
            raise DiffringError("--devices starts a transformer group: use it with --service "
                                "transformer")
        changes["devices"] = tuple(d.strip() for d in args.devices.split(",") if d.strip())
    if service == "all" and cfg.transformer.layout.size > 1:
        raise DiffringError("a transformer group (transformer.parallel) runs as --service "
                            "transformer; the one-process baseline has one device")
    # Each setting: command line, else environment, else the file (already in cfg).
    for key, flag, var in (
        ("model_path", args.model_path, "DIFFRING_MODEL_PATH"),
        ("device", args.device, "DIFFRING_DEVICE"),
        ("mooncake_config_path", None, "MOONCAKE_CONFIG_PATH"),
        ("faults", None, "DIFFRING_FAULTS"),
    ):
        value = flag or env.get(var)
        if value:
            changes[key] = value
    # replace() re-runs __post_init__, so a bad DIFFRING_FAULTS is a ConfigError too.
    return service, dataclasses.replace(cfg, **changes)  # type: ignore[arg-type]


def _addresses(service: str, cfg: ServiceConfig, env: dict[str, str]) -> dict[str, str]:
    """What ``service`` binds, advertises or joins; a worker (and the controller of an
    image pipeline) also advertises its Mooncake address to peers."""
    out = cfg.addresses(service)
    if service == "all" or (service == "controller" and not task_spec(cfg.pipeline).takes_image):
        return out
    from tensorplane.engine import MooncakeSettings

    host = MooncakeSettings.resolve(cfg.mooncake_config_path, env,
                                     service=cfg.mooncake).local_hostname
    if host.count(":") == 1:  # host:port (etcd / http metadata)
        host = host.split(":")[0]
    out["mooncake local_hostname"] = host
    return out


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """``python run_service.py`` (``prog``: the name its help shows, e.g. ``diffring
    serve``)."""
    args = _parse(argv, prog)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    env = dict(os.environ)
    try:
        service, cfg = build_config(args, env)
        token = cfg.disagg_config.resolve_token(env)
        if args.check:  # reports the token (and everything else) instead of refusing
            from doctor import format_report, run_checks

            checks = run_checks(service, cfg, token, env)
            print(format_report(service, checks))
            return 1 if any(c.status == "fail" for c in checks) else 0
        require_token(token, _addresses(service, cfg, env), service)
        _log_lightx2v(cfg)
        faults.configure(cfg.faults)
        if service == "controller":
            from controller.main import run_controller

            return run_controller(cfg, token, env)
        if service == "all":
            # The baseline composes the controller with in-process model stages: the one
            # place that imports both sides.
            from baseline import run_all

            return run_all(cfg, token, env)
        from workers.main import run_worker

        return _leave(run_worker(Role(service), cfg, token, env))
    except DiffringError as exc:
        logging.getLogger("diffring").error("%s", exc)
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _log_lightx2v(cfg: ServiceConfig) -> None:
    """What each LightX2V key of the file became, in the service's log at start: a key
    ignored is a warning (the operator set it for a reason), a mapped one information
    (``--check`` prints the same lines)."""
    log = logging.getLogger("diffring.config")
    for note in cfg.lightx2v:
        if note.to is None:
            log.warning("config %s is ignored: %s", note.key, note.why)
        else:
            log.info("config %s", note.line())


def _leave(status: int) -> NoReturn:
    """End a worker process once it has stopped cleanly, skipping the interpreter's
    teardown: tearing down torch, diffusers and transformers module by module costs seconds
    of CPU (about 2 s on a busy 2-core machine) after every stop, and by now the worker has
    closed all it holds itself (engine, pools, connections, a group's rank processes).
    Not for ``all``: the front door's decoding processes are stopped at interpreter exit."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
