"""The encoder's prompt-embedding cache: keys, LRU by bytes, hits skip the text encoder, and
a cached request's output equals an uncached one bit for bit (in-process; the live-group
check is in tests/integration/test_live_api.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from contracts.request import GenerationRequest
from workers.models import EncoderAdapter, LocalPipeline
from workers.models.prompt_cache import PromptCache, PromptKey

pytestmark = pytest.mark.integration  # builds and runs the tiny models

torch.set_num_threads(1)


def key(text: str, **changes: Any) -> PromptKey:
    fields: dict[str, Any] = {"model": "/m", "pipeline": "wan_t2v", "dtype": "float32",
                              "device": "cpu", "prompt": text, "negative_prompt": "",
                              "settings": (512, True)}
    fields.update(changes)
    return PromptKey(**fields)


def tensors(nbytes: int, value: float = 1.0) -> dict[str, torch.Tensor]:
    return {"prompt_embeds": torch.full((nbytes // 4,), value, dtype=torch.float32)}


def test_lru_bounded_by_bytes_and_counts() -> None:
    cache = PromptCache(1000)
    assert cache.put(key("a"), tensors(400))
    assert cache.put(key("b"), tensors(400))
    assert cache.get(key("a")) is not None  # a is now the most recent
    assert cache.put(key("c"), tensors(400))  # evicts b, the least recently used
    assert key("b") not in cache and key("a") in cache and key("c") in cache
    assert not cache.put(key("huge"), tensors(2000))  # alone larger than the bound
    st = cache.stats()
    assert (st.hits, st.misses, st.evictions, st.entries, st.bytes) == (1, 0, 1, 2, 800)
    assert cache.get(key("b")) is None and cache.stats().misses == 1


def test_hits_are_copies_that_cannot_corrupt_the_cache() -> None:
    cache = PromptCache(1 << 20)
    original = {"x": torch.arange(10.0)[2:6]}  # a view: the cache must own its own bytes
    cache.put(key("p"), original)
    got = cache.get(key("p"))
    assert got is not None and torch.equal(got["x"], original["x"])
    got["x"].zero_()
    again = cache.get(key("p"))
    assert again is not None and torch.equal(again["x"], torch.arange(2.0, 6.0))
    assert cache.stats().bytes == 16


@pytest.mark.parametrize("field", ["model", "pipeline", "dtype", "prompt", "negative_prompt",
                                   "settings", "image_digest"])
def test_every_key_field_separates_entries(field: str) -> None:
    cache = PromptCache(1 << 20)
    cache.put(key("p"), tensors(8))
    other = {"model": "/other", "pipeline": "wan_i2v", "dtype": "bfloat16", "prompt": "q",
             "negative_prompt": "blurry", "settings": (256, True), "image_digest": "ab"}[field]
    assert cache.get(key("p", **{field: other})) is None


class CountingEncoder:
    """Counts the text-encoder forward passes of an adapter."""

    def __init__(self, adapter: Any) -> None:
        self.calls = 0
        inner = adapter.text_encoder

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return inner(*args, **kwargs)

        adapter.text_encoder = _Wrapped(inner, counted)


class _Wrapped:
    def __init__(self, inner: Any, call: Any) -> None:
        self._inner, self._call = inner, call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.mark.parametrize("pipeline", ["wan_t2v", "qwen_t2i", "wan_i2v"])
def test_cached_request_output_is_bit_identical(pipeline: str, tiny_models: Path,
                                                input_png: bytes) -> None:
    """The same request through a pipeline with a warm cache (the hit skips the text
    encoder) and one without a cache: equal Phase1 tensors, equal pixels."""
    image = input_png if pipeline == "wan_i2v" else None
    size = {"height": 32, "width": 32}
    extra = {"num_frames": 5, "fps": 8} if pipeline.startswith("wan") else {}
    req = GenerationRequest.from_dict({"task": pipeline, "prompt": "a cached prompt",
                                       "seed": 3, "infer_steps": 2, **size, **extra})
    plain = LocalPipeline(tiny_models / pipeline, pipeline)
    cached = LocalPipeline(tiny_models / pipeline, pipeline, prompt_cache_bytes=64 << 20)
    plain.load()
    cached.load()
    counter = CountingEncoder(cached.encoder)
    first = cached.encoder.encode(req, image)  # miss: fills the cache
    calls = counter.calls
    assert calls > 0
    hit = cached.encoder.encode(req, image)
    assert counter.calls == calls  # the hit ran no text encoder
    ref = plain.encoder.encode(req, image)
    assert set(hit) == set(ref) == set(first)
    for name in ref:
        assert torch.equal(hit[name], ref[name]), name
    assert cached.encoder.cache is not None and cached.encoder.cache.stats().hits == 1
    art_cached, art_plain = cached.run(req, image), plain.run(req, image)
    assert cached.encoder.cache.stats().hits == 2
    assert art_cached.data == art_plain.data


def test_guidance_off_leaves_the_negative_prompt_out_of_the_key(tiny_models: Path) -> None:
    enc = EncoderAdapter.for_task(tiny_models / "wan_t2v", "wan_t2v")
    base = {"task": "wan_t2v", "prompt": "p", "guidance_scale": 1.0}
    a = GenerationRequest.from_dict({**base, "negative_prompt": "x"})
    b = GenerationRequest.from_dict({**base, "negative_prompt": "y"})
    assert enc.prompt_key(a, None) == enc.prompt_key(b, None)
    guided = GenerationRequest.from_dict({**base, "guidance_scale": 5.0, "negative_prompt": "x"})
    assert enc.prompt_key(guided, None).negative_prompt == "x"
