"""Request-level options of the DiT stage: LoRA adapters and a step cache.

A request may name LoRA adapters (``loras``: each a file stem of a ``.safetensors`` file in a
transformer worker's ``transformer.lora_dir``, with a strength) and a step cache (``cache``:
a kind and its parameters, named as diffusers names them). Both are validated here, once,
so the front door refuses (422) what no worker could serve; whether a worker *has* the
adapter or supports the cache kind for its model is the worker's to say (it reports both
when it registers, and checks again when it runs the request).

Nothing here imports a model library: the cache kinds' parameters are listed below with the
type each takes, mirroring the fields of diffusers' config classes (a test holds the two
lists equal), and the worker builds the diffusers config from them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, NoReturn

from contracts.errors import InvalidRequestError

__all__ = [
    "CACHE_KINDS",
    "LORA_NAME_RE",
    "MAX_LORAS",
    "STRENGTH_RANGE",
    "CacheSpec",
    "LoraRef",
    "parse_cache",
    "parse_loras",
]

MAX_LORAS: Final = 4
"""Adapters one request may combine."""
STRENGTH_RANGE: Final = (-4.0, 4.0)
"""Strengths a request may give an adapter (diffusers' adapter weight; 1.0 = as trained).
Outside it an adapter overwhelms the base model: a request asking for that is a mistake."""
LORA_NAME_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
"""An adapter's name: the stem of its file, no folders (it never names a path)."""

# Parameter types of the cache kinds: "float", "int", "bool", "int?" (int or None),
# "range" (two numbers, low and high), "floats" (list of numbers), "strs" (list of strings;
# "strs?" may be None), "dtype?" (a torch dtype's name or None), "format" (tensor layout).
CACHE_KINDS: Final[dict[str, tuple[str, dict[str, str]]]] = {
    "first_block_cache": ("FirstBlockCacheConfig", {"threshold": "float"}),
    "mag_cache": ("MagCacheConfig", {
        "threshold": "float", "max_skip_steps": "int", "retention_ratio": "float",
        "num_inference_steps": "int", "mag_ratios": "floats?", "calibrate": "bool",
    }),
    "taylorseer_cache": ("TaylorSeerCacheConfig", {
        "cache_interval": "int", "disable_cache_before_step": "int",
        "disable_cache_after_step": "int?", "max_order": "int",
        "taylor_factors_dtype": "dtype?", "skip_predict_identifiers": "strs?",
        "cache_identifiers": "strs?", "use_lite_mode": "bool",
    }),
    "pyramid_attention_broadcast": ("PyramidAttentionBroadcastConfig", {
        "spatial_attention_block_skip_range": "int?",
        "temporal_attention_block_skip_range": "int?",
        "cross_attention_block_skip_range": "int?",
        "spatial_attention_timestep_skip_range": "range",
        "temporal_attention_timestep_skip_range": "range",
        "cross_attention_timestep_skip_range": "range",
        "spatial_attention_block_identifiers": "strs",
        "temporal_attention_block_identifiers": "strs",
        "cross_attention_block_identifiers": "strs",
    }),
    "faster_cache": ("FasterCacheConfig", {
        "spatial_attention_block_skip_range": "int",
        "temporal_attention_block_skip_range": "int?",
        "spatial_attention_timestep_skip_range": "range",
        "temporal_attention_timestep_skip_range": "range",
        "low_frequency_weight_update_timestep_range": "range",
        "high_frequency_weight_update_timestep_range": "range",
        "alpha_low_frequency": "float", "alpha_high_frequency": "float",
        "unconditional_batch_skip_range": "int",
        "unconditional_batch_timestep_skip_range": "range",
        "spatial_attention_block_identifiers": "strs",
        "temporal_attention_block_identifiers": "strs",
        "tensor_format": "format", "is_guidance_distilled": "bool",
    }),
}
"""Cache kind -> (diffusers' config class, its parameters a request may set, with their
types). Parameters diffusers takes as Python callables (timestep callbacks, weight
schedules) are the worker's, never the request's."""
DTYPE_NAMES: Final = ("float32", "bfloat16", "float16")
_TENSOR_FORMATS: Final = ("BCFHW", "BFCHW", "BCHW")


def _fail(message: str) -> NoReturn:
    raise InvalidRequestError(message)


@dataclass(frozen=True)
class LoraRef:
    """One adapter a request asks for, and how strongly."""

    name: str
    """The adapter's file stem in the worker's ``transformer.lora_dir``."""
    strength: float = 1.0
    """diffusers' adapter weight (``set_adapters(..., weights)``): 1.0 as trained."""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "strength": self.strength}


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        _fail(f"{where} must be a finite number, got {value!r}")
    return float(value)


def parse_loras(value: Any) -> tuple[LoraRef, ...]:
    """A request's ``loras`` (a list of ``{name, strength}`` maps, or LoraRefs), checked."""
    if value is None:
        return ()
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        _fail(f"loras must be a list of {{name, strength}} objects, got {value!r}")
    out: list[LoraRef] = []
    for i, item in enumerate(value):
        where = f"loras[{i}]"
        name: Any
        strength: Any
        if isinstance(item, LoraRef):
            name, strength = item.name, item.strength
        elif isinstance(item, Mapping):
            unknown = sorted(str(k) for k in item if k not in ("name", "strength"))
            if unknown:
                _fail(f"{where}: unknown field(s) {', '.join(unknown)}; an adapter has "
                      "name and strength")
            name, strength = item.get("name"), item.get("strength", 1.0)
        else:
            _fail(f"{where} must be an object {{name, strength}}, got {item!r}")
        if not isinstance(name, str) or not LORA_NAME_RE.match(name):
            _fail(f"{where}.name must be an adapter's file name without '.safetensors' "
                  f"(letters, digits, '_', '.', '-'), got {name!r}")
        strength = _number(strength, f"{where}.strength ({name})")
        lo, hi = STRENGTH_RANGE
        if not lo <= strength <= hi:
            _fail(f"{where}.strength ({name}) must be between {lo:g} and {hi:g}, got "
                  f"{strength:g}")
        if any(r.name == name for r in out):
            _fail(f"loras names adapter {name!r} twice; give it once with its strength")
        out.append(LoraRef(name, strength))
    if len(out) > MAX_LORAS:
        _fail(f"loras: at most {MAX_LORAS} adapters per request, got {len(out)}")
    return tuple(out)


@dataclass(frozen=True)
class CacheSpec:
    """A step cache: a kind of :data:`CACHE_KINDS` and the parameters it sets (the others
    keep diffusers' defaults)."""

    kind: str
    params: tuple[tuple[str, Any], ...] = ()
    """(name, value) pairs, sorted by name; lists are tuples (hashable, msgpack-equal)."""

    @property
    def config_class(self) -> str:
        """diffusers' config class of this kind."""
        return CACHE_KINDS[self.kind][0]

    def kwargs(self) -> dict[str, Any]:
        """The parameters as keyword arguments of the config class (lists as lists)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.params}

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **self.kwargs()}


def _coerce(kind: str, value: Any, where: str) -> Any:
    if kind.endswith("?"):
        if value is None:
            return None
        kind = kind[:-1]
    if kind == "float":
        return _number(value, where)
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(f"{where} must be an integer, got {value!r}")
        return int(value)
    if kind == "bool":
        if not isinstance(value, bool):
            _fail(f"{where} must be true or false, got {value!r}")
        return value
    if kind in ("range", "floats", "strs"):
        if isinstance(value, str | bytes | Mapping) or not isinstance(value, list | tuple):
            _fail(f"{where} must be a list, got {value!r}")
        if kind == "strs":
            if not all(isinstance(v, str) for v in value):
                _fail(f"{where} must be a list of strings, got {value!r}")
            return tuple(value)
        numbers = tuple(_number(v, where) for v in value)
        if kind == "range" and (len(numbers) != 2 or numbers[0] > numbers[1]):
            _fail(f"{where} must be [low, high] with low <= high, got {value!r}")
        if kind == "floats" and not 1 <= len(numbers) <= 1000:
            _fail(f"{where} must hold 1 to 1000 numbers, got {len(numbers)}")
        return numbers
    if kind == "dtype":
        if value not in DTYPE_NAMES:
            _fail(f"{where} must be one of {', '.join(DTYPE_NAMES)} (or null), got {value!r}")
        return value
    if kind == "format":
        if value not in _TENSOR_FORMATS:
            _fail(f"{where} must be one of {', '.join(_TENSOR_FORMATS)}, got {value!r}")
        return value
    raise AssertionError(f"unknown parameter type {kind}")


def parse_cache(value: Any, where: str = "cache") -> CacheSpec | None:
    """A request's (or a worker's default) ``cache``: ``{"kind": ..., <parameters>}``, or
    None / ``{"kind": "none"}`` for no cache."""
    if value is None or isinstance(value, CacheSpec):
        return value
    if not isinstance(value, Mapping):
        _fail(f"{where} must be an object {{kind, ...parameters}}, got {value!r}")
    kind = value.get("kind")
    if kind == "none":
        if len(value) > 1:
            _fail(f"{where}: kind 'none' takes no parameters")
        return None
    if kind not in CACHE_KINDS:
        _fail(f"{where}.kind must be one of {', '.join(CACHE_KINDS)} or 'none', got {kind!r}")
    types = CACHE_KINDS[kind][1]
    params = []
    for name in sorted(str(k) for k in value if k != "kind"):
        if name not in types:
            _fail(f"{where}: {kind} has no parameter {name!r}; it takes "
                  f"{', '.join(types)}")
        params.append((name, _coerce(types[name], value[name], f"{where}.{name}")))
    spec = CacheSpec(kind, tuple(params))
    got = spec.kwargs()
    if kind == "mag_cache" and got.get("mag_ratios") is None and not got.get("calibrate"):
        _fail(f"{where}: mag_cache needs mag_ratios (the checkpoint's magnitude ratios), or "
              "calibrate: true to measure them (no step is then skipped)")
    for name in ("threshold", "retention_ratio"):
        if name in got and got[name] < 0:
            _fail(f"{where}.{name} must be >= 0, got {got[name]:g}")
    for name, v in got.items():
        if types.get(name, "").startswith("int") and isinstance(v, int) and v < 0:
            _fail(f"{where}.{name} must be >= 0, got {v}")
    return spec
