"""Prometheus metrics at ``GET /metrics``: every name in this module, ``tenantgate_`` prefix, base units.

The fleet's state is read when Prometheus scrapes (a collector over the live objects), so these cost the request
path nothing. Labels are bounded: pool and replica ids come from config, never from a request.
"""

from __future__ import annotations

from collections.abc import Iterator

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.appkeys import FLEET
from gateway.fleet import Fleet


class FleetCollector(Collector):
    def __init__(self, app: web.Application) -> None:
        self._app = app

    def collect(self) -> Iterator[Metric]:
        fleet: Fleet | None = self._app.get(FLEET)
        if fleet is None:  # not started yet
            return
        store_up = GaugeMetricFamily(
            "tenantgate_residency_store_up",
            "1 while the residency store (Redis, or in-process) answers; 0 while routing from the local view",
        )
        store_up.add_metric([], 1.0 if fleet.store_up else 0.0)
        yield store_up

        healthy = GaugeMetricFamily(
            "tenantgate_replica_healthy", "1 if the replica passes its health probe", labels=["pool", "replica"]
        )
        in_flight = GaugeMetricFamily(
            "tenantgate_replica_in_flight_requests", "Requests in flight to the replica", labels=["pool", "replica"]
        )
        resident = GaugeMetricFamily(
            "tenantgate_replica_resident_adapters",
            "Adapters the record holds resident on the replica",
            labels=["pool", "replica"],
        )
        cold = CounterMetricFamily("tenantgate_adapter_loads", "Adapter loads this gateway made", labels=["pool"])
        evictions = CounterMetricFamily(
            "tenantgate_adapter_evictions",
            "Adapters this gateway unloaded to keep the working set",
            labels=["pool", "trigger"],
        )
        fixes = CounterMetricFamily(
            "tenantgate_residency_reconcile_fixes", "Record entries corrected to match an engine", labels=["pool"]
        )
        for name, pool in fleet.pools.items():
            for replica_id, replica in pool.replicas.items():
                healthy.add_metric([name, replica_id], 1.0 if replica.healthy else 0.0)
                in_flight.add_metric([name, replica_id], replica.in_flight)
                resident.add_metric([name, replica_id], len(pool.residency.views[replica_id].resident))
            counters = pool.residency.counters
            cold.add_metric([name], counters.cold_loads)
            evictions.add_metric([name, "request_path"], counters.evictions_on_request_path)
            evictions.add_metric([name, "scheduled"], counters.evictions_scheduled)
            fixes.add_metric([name], counters.reconcile_fixes)
        yield from (healthy, in_flight, resident, cold, evictions, fixes)


def make_registry(app: web.Application) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(app))
    return registry


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS])
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


METRICS = web.AppKey("metrics", CollectorRegistry)


def add_routes(app: web.Application) -> None:
    app[METRICS] = make_registry(app)
    app.router.add_get("/metrics", metrics)
