"""Prometheus metrics of a worker process (the endpoint: :mod:`contracts.metrics`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from contracts.metrics import CLAIM_BUCKETS, DURATION_BUCKETS, CallbackCollector, Sample


class WorkerMetrics:
    """What a worker measures: stage durations, claims, transfers, pool occupancy and
    device, its stage's GPU memory."""

    def __init__(self, role: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.role = role
        self.stage_seconds = Histogram(
            "diffring_stage_seconds", "Time spent per task in each step of the worker loop",
            ["role", "step"], buckets=DURATION_BUCKETS, registry=r)
        self.claim_seconds = Histogram(
            "diffring_ring_claim_seconds", "Ring claim latency seen by this worker",
            ["ring", "op"], buckets=CLAIM_BUCKETS, registry=r)
        self.transfer_bytes = Counter(
            "diffring_transfer_bytes", "Tensor bytes moved by Mooncake", ["direction"],
            registry=r)
        self.transfer_seconds = Histogram(
            "diffring_transfer_seconds", "Time to move one task's tensors", ["direction"],
            buckets=DURATION_BUCKETS, registry=r)
        self.tasks = Counter(
            "diffring_worker_tasks", "Tasks handled by this worker, by outcome",
            ["role", "outcome"], registry=r)
        self.heartbeats = Counter(
            "diffring_worker_heartbeats", "Heartbeats sent to the controller", ["role"],
            registry=r)

    @contextlib.contextmanager
    def timed(self, role: str, step: str) -> Iterator[None]:
        """Observe the duration of the block in ``diffring_stage_seconds{role, step}``."""
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.stage_seconds.labels(role, step).observe(time.monotonic() - t0)

    def watch_pool(self, pool_stats: Callable[[], Any]) -> None:
        def read() -> Iterable[Sample]:
            st = pool_stats()
            labels = {"role": self.role}
            yield ("diffring_staging_pool_used_bytes", "Bytes allocated in the staging pool",
                   labels, float(st.used_bytes))
            yield ("diffring_staging_pool_capacity_bytes", "Capacity of the staging pool",
                   labels, float(st.capacity))
            yield ("diffring_staging_pool_blocks", "Live blocks in the staging pool", labels,
                   float(st.live_blocks))
            # Where staged tensors live and how they are checksummed (wsum64: on the GPU),
            # as an info gauge: operators and the GPU smoke read the proof of GPU-resident
            # staging here instead of in the logs.
            yield ("diffring_staging_pool_info", "The staging pool's device and checksum "
                   "algorithm (always 1)",
                   {**labels, "device": st.device, "checksum_algo": st.checksum_algo}, 1.0)

        self.registry.register(CallbackCollector(read))

    def watch_held(self, count: Callable[[], int]) -> None:
        """The decoder's results held because the storage refuses their files."""
        self.registry.register(CallbackCollector(lambda: [(
            "diffring_worker_results_held", "Results held because their file cannot be "
            "written (disk full, read-only, missing or forbidden folder)",
            {"role": self.role}, float(count()))]))

    def watch_memory(self, stage: Any) -> None:
        """GPU memory of the stage (``stage.memory``, a MemoryWatch), read at scrape time:
        resident after load, peak of the last request, largest request peak."""
        self.watch_memories({self.role: stage})

    def watch_memories(self, stages: Mapping[str, Any]) -> None:
        """GPU memory of several stages of this process, by role (the one-process
        baseline's three), as one gauge family each: resident after load, peak of the last
        request, largest request peak."""
        watched = {role: s for role, s in stages.items() if getattr(s, "torch_model", False)}
        if not watched:
            return

        def read() -> Iterable[Sample]:
            for role, stage in watched.items():
                mem = stage.memory
                labels = {"role": role}
                yield ("diffring_stage_resident_bytes",
                       "GPU memory allocated by this stage's models after load", labels,
                       float(mem.resident_bytes))
                yield ("diffring_stage_peak_bytes",
                       "Peak GPU memory allocated during the last request", labels,
                       float(mem.last_peak_bytes))
                yield ("diffring_stage_peak_max_bytes",
                       "Largest per-request peak of GPU memory since start", labels,
                       float(mem.max_peak_bytes))

        self.registry.register(CallbackCollector(read))

    def watch_prompt_cache(self, cache_stats: Callable[[], Any]) -> None:
        """Hits, misses and evictions (counters), entries and bytes (gauges) of the
        encoder's prompt-embedding cache, read at scrape time."""
        self.registry.register(_PromptCacheCollector(cache_stats, self.role))


class _PromptCacheCollector(Collector):
    def __init__(self, stats: Callable[[], Any], role: str) -> None:
        self.stats = stats
        self.role = role

    def collect(self) -> Iterable[Metric]:
        st = self.stats()
        out: list[Metric] = []
        for name, doc, value in (
            ("diffring_prompt_cache_hits", "Requests whose text embeddings came from the "
             "prompt cache", st.hits),
            ("diffring_prompt_cache_misses", "Requests that ran the text encoder", st.misses),
            ("diffring_prompt_cache_evictions", "Entries dropped to stay within the byte "
             "bound", st.evictions),
        ):
            counter = CounterMetricFamily(name, doc, labels=["role"])
            counter.add_metric([self.role], float(value))
            out.append(counter)
        for name, doc, value in (
            ("diffring_prompt_cache_bytes", "Bytes of tensors held by the prompt cache",
             st.bytes),
            ("diffring_prompt_cache_capacity_bytes", "Byte bound of the prompt cache",
             st.capacity),
            ("diffring_prompt_cache_entries", "Entries in the prompt cache", st.entries),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=["role"])
            gauge.add_metric([self.role], float(value))
            out.append(gauge)
        return out
