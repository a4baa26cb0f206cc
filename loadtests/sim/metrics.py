"""``GET /metrics`` with vLLM's metric names, labels and semantics, read from the engine at scrape time."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loadtests.sim.engine import SimEngine

# vLLM's own buckets for vllm:time_to_first_token_seconds.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_LABELS = ["engine", "model_name"]


class _EngineState(Collector):
    def __init__(self, engine: SimEngine) -> None:
        self._engine = engine

    def collect(self) -> Iterable[Metric]:
        engine = self._engine
        values = ["0", engine.model_name]
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", engine.num_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", engine.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", engine.kv.usage),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=_LABELS)
            gauge.add_metric(values, value)
            yield gauge
        stats = engine.stats
        for name, doc, total in (
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                stats.prefix_hit_tokens + stats.prefix_miss_tokens,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                stats.prefix_hit_tokens,
            ),
            ("vllm:generation_tokens", "Number of generation tokens processed.", stats.generation_tokens),
        ):
            counter = CounterMetricFamily(name, doc, labels=_LABELS)
            counter.add_metric(values, total)
            yield counter
        # Every label set the engine ever reported, valued with when it was last true: the newest is current.
        info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        max_lora = str(engine.params.max_loras)
        for adapters, seen_at in engine.lora_info_series.items():
            info.add_metric([max_lora, adapters, adapters], seen_at)
        yield info


def engine_metrics(engine: SimEngine) -> CollectorRegistry:
    """A registry for this engine; hooks the time-to-first-token histogram into it."""
    registry = CollectorRegistry()
    registry.register(_EngineState(engine))
    ttft = Histogram(
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        _LABELS,
        buckets=TTFT_BUCKETS,
        registry=registry,
    ).labels("0", engine.model_name)
    engine.on_first_token = ttft.observe
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
