"""``GET /metrics`` with Triton's and TensorRT-LLM's metric names and labels, read from the engine at scrape time
(TensorRT-LLM backend ``custom_metrics_reporter.cc``; docs/triton.md)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loadtests.sim.engine import SimEngine
from loadtests.sim.triton_contract import VERSION


class _TritonState(Collector):
    def __init__(self, engine: SimEngine, model: str) -> None:
        self._engine = engine
        self._model = model

    def collect(self) -> Iterable[Metric]:
        engine, model = self._engine, self._model
        pending = GaugeMetricFamily(
            "nv_inference_pending_request_count",
            "Instantaneous number of pending requests awaiting execution per-model.",
            labels=["model", "version"],
        )
        pending.add_metric([model, VERSION], engine.num_waiting)
        yield pending

        running = engine.running_requests
        requests = GaugeMetricFamily(
            "nv_trt_llm_request_metrics", "TRT LLM request metrics", labels=["model", "request_type", "version"]
        )
        for request_type, value in (
            ("active", len(running) + engine.num_waiting),
            ("max", engine.params.max_num_seqs),
            ("scheduled", len(running)),
            ("context", sum(1 for r in running if r.emitted == 0)),  # admitted, prefill not yet done
            ("waiting", engine.num_waiting),
        ):
            requests.add_metric([model, request_type, VERSION], value)
        yield requests

        kv = engine.kv
        used = round(kv.usage * kv.total_blocks)
        blocks = GaugeMetricFamily(
            "nv_trt_llm_kv_cache_block_metrics",
            "TRT LLM KV cache block metrics",
            labels=["kv_cache_block_type", "model", "version"],
        )
        for block_type, block_value in (
            ("max", float(kv.total_blocks)),
            ("free", float(kv.total_blocks - used)),
            ("used", float(used)),
            ("tokens_per", float(kv.block_size)),
            ("fraction", kv.usage),
        ):
            blocks.add_metric([block_type, model, VERSION], block_value)
        yield blocks


def triton_metrics(engine: SimEngine, model: str) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(_TritonState(engine, model))
    return registry
