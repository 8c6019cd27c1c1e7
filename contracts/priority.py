"""A request's priority class: the order in which the controller releases queued work, and
whether a waiting request may preempt a running one (docs/api.md, "Priorities").

Three classes, ``low`` < ``normal`` < ``high``; a request that names none is ``normal``.
Both front doors take the field (``priority`` in a task body, or in an OpenAI request's
``extra_body``); it travels with the task, not with the generation request (a priority
changes when a request runs, never what it computes).
"""

from __future__ import annotations

from typing import Any, Final

from contracts.errors import InvalidRequestError

PRIORITIES: Final[tuple[str, ...]] = ("low", "normal", "high")
"""The classes, lowest first."""
DEFAULT: Final = "normal"


def rank(priority: str) -> int:
    """0 for ``low`` .. 2 for ``high`` (higher runs first)."""
    return PRIORITIES.index(priority)


def check_priority(value: Any) -> str:
    """``value`` as a priority class (None: the default), or InvalidRequestError."""
    if value is None:
        return DEFAULT
    if value not in PRIORITIES:
        raise InvalidRequestError(f"priority must be one of {', '.join(PRIORITIES)}, "
                                  f"got {value!r}")
    return str(value)
