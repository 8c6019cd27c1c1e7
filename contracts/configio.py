"""The strict reader every configuration section uses: a JSON object to a frozen dataclass.

Values are checked loosely against the field annotations (an int is accepted for a float, a
list for a tuple); an unknown key is an error that names it and lists the known ones; keys
kept only for compatibility are dropped with a logged reason. Validation of the values
themselves is each dataclass's ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
import logging
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from contracts.errors import ConfigError

log = logging.getLogger("diffring.config")

T = TypeVar("T")


def _check_type(value: Any, hint: Any, where: str) -> Any:
    """Loose type check of one JSON value against a dataclass field annotation."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_type(value, arg, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r}")
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool):
        if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
            raise ConfigError(f"{where}: expected {hint.__name__}, got {value!r}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return tuple(value) if origin is tuple else list(value)
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected an object, got {value!r}")
        return value
    return value


def file_fields(cls: type) -> set[str]:
    """The fields of dataclass ``cls`` a file may set (a field with ``metadata
    {"from_file": False}`` is filled by the reader itself)."""
    assert dataclasses.is_dataclass(cls)
    return {f.name for f in dataclasses.fields(cls)
            if f.init and f.metadata.get("from_file", True)}


def from_mapping(
    cls: type[T],
    data: Mapping[str, Any] | None,
    where: str,
    ignored: Mapping[str, str] | None = None,
    hints: Mapping[str, str] | None = None,
) -> T:
    """Build frozen dataclass ``cls`` from a JSON object, naming every unknown key at once.

    ``ignored``: keys accepted for compatibility and dropped, with the reason to log.
    ``hints``: where an unknown key's setting lives instead (key -> "request_defaults.x").
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected an object, got {data!r}")
    data = dict(data)
    assert dataclasses.is_dataclass(cls)
    types_ = typing.get_type_hints(cls)
    fields = file_fields(cls)
    kwargs: dict[str, Any] = {}
    unknown: list[str] = []
    for key, value in data.items():
        if key in fields:
            try:
                kwargs[key] = _check_type(value, types_[key], f"{where}.{key}")
            except ConfigError as exc:
                unknown.append(str(exc))
        elif ignored and key in ignored:
            log.warning("config %s.%s is ignored: %s", where, key, ignored[key])
        else:
            hint = (hints or {}).get(key)
            unknown.append(f"unknown config key {where}.{key}"
                           + (f": it lives in {hint}" if hint else ""))
    if unknown:
        known = ", ".join(sorted(fields))
        listed = any(line.startswith("unknown") for line in unknown)
        raise ConfigError("; ".join(unknown) + (f" (known keys of {where}: {known})"
                                                if listed else ""))
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
