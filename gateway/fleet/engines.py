"""Each pool's engine driver and its replicas' addresses, from the pool's config."""

from __future__ import annotations

import logging

from backends.base import Endpoint, EngineDriver
from backends.triton import TritonDriver
from backends.vllm import VllmDriver
from gateway.config import PoolConfig, ReplicaConfig
from gateway.observe.metrics import GatewayMetrics

log = logging.getLogger(__name__)


def make_driver(config: PoolConfig, metrics: GatewayMetrics) -> EngineDriver:
    if config.backend == "triton":
        events = metrics.engine_adapter_events

        def on_event(replica_id: str, adapter: str, event: str) -> None:
            log.warning("%s/%s: engine reports %s for adapter %s", config.name, replica_id, event, adapter)
            events.labels(config.name, replica_id, event).inc()

        return TritonDriver(
            model=config.triton.model,
            lora_dtype=config.triton.lora_dtype,
            default_max_tokens=config.triton.default_max_tokens,
            chat_template=config.triton.chat_template,
            request_timeout_s=config.request_timeout_s,
            adapter_load_timeout_s=config.adapter_load_timeout_s,
            probe_timeout_s=config.health.timeout_s,
            weights_cache_bytes=config.triton.weights_cache_mib << 20,
            on_event=on_event,
        )
    return VllmDriver(
        connect_timeout_s=config.connect_timeout_s,
        request_timeout_s=config.request_timeout_s,
        adapter_load_timeout_s=config.adapter_load_timeout_s,
        max_connections_per_replica=config.max_connections_per_replica,
        probe_timeout_s=config.health.timeout_s,
    )


def endpoint(pool: PoolConfig, replica: ReplicaConfig) -> Endpoint:
    """A replica's addresses; a Triton replica's gRPC and metrics ports default to the pool's on the url's host."""
    url = str(replica.url).rstrip("/")
    if pool.backend != "triton":
        return Endpoint(replica.id, url)
    host = replica.url.host or "127.0.0.1"  # pydantic keeps an IPv6 host in its brackets
    grpc_address = replica.grpc or f"{host}:{pool.triton.grpc_port}"
    metrics_url = (
        str(replica.metrics_url) if replica.metrics_url else f"http://{host}:{pool.triton.metrics_port}/metrics"
    )
    return Endpoint(replica.id, url, grpc_address, metrics_url)
