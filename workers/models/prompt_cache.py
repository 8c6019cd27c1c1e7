"""The encoder's prompt-embedding cache: text embeddings by (model, pipeline, prompt,
negative prompt, encoder settings), least recently used first out, bounded by bytes.

A hit skips the text encoder; the cached tensors are published as any Phase1 would be, so
the transformer cannot tell a hit from a miss, and the output is bit-identical (the cache
stores exact copies, never recomputed or converted values). Entries live on the encoder's
device (a hit costs a device-side copy, not a host transfer), so ``prompt_cache_mb`` counts
against that device's memory.

Why a hand-written LRU: the bound is in bytes of tensors, not entries, and the hit / miss /
eviction counts feed the worker's metrics; ``functools.lru_cache`` offers neither, and an
``OrderedDict`` does both in a few lines.
"""

from __future__ import annotations

import collections
import hashlib
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch


class PromptKey(NamedTuple):
    """What text embeddings depend on. Two requests with equal keys get equal tensors."""

    model: str
    """The model folder (resolved path), so two checkpoints never share entries."""
    pipeline: str
    dtype: str
    device: str
    prompt: str
    negative_prompt: str | None
    """None when guidance is off (no negative embeddings are made)."""
    settings: tuple[object, ...]
    """Encoder settings from the request (max_sequence_length, guidance on/off)."""
    image_digest: str | None = None
    """SHA-256 of the input image, for pipelines whose text embeddings see it (Qwen Edit)."""


def image_digest(data: bytes | None) -> str | None:
    return hashlib.sha256(data).hexdigest() if data is not None else None


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    entries: int = 0
    bytes: int = 0
    capacity: int = 0


def _nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    return sum(int(t.nbytes) for t in tensors.values())


class PromptCache:
    """LRU of text-embedding tensor maps, at most ``capacity_bytes`` of tensor data."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError("a prompt cache needs a positive capacity")
        self.capacity = capacity_bytes
        self._entries: collections.OrderedDict[PromptKey, tuple[dict[str, torch.Tensor], int]]
        self._entries = collections.OrderedDict()
        self._bytes = 0
        self._hits = self._misses = self._evictions = 0
        # The worker loop uses the cache, the metrics endpoint reads its counts.
        self._lock = threading.Lock()

    def get(self, key: PromptKey) -> dict[str, torch.Tensor] | None:
        """Copies of the cached tensors (callers may modify them), or None on a miss."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            tensors = entry[0]
        return {name: t.clone() for name, t in tensors.items()}

    def put(self, key: PromptKey, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Keep copies of ``tensors``; False when they alone exceed the capacity."""
        size = _nbytes(tensors)
        if size > self.capacity:
            return False
        # clone(): own storage of exactly these bytes (a slice's view would pin its base).
        copies = {name: t.detach().clone() for name, t in tensors.items()}
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            while self._entries and self._bytes + size > self.capacity:
                _key, (_t, freed) = self._entries.popitem(last=False)
                self._bytes -= freed
                self._evictions += 1
            self._entries[key] = (copies, size)
            self._bytes += size
        return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self._hits, self._misses, self._evictions, len(self._entries),
                              self._bytes, self.capacity)
