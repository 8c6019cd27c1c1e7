"""``diffring inspect [--config FILE] ...``: ``python -m rings inspect`` with the hosts, ports
and token of a service's configuration.

The rings know no services, so this is where a service file's ``disagg_config`` becomes the
plain values :func:`rings.inspect.main` takes; every other flag is that command's (and wins
over the file). Without ``--config`` the defaults are a default controller's. The token, as
before: ``--token``, else the file's ``cluster_token``, else ``DIFFRING_CLUSTER_TOKEN``, else
the development default.
"""

from __future__ import annotations

import argparse
import json
import os

from contracts.config import DEFAULT_TOKEN, RING_NAMES, DisaggConfig
from contracts.errors import ConfigError


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--config", default=None)
    known, rest = ap.parse_known_args(argv)
    disagg = DisaggConfig()
    if known.config:
        try:
            with open(known.config) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read config file {known.config}: {exc}") from exc
        disagg = DisaggConfig.from_dict(data.get("disagg_config"))
    from rings.inspect import main as inspect_main

    return inspect_main(
        rest,
        hosts={r: disagg.ring_address(r)[0] for r in RING_NAMES},
        ports={r: disagg.ring_address(r)[1] for r in RING_NAMES},
        token=disagg.cluster_token or os.environ.get("DIFFRING_CLUSTER_TOKEN") or DEFAULT_TOKEN,
        prog="diffring inspect",
    )
