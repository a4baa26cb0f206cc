"""The fleet's live state as Prometheus metrics, read when Prometheus scrapes, at no cost to the request path.

The names are documented beside the others in gateway/observe/metrics.py's module docstring and the README."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.fleet.fleet import Fleet
from gateway.routing.costs import REGIMES


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
        pool_up = GaugeMetricFamily(
            "tenantgate_pool_up", "1 while some replica of the pool takes traffic; 0: its requests get 503 and the "
            "gateway stays ready for the other pools", labels=["pool"],
        )  # fmt: skip
        for name, pool in fleet.pools.items():
            pool_up.add_metric([name], 1.0 if pool.any_healthy else 0.0)
        yield pool_up
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
        load_view = GaugeMetricFamily(
            "tenantgate_replica_load_view", "The load routing counts on the replica: with routing.load_view engine, "
            "the engine's queue at the last scrape plus this gateway's change since (its own count when the scrape "
            "is stale); with shared, this gateway's requests in flight plus those the other gateways last shared; else "
            "this gateway's requests in flight", labels=replica_labels,
        )  # fmt: skip
        scrape_age = GaugeMetricFamily(
            "tenantgate_engine_scrape_age_seconds", "Seconds since the replica's metrics last answered a scrape",
            labels=replica_labels,
        )  # fmt: skip
        slot_waiters = GaugeMetricFamily(
            "tenantgate_adapter_slot_waiters", "Loads waiting now for a slot in the replica's working set",
            labels=replica_labels,
        )  # fmt: skip
        ttft_model = GaugeMetricFamily(
            "tenantgate_ttft_model_seconds", "predicted_ttft's learned TTFT line per regime: base (at no load) and "
            "per_request (each request ahead adds)", labels=["pool", "regime", "term"],
        )  # fmt: skip
        fixes = CounterMetricFamily(
            "tenantgate_residency_reconcile_fixes", "Record entries corrected to match an engine", labels=["pool"]
        )
        ejections = CounterMetricFamily(
            "tenantgate_replica_ejections", "Outlier ejections of the replica, by the evidence that counted "
            "(gateway/fleet/outlier.py)", labels=[*replica_labels, "reason"],
        )  # fmt: skip
        now = time.monotonic()
        for name, pool in fleet.pools.items():
            for replica_id, replica in pool.replicas.items():
                labels = [name, replica_id]
                healthy.add_metric(labels, 1.0 if replica.healthy else 0.0)
                in_flight.add_metric(labels, replica.in_flight)
                resident.add_metric(labels, len(pool.residency.views[replica_id].resident))
                slot_waiters.add_metric(labels, pool.residency.slot_waiters[replica_id])
                for reason, count in replica.health.ejections_by_reason.items():
                    ejections.add_metric([*labels, reason], count)
                load_view.add_metric(labels, pool.routed_load(replica_id, now))
                if replica.engine_load is not None:
                    scrape_age.add_metric(labels, now - replica.scraped_at)
                    waiting.add_metric(labels, replica.engine_load.waiting)
                    running.add_metric(labels, replica.engine_load.running)
                    kv_usage.add_metric(labels, replica.engine_load.kv_cache_usage)
            fixes.add_metric([name], pool.residency.counters.reconcile_fixes)
            if pool.scoring is not None:
                for regime in REGIMES:
                    line = pool.scoring.model.line(regime)
                    ttft_model.add_metric([name, regime, "base"], line.base_ms / 1000)
                    ttft_model.add_metric([name, regime, "per_request"], line.per_request_ms / 1000)
        yield from (
            healthy,
            in_flight,
            load_view,
            scrape_age,
            resident,
            slot_waiters,
            ejections,
            waiting,
            running,
            kv_usage,
            ttft_model,
            fixes,
        )
