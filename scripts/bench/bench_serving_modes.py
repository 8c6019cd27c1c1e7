"""The modes of a ``scripts/bench/bench_serving.py`` run, each one's service config, and
which modes its ratio rows compare.

A mode is ``baseline`` (one ``--service all`` process per device) or ``disagg`` (a controller
and its workers), optionally tagged so that one run can hold several modes of a kind with
settings of their own: ``--modes disagg,disagg@24g,baseline@24g`` runs the uncapped group,
a capped group and a capped baseline, one after another, in the order given.

``--set [SELECTOR:]KEY=JSON`` sets a service config field. ``KEY`` is a field of the service
file, dotted for a field of a section (``cfg_batch``, ``encoder.max_vram_gb``,
``transformer.weight_storage``); ``JSON`` its value (a string in double quotes). Without a
selector it applies to every mode; ``SELECTOR`` names the modes it applies to: a mode's name
(``disagg@24g``), its kind (``baseline``) or its tag (``24g``). Later ``--set`` items win;
sections merge field by field. ``scripts/bench/bench_stage_memory.py`` takes the same items,
its variants in place of modes.

Ratio rows (``--ratios A/B,C/D``): each of A's levels over B's at the same N (QPS, latencies,
DiT s/step). Default: every disaggregated mode over the first baseline mode.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from launcher import group_config, merged
from scripts.bench.bench_models import arch_folder

KINDS = ("baseline", "disagg")


@dataclass(frozen=True)
class Mode:
    """One mode of a run: what it starts (``kind``) and its name in tables and selectors."""

    kind: str
    tag: str | None = None

    @property
    def name(self) -> str:
        return self.kind if self.tag is None else f"{self.kind}@{self.tag}"

    def matches(self, selector: str) -> bool:
        return selector in (self.name, self.kind, self.tag)


def parse_modes(spec: str) -> list[Mode]:
    """``baseline,disagg@24g,...`` in order; refuses an unknown kind or a repeated name."""
    modes = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        kind, _, tag = item.partition("@")
        if kind not in KINDS or (_ and not tag.replace("-", "").replace("_", "").isalnum()):
            raise SystemExit(f"--modes item {item!r}: write baseline or disagg, optionally "
                             "tagged with @TAG (letters, digits, - and _), e.g. disagg@24g")
        modes.append(Mode(kind, tag or None))
    names = [m.name for m in modes]
    if not modes or len(set(names)) != len(names):
        raise SystemExit(f"--modes {spec!r}: give each mode once (tag a second one: disagg@x)")
    return modes


class Selectable(Protocol):
    """What a ``--set`` selector picks: a mode here, a variant in bench_stage_memory."""

    @property
    def name(self) -> str: ...

    def matches(self, selector: str) -> bool: ...


@dataclass(frozen=True)
class Setting:
    """One ``--set`` item: the modes it applies to (None: all) and the fields it sets."""

    selector: str | None
    fields: dict[str, Any]


def parse_set(item: str) -> Setting:
    """``[SELECTOR:]KEY=JSON`` -> its selector and ``{"section": {"field": value}}``."""
    left, eq, value = item.partition("=")
    selector, colon, key = left.partition(":")
    if not colon:
        selector, key = "", left
    parts = key.strip().split(".")
    if not eq or not all(p.strip() for p in parts) or (colon and not selector.strip()):
        raise SystemExit(f"--set {item!r}: write [SELECTOR:]KEY=JSON, e.g. cfg_batch=true or "
                         "baseline:transformer.offload='\"block\"'")
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        raise SystemExit(f"--set {item!r}: the value must be JSON (a string in double quotes, "
                         f"e.g. {key}='\"{value}\"')") from None
    fields: dict[str, Any] = {parts[-1].strip(): parsed}
    for part in reversed(parts[:-1]):
        fields = {part.strip(): fields}
    return Setting(selector.strip() or None, fields)


def settings_for(name: str, matches: Any, settings: Iterable[Setting],
                 base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``base`` with every setting whose selector ``matches`` (or that has none) merged in,
    in order."""
    out = dict(base or {})
    for s in settings:
        if s.selector is None or matches(s.selector):
            out = merged(out, s.fields)
    return out


def check_selectors(settings: Iterable[Setting], modes: Iterable[Selectable],
                    what: str = "mode") -> None:
    """Refuse a selector that names no mode (a typo would silently set nothing)."""
    modes = list(modes)
    for s in settings:
        if s.selector is not None and not any(m.matches(s.selector) for m in modes):
            raise SystemExit(f"--set {s.selector}:...: no {what} is named, of kind or tagged "
                             f"{s.selector!r} (have {', '.join(m.name for m in modes)})")


def check_service_config(cfg: Mapping[str, Any], mode: str) -> None:
    """The config a mode's services start from, through the services' own parser (what a
    service would refuse at start is refused now, naming the mode)."""
    from contracts.config import ServiceConfig
    from contracts.errors import ConfigError

    try:
        ServiceConfig.from_dict(cfg)
    except ConfigError as exc:
        raise SystemExit(f"mode {mode}: its service config is refused: {exc}") from None


def parse_ratios(spec: str | None, modes: list[Mode]) -> list[tuple[str, str]]:
    """``A/B,...`` (mode names) -> pairs; default: each disagg mode over the first baseline."""
    names = [m.name for m in modes]
    if spec is None:
        base = next((m.name for m in modes if m.kind == "baseline"), None)
        return [] if base is None else [(m.name, base) for m in modes if m.kind == "disagg"]
    pairs = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        a, slash, b = item.partition("/")
        if not slash or a not in names or b not in names or a == b:
            raise SystemExit(f"--ratios item {item!r}: write A/B with two of the modes "
                             f"({', '.join(names)})")
        pairs.append((a, b))
    return pairs


def _check_body(pipeline: str, body: Mapping[str, Any], mode: str) -> None:
    """A mode's request fields through the request's own checks (adapters, cache, sizes)."""
    from contracts.errors import InvalidRequestError
    from contracts.request import GenerationRequest

    try:
        GenerationRequest.from_dict({"task": pipeline, "prompt": "dry run", **body})
    except (InvalidRequestError, TypeError) as exc:
        raise SystemExit(f"mode {mode}: its request fields are refused: {exc}") from None


def dry_run(args: argparse.Namespace, modes: list[Mode], overrides: dict[str, dict[str, Any]],
            ratios: list[tuple[str, str]],
            bodies: Mapping[str, Mapping[str, Any]] | None = None) -> int:
    """Each mode's settings, checked by the services' own config parser; nothing starts."""
    model = args.model_path or (arch_folder(args) if args.arch else args.models / args.pipeline)
    workdir = Path(tempfile.mkdtemp(prefix="bench-dry-run-"))
    try:
        for mode in modes:
            cfg = group_config(args.pipeline, str(model), workdir, **overrides[mode.name])
            check_service_config(cfg, mode.name)
            print(f"{mode.name}: {json.dumps(overrides[mode.name], sort_keys=True)}")
            body = (bodies or {}).get(mode.name)
            if body:
                _check_body(args.pipeline, body, mode.name)
                print(f"{mode.name} requests: {json.dumps(body, sort_keys=True)}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"model: {model}" + ("" if args.model_path or not args.arch else " (built if missing)"))
    print("ratios: " + (", ".join(f"{a}/{b}" for a, b in ratios) or "none"))
    return 0
