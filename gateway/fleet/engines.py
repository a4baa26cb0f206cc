"""Each pool's engine driver and its replicas' endpoints, from the pool's config, through the pool's registered
engine (backends/registry.py): nothing here knows one engine from another."""

from __future__ import annotations

import logging

from backends import registry
from backends.base import Endpoint, EngineDriver
from backends.registry import ConfiguredReplica, PoolSettings
from gateway.config import PoolConfig, ReplicaConfig
from gateway.observe.metrics import GatewayMetrics

log = logging.getLogger(__name__)


def pool_settings(config: PoolConfig, metrics: GatewayMetrics) -> PoolSettings:
    """What the pool gives its driver; the engine's adapter events go to the metric and the log."""
    events = metrics.engine_adapter_events

    def on_adapter_event(replica_id: str, adapter: str, event: str) -> None:
        log.warning("%s/%s: engine reports %s for adapter %s", config.name, replica_id, event, adapter)
        events.labels(config.name, replica_id, event).inc()

    return PoolSettings(
        pool=config.name,
        connect_timeout_s=config.connect_timeout_s,
        request_timeout_s=config.request_timeout_s,
        adapter_load_timeout_s=config.adapter_load_timeout_s,
        probe_timeout_s=config.health.timeout_s,
        max_connections_per_replica=config.max_connections_per_replica,
        on_adapter_event=on_adapter_event,
    )


def make_driver(config: PoolConfig, metrics: GatewayMetrics) -> EngineDriver:
    return registry.spec(config.backend).driver(config.settings, pool_settings(config, metrics))


def endpoint(pool: PoolConfig, replica: ReplicaConfig) -> Endpoint:
    """A replica's endpoint, in the shape the pool's engine takes (a Triton replica's carries its gRPC address)."""
    host = replica.url.host or "127.0.0.1"  # pydantic keeps an IPv6 host in its brackets
    configured = ConfiguredReplica(replica.id, str(replica.url).rstrip("/"), host, replica.extras)
    return registry.spec(pool.backend).endpoint(configured, pool.settings)
