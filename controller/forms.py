"""Nested fields of a multipart form, as the ``openai`` package sends ``extra_body``.

A JSON body carries ``loras: [{name, strength}]`` and ``cache: {kind, ...}`` as they are; a
multipart one (image edits, videos with an input image) flattens them in brackets:
``loras[][name]=a``, ``loras[][strength]=0.5``, ``cache[kind]=mag_cache``,
``cache[mag_ratios][]=1.0``. :func:`nest` rebuilds the structure (a list item ends where its
first key comes again) and reads each nested value as JSON when it is JSON (numbers,
``true``), else as the text it is; a plain field holding a JSON list or object (``curl -F
'loras=[{"name": "a"}]'``) is read as JSON too. Hand-written because the form parser
(python-multipart, through Starlette) returns flat key/value pairs only.
"""

from __future__ import annotations

import json
import re
from typing import Any

_PART = re.compile(r"\[([^\[\]]*)\]")
NESTED = ("loras", "cache")
"""The fields that may arrive nested."""


def _leaf(text: Any) -> Any:
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def _put(node: Any, path: list[str], value: Any) -> Any:
    """Set ``value`` at ``path`` under ``node`` (a dict, a list, or None), return the node."""
    if not path:
        return value
    key, rest = path[0], path[1:]
    if key == "":  # a list: append, or fill the last item while its keys are new
        items = node if isinstance(node, list) else []
        last = items[-1] if items else None
        if rest and isinstance(last, dict) and rest[0] not in last:
            items[-1] = _put(last, rest, value)
        else:
            items.append(_put(None, rest, value))
        return items
    obj = node if isinstance(node, dict) else {}
    obj[key] = _put(obj.get(key), rest, value)
    return obj


def nest(fields: dict[str, Any], items: list[tuple[str, Any]]) -> dict[str, Any]:
    """``fields`` (plain form fields) with the bracketed ``items`` folded in."""
    out = dict(fields)
    for name in NESTED:
        value = out.get(name)
        if isinstance(value, str) and value.lstrip().startswith(("[", "{")):
            out[name] = _leaf(value)
    for key, value in items:
        base = key.split("[", 1)[0]
        path = _PART.findall(key[len(base):])
        text = path and path[-1] in ("name", "kind")  # names stay text ("123" too)
        out[base] = _put(out.get(base), path, value if text else _leaf(value))
    return out
