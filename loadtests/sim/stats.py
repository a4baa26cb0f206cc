"""Counters of what the simulated engine did, served as JSON at ``GET /sim/stats`` (tests and benchmarks only)."""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SimStats:
    requests: int = 0
    requests_by_model: Counter[str] = field(default_factory=Counter)
    finished: int = 0
    aborted: int = 0
    rejected: int = 0
    cold_loads: int = 0
    cold_loads_by_adapter: Counter[str] = field(default_factory=Counter)
    # The runtime LoRA API: adapters registered and unregistered, loads refused because the name was already
    # registered (a router loading twice), and the most names ever registered at once (its working set).
    registrations: int = 0
    duplicate_loads: int = 0
    unregistrations: int = 0
    peak_registered: int = 0
    swap_ins: int = 0
    gpu_evictions: int = 0
    host_evictions: int = 0
    prefix_hit_tokens: int = 0
    prefix_miss_tokens: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    # A request counts once per reason it ever had to wait for: a LoRA slot, a batch seat, or KV blocks.
    waits: Counter[str] = field(default_factory=Counter)
    queue_wait_s: float = 0.0
    steps: int = 0
    busy_s: float = 0.0
    # W3C traceparent headers of the latest requests, as vLLM takes them for its own traces.
    traceparents: deque[str] = field(default_factory=lambda: deque(maxlen=64))
    # Every header of the latest inference requests, as received (names as sent).
    request_headers: deque[dict[str, str]] = field(default_factory=lambda: deque(maxlen=64))
    # GET /metrics answered: how often routers scrape the engine.
    metrics_scrapes: int = 0
    # GET /health answered: how often routers probe the engine.
    health_probes: int = 0
    # The latest cold loads, oldest first, for benchmarks that ask where they come from: the wall-clock time
    # (``time.monotonic``), the adapter, why it was read from disk (``load``: the runtime LoRA API registered it;
    # ``request``: a request's adapter had fallen out of host memory) and the adapters it evicted from host memory.
    cold_load_log: deque[tuple[float, str, str, tuple[str, ...]]] = field(default_factory=lambda: deque(maxlen=4096))

    def record_cold_load(self, adapter: str, cause: str = "load", evicted: tuple[str, ...] = ()) -> None:
        self.cold_loads += 1
        self.cold_loads_by_adapter[adapter] += 1
        self.cold_load_log.append((round(time.monotonic(), 4), adapter, cause, evicted))

    def as_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "requests_by_model": dict(self.requests_by_model),
            "finished": self.finished,
            "aborted": self.aborted,
            "rejected": self.rejected,
            "cold_loads": self.cold_loads,
            "cold_loads_by_adapter": dict(self.cold_loads_by_adapter),
            "registrations": self.registrations,
            "duplicate_loads": self.duplicate_loads,
            "unregistrations": self.unregistrations,
            "peak_registered": self.peak_registered,
            "swap_ins": self.swap_ins,
            "gpu_evictions": self.gpu_evictions,
            "host_evictions": self.host_evictions,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "prefix_miss_tokens": self.prefix_miss_tokens,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "waits": dict(self.waits),
            "queue_wait_s": round(self.queue_wait_s, 6),
            "steps": self.steps,
            "busy_s": round(self.busy_s, 6),
            "traceparents": list(self.traceparents),
            "request_headers": list(self.request_headers),
            "metrics_scrapes": self.metrics_scrapes,
            "health_probes": self.health_probes,
            "cold_load_log": [list(event) for event in self.cold_load_log],
        }
