"""LoRA adapters per request on the DiT stage, through diffusers' and PEFT's own loaders.

A transformer worker with ``transformer.lora_dir`` serves the adapters in that folder (one
``<name>.safetensors`` each; nothing is downloaded). A file is read as diffusers' pipeline
reads it (``WanLoraLoaderMixin`` / ``QwenImageLoraLoaderMixin.lora_state_dict``, which also
converts the common non-diffusers formats; Wan T2V adapters are widened for an I2V DiT as
``load_lora_weights`` does) and loaded into the DiT as a named PEFT adapter
(``load_lora_into_transformer``), never fused into the base weights.

Eager worker (:class:`LoraLibrary`): the most recently used adapters stay loaded, bounded by
a count and by their bytes. A request's set is activated with its strengths for that request
only (``enable_lora`` + ``set_adapters(names, weights)``, as a diffusers user would) and the
adapters are disabled again afterwards (``disable_lora``: every LoRA layer then computes its
base layer alone), so a request without adapters computes exactly what the base model does.

Compiled worker (:class:`HotswapSlots`): changing which adapters a compiled graph runs would
recompile it, so the DiT gets a fixed set of *slots* before it is compiled: zero adapters
over every linear layer at ``lora_max_rank`` (diffusers' ``enable_lora_hotswap(target_rank)``
then ``load_lora_adapter``), all active. A request's adapters are hot-swapped into slots
(``load_lora_adapter(..., hotswap=True)``: weights copied in place) and the strengths written
into the slots' scaling tensors in place; unused slots get strength 0. Neither changes what
the compiled code guards on, so switching never recompiles.

An adapter file replaced while loaded is noticed at its next use (its size, modification
time or inode differ from when it was read: :func:`signature`, one ``stat`` per adapter per
request) and read again, so a request gets the file that is there when it starts. Replace a
file by writing a new one beside it and renaming it over the old (``mv``), never by writing
into it: a request that starts while a file is half written reads half a file.

A file that cannot be read, is not a LoRA checkpoint, or whose keys match nothing in the DiT
fails the request that named it (:class:`~contracts.errors.AdapterError`, naming the file);
the worker serves the next request as if it had never been asked.

Wan2.2-A14B (two experts): an adapter comes as a pair, a file for the high-noise expert and
one for the low-noise expert (:func:`pairs`: ``<name>_high_noise`` / ``<name>_low_noise``,
or a sub-folder ``<name>/`` of ``high_noise_model`` / ``low_noise_model``, the published
Lightning and distill layouts); a request names the pair once and each expert gets its
half, as ``load_lora_weights(high)`` and ``load_lora_weights(low,
load_into_transformer_2=True)`` load them in diffusers. Each expert has a library of its own
(``half``); a file of no pair goes into both.

Every weight format works under the adapters (FP8 linear layers, FP8 storage, offload:
:mod:`workers.models.dit.lora_layers`). Adapters named in ``transformer.lora_fuse`` are
merged into the weights once at load instead (:func:`fuse`), before FP8 storage, offload or
FP8 linear layers are applied, and are not offered per request.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from contracts.dit_request import LORA_NAME_RE, LoraRef
from contracts.errors import AdapterError, ModelLoadError

from .lora_layers import adapter_bytes, prepare, regroup

log = logging.getLogger("diffring.lora")

LOADERS = {"wan": "WanLoraLoaderMixin", "qwen": "QwenImageLoraLoaderMixin"}
"""diffusers' LoRA loader of each model family."""


def scan(folder: Path) -> dict[str, Path]:
    """The adapters in ``folder``: file stem -> file (names a request could not give are
    left out)."""
    return {p.stem: p for p in sorted(folder.glob("*.safetensors"))
            if p.is_file() and LORA_NAME_RE.match(p.stem)}


_HIGH = re.compile(r"high_noise", re.IGNORECASE)
PAIR_FOLDER = ("high_noise_model.safetensors", "low_noise_model.safetensors")
"""The two files of a pair kept in a folder of its own (LightX2V's Wan2.2-Lightning)."""


def pairs(folder: Path) -> dict[str, tuple[Path, Path]]:
    """Wan2.2-A14B adapter pairs in ``folder``: name -> (high-noise file, low-noise file).

    A pair is two files whose stems differ only in ``high_noise`` / ``low_noise`` (any case),
    named by the stem without that word and the separator before it
    (``lightning_high_noise`` + ``lightning_low_noise``: ``lightning``;
    ``wan2.2_i2v_A14b_high_noise_lora_rank64`` + ``..._low_noise_...``:
    ``wan2.2_i2v_A14b_lora_rank64``), or a sub-folder holding
    ``high_noise_model.safetensors`` and ``low_noise_model.safetensors``, named by the
    sub-folder."""
    out: dict[str, tuple[Path, Path]] = {}
    for high in sorted(folder.glob("*.safetensors")):
        m = _HIGH.search(high.stem)
        if m is None or not high.is_file():
            continue
        word = "LOW_NOISE" if m.group().isupper() else "low_noise"
        low = high.with_name(f"{high.stem[:m.start()]}{word}{high.stem[m.end():]}.safetensors")
        start, end = m.start(), m.end()
        if start > 0 and high.stem[start - 1] in "_-.":
            start -= 1
        elif end < len(high.stem) and high.stem[end] in "_-.":
            end += 1
        name = high.stem[:start] + high.stem[end:]
        if low.is_file() and LORA_NAME_RE.match(name):
            out[name] = (high, low)
    for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
        files = (sub / PAIR_FOLDER[0], sub / PAIR_FOLDER[1])
        if all(f.is_file() for f in files) and LORA_NAME_RE.match(sub.name):
            out[sub.name] = files
    return out


def peft_name(name: str) -> str:
    """The adapter's name inside the DiT: PEFT refuses a ``.`` in an adapter name (it
    becomes a module name), and published files have them (``wan2.2_i2v_...``)."""
    return name.replace(".", "_dot_")


def scan_half(folder: Path, half: str | None) -> dict[str, Path]:
    """The adapters a DiT serves from ``folder``: every file by its stem (``half`` None: a
    one-DiT model), or for one expert of Wan2.2-A14B (``half`` "high" / "low") each pair by
    its name with that expert's file, and each file of no pair by its stem (loaded into both
    experts, as a diffusers user loads one file with and without
    ``load_into_transformer_2``)."""
    if half is None:
        return scan(folder)
    found = pairs(folder)
    taken = {p for files in found.values() for p in files}
    out = {n: p for n, p in scan(folder).items() if p not in taken}
    out.update({n: files[0 if half == "high" else 1] for n, files in found.items()})
    return dict(sorted(out.items()))


def loader_for(family: str) -> Any:
    import diffusers

    if family not in LOADERS:
        raise ModelLoadError(f"transformer.lora_dir: the {family} family has no LoRA loader")
    return getattr(diffusers.loaders.lora_pipeline, LOADERS[family])


def read_adapter(loader: Any, transformer: Any, name: str, path: Path
                 ) -> tuple[dict[str, torch.Tensor], Any]:
    """(state dict, metadata) of one adapter file, converted and widened as diffusers'
    ``load_lora_weights`` does before it loads them."""
    try:
        state, metadata = loader.lora_state_dict(str(path), return_lora_metadata=True,
                                                 local_files_only=True)
    except Exception as exc:  # safetensors, the converters and diffusers raise many types
        raise AdapterError(f"adapter {name!r} ({path}) cannot be read: "
                           f"{type(exc).__name__}: {exc}") from None
    expand = getattr(loader, "_maybe_expand_t2v_lora_for_i2v", None)
    if expand is not None:
        state = expand(transformer=transformer, state_dict=state)
    bad = [k for k in state if "lora" not in k]
    if not state or bad:
        raise AdapterError(f"adapter {name!r} ({path}) is not a LoRA checkpoint"
                           + (f" (e.g. key {bad[0]!r})" if bad else " (no tensors)"))
    return state, metadata


Signature = tuple[int, int, int]


def signature(path: Path) -> Signature:
    """What tells that a file changed without reading it: its size, its modification time
    (ns) and its inode (a file renamed over it has another)."""
    try:
        st = path.stat()
    except OSError as exc:
        raise AdapterError(f"adapter file {path} cannot be read: {exc}") from None
    return (st.st_size, st.st_mtime_ns, st.st_ino)


def file_rank(path: Path) -> int:
    """The largest LoRA rank in an adapter file, from its header (no tensor is read)."""
    from safetensors import safe_open

    rank = 1
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():
            shape = f.get_slice(key).get_shape()
            if len(shape) == 2 and ("lora_A" in key or "lora_down" in key):
                rank = max(rank, int(shape[0]))
            elif len(shape) == 2 and ("lora_B" in key or "lora_up" in key):
                rank = max(rank, int(shape[1]))
    return rank


def _lora_layers(transformer: Any) -> list[tuple[str, Any]]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [(n, m) for n, m in transformer.named_modules() if isinstance(m, BaseTunerLayer)]


class _Library:
    """What both kinds share: the folder, the loader, the request's files."""

    def __init__(self, transformer: Any, family: str, folder: Path, task: str,
                 fused: Sequence[LoraRef] = (), half: str | None = None) -> None:
        if not folder.is_dir():
            raise ModelLoadError(f"transformer.lora_dir {folder} is not a folder")
        self.half = half
        """Wan2.2-A14B: the expert this library serves (``high`` / ``low``: its half of
        each pair, :func:`scan_half`); None: a one-DiT model."""
        self.transformer = transformer
        self.loader = loader_for(family)
        self.folder = folder
        self.task = task
        self.fused = {r.name: r.strength for r in fused}
        """Adapters merged into the weights at load (not offered per request)."""
        prepare(transformer)
        self.read_as: dict[str, Signature] = {}
        """Per loaded adapter (by its name in the DiT), the file's signature when read."""

    def names(self) -> list[str]:
        """The adapters requests may name (the folder's contents now, less the fused)."""
        return sorted(n for n in scan_half(self.folder, self.half) if n not in self.fused)

    def files(self, refs: Sequence[LoraRef]) -> list[Path]:
        fused = [r.name for r in refs if r.name in self.fused]
        if fused:
            raise AdapterError(
                f"adapter {', '.join(map(repr, fused))} is fused into this worker's weights "
                f"(transformer.lora_fuse, strength {self.fused[fused[0]]:g}): every request "
                "gets it; send the request without it")
        found = {n: p for n, p in scan_half(self.folder, self.half).items()
                 if n not in self.fused}
        missing = [r.name for r in refs if r.name not in found]
        if missing:
            raise AdapterError(
                f"no adapter {', '.join(map(repr, missing))} in {self.folder}; this worker "
                f"serves {', '.join(found) or 'none'}")
        return [found[r.name] for r in refs]

    def load(self, name: str, path: Path, adapter_name: str, hotswap: bool = False) -> None:
        """Read ``path`` and load it into the DiT as ``adapter_name`` (or into that slot)."""
        seen = signature(path)  # before reading: a change meanwhile shows at the next use
        self.read_as.pop(adapter_name, None)
        state, metadata = read_adapter(self.loader, self.transformer, name, path)
        from diffusers.loaders.lora_pipeline import _LOW_CPU_MEM_USAGE_DEFAULT_LORA

        try:
            self.loader.load_lora_into_transformer(
                state, transformer=self.transformer, adapter_name=adapter_name,
                metadata=metadata, low_cpu_mem_usage=_LOW_CPU_MEM_USAGE_DEFAULT_LORA,
                hotswap=hotswap)
        except Exception as exc:  # PEFT's ValueError / RuntimeError, shape errors
            what = "cannot be hot-swapped into the compiled slots" if hotswap else \
                "does not fit this model"
            raise AdapterError(f"adapter {name!r} ({path}) {what}: {exc}") from None
        finally:
            if not hotswap:  # new layers (also those a failed load leaves): into the groups
                regroup(self.transformer)
        if adapter_name not in getattr(self.transformer, "peft_config", {}):
            raise AdapterError(f"adapter {name!r} ({path}): none of its keys match a layer "
                               f"of the {self.task} DiT (is it for another model?)")
        self.read_as[adapter_name] = seen

    def changed(self, adapter_name: str, path: Path) -> bool:
        """Whether ``path`` is no longer the file loaded as ``adapter_name``."""
        if self.read_as.get(adapter_name) == signature(path):
            return False
        log.info("adapter file %s changed since it was read; reading it again", path)
        return True

    def disable(self) -> None:
        if getattr(self.transformer, "peft_config", None):
            self.transformer.disable_lora()


class LoraLibrary(_Library):
    """Adapters loaded by name, the most recently used kept (eager DiT)."""

    def __init__(self, transformer: Any, family: str, folder: Path, task: str,
                 max_loaded: int, max_bytes: int, fused: Sequence[LoraRef] = (),
                 half: str | None = None) -> None:
        super().__init__(transformer, family, folder, task, fused, half)
        self.max_loaded = max_loaded
        self.max_bytes = max_bytes
        self.loaded: OrderedDict[str, int] = OrderedDict()
        """Loaded adapters, least recently used first, with their bytes."""

    @contextlib.contextmanager
    def applied(self, refs: Sequence[LoraRef]) -> Iterator[None]:
        """The DiT runs ``refs`` at their strengths inside, and the base model after."""
        if not refs:
            yield
            return
        files = self.files(refs)
        try:
            for ref, path in zip(refs, files, strict=True):
                self._ensure(ref.name, path, keep={r.name for r in refs})
            self.transformer.enable_lora()
            self.transformer.set_adapters([peft_name(r.name) for r in refs],
                                          weights=[r.strength for r in refs])
            yield
        finally:
            # Also after a failed load: PEFT leaves the layers it just wrapped enabled.
            self.disable()

    def _ensure(self, name: str, path: Path, keep: set[str]) -> None:
        inside = peft_name(name)
        if name in self.loaded:
            if not self.changed(inside, path):
                self.loaded.move_to_end(name)
                return
            self.transformer.delete_adapters(inside)
            del self.loaded[name]
        self._evict(keep, room_for=1)
        self.load(name, path, inside)
        size = adapter_bytes(self.transformer, inside)
        self.loaded[name] = size
        log.info("adapter %s loaded from %s (%.1f MiB; %d loaded)", name, path, size / 2**20,
                 len(self.loaded))
        self._evict(keep, room_for=0)

    def _evict(self, keep: set[str], room_for: int) -> None:
        """Unload the least recently used adapters until the count leaves ``room_for`` more
        and the bytes fit, never one of ``keep`` (the request's own: the bounds are on what
        stays loaded for later requests, so one request's set is always loaded whole)."""
        for name in list(self.loaded):
            if (len(self.loaded) + room_for <= self.max_loaded
                    and sum(self.loaded.values()) <= self.max_bytes):
                return
            if name not in keep:
                self.transformer.delete_adapters(peft_name(name))
                del self.loaded[name]
                log.info("adapter %s unloaded (least recently used)", name)


class HotswapSlots(_Library):
    """Fixed adapter slots in a DiT that is then compiled: requests swap weights in."""

    def __init__(self, transformer: Any, family: str, folder: Path, task: str,
                 slots: int, rank: int | None, fused: Sequence[LoraRef] = (),
                 half: str | None = None) -> None:
        super().__init__(transformer, family, folder, task, fused, half)
        self.rank = rank or self._largest_rank()
        self.slots = [f"diffring_slot{i}" for i in range(slots)]
        self.held: list[str | None] = [None] * slots
        """The adapter each slot holds now (None: zeros)."""
        self._order: list[int] = list(range(slots))
        """Slots, least recently used first."""
        self._base: dict[int, dict[str, float]] = {}
        """Per slot, each layer's scaling of the held adapter at strength 1 (alpha / r)."""

    def _largest_rank(self) -> int:
        return max([file_rank(p) for n, p in scan_half(self.folder, self.half).items()
                    if n not in self.fused] or [1])

    def prepare(self) -> None:
        """Before compiling: one zero adapter per slot over every linear layer, padded to
        the rank, scalings as tensors (what hot-swapping without recompiling needs)."""
        zero: dict[str, torch.Tensor] = {}
        for name, module in self.transformer.named_modules():
            if isinstance(module, torch.nn.Linear):
                # Plain zeros in the dtype the layer computes in: an FP8 layer's weight is a
                # float8 tensor (subclass), whose like-made tensors would be float8 too.
                w = module.weight
                dtype: torch.dtype = getattr(module, "compute_dtype", w.dtype)
                zero[f"transformer.{name}.lora_A.weight"] = torch.zeros(
                    self.rank, module.in_features, dtype=dtype, device=w.device)
                zero[f"transformer.{name}.lora_B.weight"] = torch.zeros(
                    module.out_features, self.rank, dtype=dtype, device=w.device)
        for i, slot in enumerate(self.slots):
            self.transformer.enable_lora_hotswap(target_rank=self.rank,
                                                 check_compiled="ignore" if i else "error")
            self.loader.load_lora_into_transformer(dict(zero), transformer=self.transformer,
                                                   adapter_name=slot)
        regroup(self.transformer)
        for _, layer in _lora_layers(self.transformer):
            layer.set_adapter(self.slots)
        self._scale({})
        self.disable()
        log.info("LoRA: %d compiled slots of rank %d over every linear layer",
                 len(self.slots), self.rank)

    def _scale(self, strengths: dict[int, float]) -> None:
        """Write each slot's scaling in place (0 for a slot the request does not use)."""
        for name, layer in _lora_layers(self.transformer):
            for i, slot in enumerate(self.slots):
                scaling = layer.scaling.get(slot)
                if isinstance(scaling, torch.Tensor):
                    base = self._base.get(i, {}).get(name, 0.0)
                    scaling.fill_(strengths.get(i, 0.0) * base)

    def _slot_for(self, name: str, path: Path, busy: set[int]) -> int:
        i = self.held.index(name) if name in self.held else None
        if i is None or self.changed(self.slots[i], path):
            try:
                rank = file_rank(path)
            except Exception as exc:  # not a safetensors file: say so as a load would
                raise AdapterError(f"adapter {name!r} ({path}) cannot be read: {exc}") from None
            if rank > self.rank:
                raise AdapterError(
                    f"adapter {name!r} ({path}) has rank {rank}, the compiled slots hold "
                    f"{self.rank}; raise transformer.lora_max_rank and restart the worker")
            if i is None:
                i = next(s for s in self._order if s not in busy)
            self.held[i] = None  # a failed swap leaves the slot's weights undefined
            self.load(name, path, self.slots[i], hotswap=True)
            self.held[i] = name
            self._base[i] = {n: float(layer.scaling[self.slots[i]])
                             for n, layer in _lora_layers(self.transformer)}
        self._order.remove(i)
        self._order.append(i)
        return i

    @contextlib.contextmanager
    def applied(self, refs: Sequence[LoraRef]) -> Iterator[None]:
        if not refs:
            yield
            return
        if len(refs) > len(self.slots):
            raise AdapterError(f"{len(refs)} adapters asked for, this compiled worker has "
                               f"{len(self.slots)} slots (transformer.lora_max_loaded)")
        files = self.files(refs)
        strengths: dict[int, float] = {}
        try:
            for ref, path in zip(refs, files, strict=True):
                strengths[self._slot_for(ref.name, path, set(strengths))] = ref.strength
            self._scale(strengths)
            self.transformer.enable_lora()
            yield
        finally:
            self.disable()

    @contextlib.contextmanager
    def warming(self) -> Iterator[None]:
        """The slots active at strength 0: what a warm-up runs to compile the adapter path."""
        self._scale({})
        self.transformer.enable_lora()
        try:
            yield
        finally:
            self.disable()


def fuse(transformer: Any, family: str, folder: Path, refs: Sequence[LoraRef],
         half: str | None = None) -> None:
    """Merge the adapters ``refs`` of ``folder`` into ``transformer``'s weights at their
    strengths and remove their layers (diffusers' ``set_adapters`` + ``fuse_lora`` +
    ``unload_lora``): the DiT is then a plain model whose weights include them. Runs at load,
    before FP8 storage, offload or FP8 linear layers are applied, so that those see the merged
    weights; a file that is missing or does not fit stops the worker's start. ``half``: the
    Wan2.2-A14B expert ``transformer`` is (its half of each pair, :func:`scan_half`)."""
    if not refs:
        return
    if not folder.is_dir():
        raise ModelLoadError(f"transformer.lora_dir {folder} is not a folder")
    loader = loader_for(family)
    found = scan_half(folder, half)
    missing = [r.name for r in refs if r.name not in found]
    if missing:
        raise ModelLoadError(f"transformer.lora_fuse: no adapter {', '.join(missing)} in "
                             f"{folder} (it holds {', '.join(found) or 'none'})")
    from diffusers.loaders.lora_pipeline import _LOW_CPU_MEM_USAGE_DEFAULT_LORA

    names = [f"fused_{peft_name(r.name)}" for r in refs]
    for ref, adapter_name in zip(refs, names, strict=True):
        try:
            state, metadata = read_adapter(loader, transformer, ref.name, found[ref.name])
            loader.load_lora_into_transformer(
                state, transformer=transformer, adapter_name=adapter_name, metadata=metadata,
                low_cpu_mem_usage=_LOW_CPU_MEM_USAGE_DEFAULT_LORA)
        except Exception as exc:  # AdapterError, PEFT's errors: the start fails, naming it
            raise ModelLoadError(f"transformer.lora_fuse: {exc}") from None
        if adapter_name not in getattr(transformer, "peft_config", {}):
            raise ModelLoadError(f"transformer.lora_fuse: adapter {ref.name!r} matches no "
                                 "layer of the DiT (is it for another model?)")
    transformer.set_adapters(names, weights=[r.strength for r in refs])
    transformer.fuse_lora(adapter_names=names)
    transformer.unload_lora()
    log.info("fused into the DiT's weights: %s",
             ", ".join(f"{r.name} at {r.strength:g}" for r in refs))
