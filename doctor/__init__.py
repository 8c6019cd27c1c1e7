"""``run_service.py --check``: what a service would run into, found before it starts.

    python run_service.py --service transformer --config FILE --check

Runs the checks of :mod:`doctor.checks` for one service's effective configuration (the same
merge of command line, environment and file the service itself does) and prints one line
per check: ``ok``, ``warn`` (works, but probably not what you want) or ``FAIL`` (the service
would fail, at start or at its first task). Exit status 0 without failures, 1 otherwise.

It lives at the entry layer, beside :mod:`baseline`: it reads the worker stages' component
table and the tensor plane's Mooncake settings, and binds nothing it keeps.
"""

from __future__ import annotations

from doctor.checks import Check, run_checks

__all__ = ["Check", "format_report", "run_checks"]


def format_report(service: str, checks: list[Check]) -> str:
    width = max((len(c.name) for c in checks), default=0)
    lines = [f"diffring --check: {service}"]
    for c in checks:
        mark = {"ok": "  ok", "warn": "warn", "fail": "FAIL"}[c.status]
        lines.append(f"[{mark}] {c.name.ljust(width)}  {c.detail}")
    fails = sum(c.status == "fail" for c in checks)
    warns = sum(c.status == "warn" for c in checks)
    lines.append(f"{len(checks)} checks: {fails} failed, {warns} warnings")
    return "\n".join(lines)
