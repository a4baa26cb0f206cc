"""Prometheus metrics at ``GET /metrics``: every name is in this module, ``tenantgate_`` prefix, base units.

Label values come only from config (tenant ids, catalog adapter names, pools, replicas) or from small fixed sets
(status codes, reason codes, error kinds), never from what a request carries, so cardinality stays bounded
whatever clients send; a request that fails before it is resolved is labelled ``-``. Fleet state (health,
in-flight, engine load signals, residency) is read when Prometheus scrapes, at no cost to the request path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.observe.activity import Activity

if TYPE_CHECKING:
    from gateway.fleet.fleet import Fleet

UNRESOLVED = "-"

# Seconds; TTFT and load buckets span a warm token (ms) to a cold adapter load (over 1 s).
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class GatewayMetrics:
    """The metrics the gateway records as things happen; one instance (and registry) per app."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        # Not Prometheus: the last minutes kept for the status page (gateway/observe/activity.py).
        self.activity = Activity()
        r = self.registry
        self.requests = Counter(
            "tenantgate_requests", "Requests answered, by status", ["tenant", "adapter", "pool", "replica", "status"],
            registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "tenantgate_time_to_first_token_seconds", "From the request's arrival to its first byte to the client",
            ["tenant", "adapter", "pool"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.duration = Histogram(
            "tenantgate_request_duration_seconds", "From the request's arrival to its last byte",
            ["tenant", "adapter", "pool"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "tenantgate_prompt_tokens", "Prompt tokens, as the engine reported them", ["tenant", "adapter"], registry=r
        )
        self.completion_tokens = Counter(
            "tenantgate_completion_tokens", "Completion tokens, as the engine reported them", ["tenant", "adapter"],
            registry=r,
        )  # fmt: skip
        self.routing = Counter(
            "tenantgate_routing_decisions", "Routing decisions by reason code (home, spill:...)",
            ["tenant", "pool", "reason"], registry=r,
        )  # fmt: skip
        self.adapter_loads = Counter(
            "tenantgate_adapter_loads", "Adapter loads the gateway made (cold loads)", ["pool", "replica", "adapter"],
            registry=r,
        )  # fmt: skip
        self.adapter_load_seconds = Histogram(
            "tenantgate_adapter_load_duration_seconds", "Time an engine took to load an adapter", ["pool"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.evictions = Counter(
            "tenantgate_adapter_evictions", "Adapters unloaded by the gateway: on the request path or by the timer",
            ["pool", "replica", "trigger"], registry=r,
        )  # fmt: skip
        self.engine_adapter_events = Counter(
            "tenantgate_engine_adapter_events", "What an engine's own adapter cache answered: an adapter it had "
            "evicted (cache_miss, resent with weights) or no room for one (cache_full)", ["pool", "replica", "event"],
            registry=r,
        )  # fmt: skip
        self.residency_lookups = Counter(
            "tenantgate_residency_lookups", "Requests whose adapter was resident on their replica (hit) or not (miss)",
            ["pool", "result"], registry=r,
        )  # fmt: skip
        self.rejections = Counter(
            "tenantgate_admission_rejections", "Requests refused by admission control, by reason",
            ["tenant", "reason"], registry=r,
        )  # fmt: skip
        self.upstream_errors = Counter(
            "tenantgate_upstream_errors", "Errors talking to a replica, by kind", ["pool", "replica", "kind"],
            registry=r,
        )  # fmt: skip
        self.store_operation_seconds = Histogram(
            "tenantgate_residency_store_operation_seconds", "Residency store calls (Redis round trips)",
            ["operation", "outcome"], buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0), registry=r,
        )  # fmt: skip

    def watch(self, fleet_of: Callable[[], Fleet | None]) -> None:
        """Export the fleet's state at each scrape; ``fleet_of`` returns None until the fleet has started."""
        self.registry.register(FleetCollector(fleet_of))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class FleetCollector(Collector):
    """Fleet state, read at scrape time from the live objects."""

    def __init__(self, fleet_of: Callable[[], Fleet | None]) -> None:
        self._fleet_of = fleet_of

    def collect(self) -> Iterator[Metric]:
        fleet = self._fleet_of()
        if fleet is None:
            return
        store_up = GaugeMetricFamily(
            "tenantgate_residency_store_up",
            "1 while the residency store (Redis, or in-process) answers; 0 while routing from the local view",
        )
        store_up.add_metric([], 1.0 if fleet.store_up else 0.0)
        yield store_up
        replica_labels = ["pool", "replica"]
        healthy = GaugeMetricFamily(
            "tenantgate_replica_healthy", "1 if the replica takes traffic", labels=replica_labels
        )
        in_flight = GaugeMetricFamily(
            "tenantgate_replica_in_flight_requests", "Requests in flight to the replica", labels=replica_labels
        )
        resident = GaugeMetricFamily(
            "tenantgate_replica_resident_adapters", "Adapters the record holds resident", labels=replica_labels
        )
        waiting = GaugeMetricFamily(
            "tenantgate_engine_waiting_requests", "The engine's queue depth, last scraped", labels=replica_labels
        )
        running = GaugeMetricFamily(
            "tenantgate_engine_running_requests", "Requests the engine is running, last scraped", labels=replica_labels
        )
        kv_usage = GaugeMetricFamily(
            "tenantgate_engine_kv_cache_usage_ratio", "The engine's KV cache usage (0-1), last scraped",
            labels=replica_labels,
        )  # fmt: skip
        fixes = CounterMetricFamily(
            "tenantgate_residency_reconcile_fixes", "Record entries corrected to match an engine", labels=["pool"]
        )
        for name, pool in fleet.pools.items():
            for replica_id, replica in pool.replicas.items():
                labels = [name, replica_id]
                healthy.add_metric(labels, 1.0 if replica.healthy else 0.0)
                in_flight.add_metric(labels, replica.in_flight)
                resident.add_metric(labels, len(pool.residency.views[replica_id].resident))
                if replica.engine_load is not None:
                    waiting.add_metric(labels, replica.engine_load.waiting)
                    running.add_metric(labels, replica.engine_load.running)
                    kv_usage.add_metric(labels, replica.engine_load.kv_cache_usage)
            fixes.add_metric([name], pool.residency.counters.reconcile_fixes)
        yield from (healthy, in_flight, resident, waiting, running, kv_usage, fixes)
