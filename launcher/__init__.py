"""The launcher: a whole group (a controller and its workers) started on this machine as
subprocesses, each by ``run_service.py``, and stopped by its pid.

* :mod:`launcher.local`: :class:`LocalGroup`, the one way the tests, the demo, the benchmarks
  and the start scripts start services; :func:`group_config`, the config a group starts from;
  :func:`submit` / :func:`wait_task`, a request through its front door.
* :mod:`launcher.ports`: free ports to hand out (``DIFFRING_PORT_RANGE``), busy ones to refuse.
* :mod:`launcher.role_files`: the four role files of a start script, loaded, checked, shifted.
* :mod:`launcher.launch`: ``python -m launcher --group PIPELINE --model-path DIR``, what the
  start scripts (``scripts/server/disagg/``) run: one group in the foreground until a signal.

It imports only the contracts (the services run in processes of their own); nothing but the
tests, the scripts and the benchmarks imports it.
"""

from launcher.local import (
    MULTI_HOST,
    LocalGroup,
    Service,
    ServiceExited,
    group_config,
    merged,
    submit,
    wait_task,
)
from launcher.ports import PORT_RANGE_ENV, free_ports, parse_port_range, port_busy

__all__ = [
    "MULTI_HOST",
    "PORT_RANGE_ENV",
    "LocalGroup",
    "Service",
    "ServiceExited",
    "free_ports",
    "group_config",
    "merged",
    "parse_port_range",
    "port_busy",
    "submit",
    "wait_task",
]
