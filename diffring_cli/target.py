"""Which front door a client command talks to, when none is named.

In order: ``--url`` (or ``$DIFFRING_URL``); the front door of ``--config FILE`` (a
controller's config file); the group running on this machine, as recorded by the launcher
that started it (:mod:`launcher.current`: ``diffring group`` or a start script), of the
pipeline asked for when there is one; else a controller started with the defaults
(``diffring serve --service controller``: port 8000).
"""

from __future__ import annotations

from pathlib import Path

from contracts.config import ServiceConfig
from launcher.current import running
from launcher.role_files import probe_host

DEFAULT_URL = "http://127.0.0.1:8000"
"""The front door of a controller started with no config (``server.port`` 8000)."""


class NoTarget(Exception):
    """Several running groups could be meant; the message lists them."""


def front_door(url: str | None, config: Path | None = None, pipeline: str | None = None,
               default: str = DEFAULT_URL) -> tuple[str, str]:
    """(the front door's URL, where it came from: for the messages); ``default`` when
    nothing names one (a request script's: its example group's port)."""
    if url:
        return url.rstrip("/"), "--url"
    if config is not None:
        server = ServiceConfig.load(str(config)).server
        return f"http://{probe_host(server.host)}:{server.port}", f"--config {config}"
    groups = running(pipeline)
    if len(groups) == 1:
        g = groups[0]
        return g.url, f"the {g.pipeline} group started on this machine (launcher pid {g.pid})"
    if len(groups) > 1:
        listed = "; ".join(f"{g.pipeline} at {g.url}" for g in groups)
        raise NoTarget(f"{len(groups)} groups run on this machine ({listed}): pass --url")
    return default, "the default (no group runs on this machine: start one with "\
        "`diffring group`, or pass --url)"
