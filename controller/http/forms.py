"""Nested fields of a multipart form, as clients send ``extra_body`` and friends.

A JSON body carries ``loras: [{name, strength}]`` and ``cache: {kind, ...}`` as they are; a
multipart one (image edits, videos with an input image) flattens them in brackets, and
clients do not agree on the order of a list of objects:

- the ``openai`` package groups the parts by key (it collects each key's values into one
  list before httpx writes them): ``loras[][name]=a``, ``loras[][name]=b``,
  ``loras[][strength]=0.5``, ``loras[][strength]=1``;
- a hand-written form (``curl -F``, qs-style serialisers) alternates them item by item:
  ``loras[][name]=a``, ``loras[][strength]=0.5``, ``loras[][name]=b``;
- some index them: ``loras[0][name]=a``, ``loras[1][strength]=1``.

:func:`nest` reads all three. Grouped lists are paired by position, which is only sound when
every key has a value for every item: with two names and one strength, the grouped order
cannot say whose strength it is (``[{a, 0.5}, {b}]`` and ``[{a}, {b, 0.5}]`` are sent the
same), so such a form is refused (:class:`FormError`) instead of guessing. Each nested value
is read as JSON when it is JSON (numbers, ``true``), else as the text it is; a plain field
holding a JSON list or object (``curl -F 'loras=[{"name": "a"}]'``) is read as JSON too.
Hand-written because the form parser (python-multipart, through Starlette) returns flat
key/value pairs only, and no kept library reads the grouped order back.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

_PART = re.compile(r"\[([^\[\]]*)\]")
NESTED = ("loras", "cache")
"""The fields that may arrive nested."""
TEXT_KEYS = ("name", "kind")
"""Nested keys whose values stay text ("123" too): names, never numbers."""


class FormError(ValueError):
    """A nested form field that cannot be read unambiguously; the message says how to send
    it instead. ``param`` is the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _leaf(text: Any) -> Any:
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


Entry = tuple[list[str], Any]
"""A bracket path below the field (``['', 'name']`` for ``loras[][name]``) and its value."""


def _build(where: str, entries: list[Entry]) -> Any:
    """The value that ``entries`` (all below ``where``) spell, refusing what is ambiguous."""
    if all(not path for path, _ in entries):
        if len(entries) > 1:
            raise FormError(where.split("[", 1)[0], f"{where} is given {len(entries)} times")
        return entries[0][1]
    if any(not path for path, _ in entries):
        raise FormError(where.split("[", 1)[0],
                        f"{where} is given both as a value and as nested fields")
    heads = [path[0] for path, _ in entries]
    if all(h == "" for h in heads):
        return _list(where, [(path[1:], value) for path, value in entries])
    if all(h.isdigit() for h in heads):  # loras[0][name]: an indexed list
        by_index = _grouped(entries)
        indexes = sorted(int(i) for i in by_index)
        if indexes != list(range(len(indexes))):
            raise FormError(where.split("[", 1)[0], f"{where}: list indexes must be 0, 1, ... "
                            f"without gaps, got {', '.join(map(str, indexes))}")
        return [_build(f"{where}[{i}]", by_index[str(i)]) for i in indexes]
    if any(h == "" or h.isdigit() for h in heads):
        raise FormError(where.split("[", 1)[0],
                        f"{where} mixes list items ([] or [0]) with named keys")
    return {key: _build(f"{where}[{key}]", sub) for key, sub in _grouped(entries).items()}


def _grouped(entries: list[Entry]) -> dict[str, list[Entry]]:
    """``entries`` by their first key (first-seen order), each with the rest of its path."""
    out: dict[str, list[Entry]] = {}
    for path, value in entries:
        out.setdefault(path[0], []).append((path[1:], value))
    return out


def _list(where: str, entries: list[Entry]) -> list[Any]:
    """A ``[]`` list: plain values in order, or objects in grouped or alternating order."""
    if all(not path for path, _ in entries):
        return [value for _, value in entries]
    field = where.split("[", 1)[0]
    if any(len(path) != 1 or path[0] == "" or path[0].isdigit() for path, _ in entries):
        raise FormError(field, f"{where}[] items must be flat objects ({where}[][key]=value); "
                        f"send {field} as one JSON-encoded form field instead")
    keys = [path[0] for path, _ in entries]
    runs = [key for key, _ in itertools.groupby(keys)]
    items: list[dict[str, Any]] = []
    if len(runs) == len(set(runs)):
        # Each key in one run: the grouped order (or a single item, which reads the same).
        values = {key: [v for path, v in entries if path[0] == key] for key in runs}
        counts = {key: len(vs) for key, vs in values.items()}
        if len(set(counts.values())) > 1:
            said = ", ".join(f"{n} {key!r}" for key, n in counts.items())
            raise FormError(field, (
                f"{field}: the form gives {said}; sent grouped by key (as the openai package "
                f"sends extra_body lists in a multipart request), which item each value "
                f"belongs to is lost. Give every item every key (e.g. each adapter its "
                f"strength, 1.0 by default), or send {field} as one JSON-encoded form field"))
        n = next(iter(counts.values()))
        items = [{key: values[key][i] for key in runs} for i in range(n)]
    else:  # alternating: an item ends where one of its keys comes again
        for key, value in ((path[0], v) for path, v in entries):
            if not items or key in items[-1]:
                items.append({})
            items[-1][key] = value
    return items


def nest(fields: dict[str, Any], items: list[tuple[str, Any]]) -> dict[str, Any]:
    """``fields`` (plain form fields) with the bracketed ``items`` folded in; raises
    :class:`FormError` for a nested field whose structure the form does not fix."""
    out = dict(fields)
    for name in NESTED:
        value = out.get(name)
        if isinstance(value, str) and value.lstrip().startswith(("[", "{")):
            out[name] = _leaf(value)
    by_field: dict[str, list[Entry]] = {}
    for key, value in items:
        base = key.split("[", 1)[0]
        path = _PART.findall(key[len(base):])
        text = bool(path) and path[-1] in TEXT_KEYS
        by_field.setdefault(base, []).append((path, value if text else _leaf(value)))
    for base, entries in by_field.items():
        if base in out:
            raise FormError(base, f"{base} is given both as one field and as nested fields")
        out[base] = _build(base, entries)
    return out
