"""The fleet's measured traffic and the homes table as Prometheus metrics, read at scrape time from the last merged
figure and the table this gateway routes by.

Per-key series only for the ``traffic.metric_keys`` busiest keys of each pool: a key is a tenant, an adapter or a
session, and sessions are unbounded in number, so the label's cardinality is that bound times the pools. The
series of a key that leaves the busiest set are gone at the next scrape (nothing is kept in a registry)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.observe.traffic import busiest
from gateway.placement.exchange import FleetTraffic
from gateway.placement.placer import Placer


class TrafficCollector(Collector):
    def __init__(self, traffic: FleetTraffic, metric_keys: int) -> None:
        self._traffic = traffic
        self._metric_keys = metric_keys

    def collect(self) -> Iterator[Metric]:
        traffic = self._traffic
        fleet = traffic.fleet
        pool_requests = GaugeMetricFamily(
            "tenantgate_traffic_requests_per_second", "The pool's requests per second, fleet-wide (every gateway's "
            "moving average, merged through Redis)", labels=["pool"],
        )  # fmt: skip
        pool_tokens = GaugeMetricFamily(
            "tenantgate_traffic_tokens_per_second", "The pool's tokens (prompt and completion) per second, "
            "fleet-wide", labels=["pool"],
        )  # fmt: skip
        key_requests = GaugeMetricFamily(
            "tenantgate_traffic_key_requests_per_second", "Requests per second of the pool's busiest affinity keys "
            "(traffic.metric_keys of them), fleet-wide", labels=["pool", "key"],
        )  # fmt: skip
        key_tokens = GaugeMetricFamily(
            "tenantgate_traffic_key_tokens_per_second", "Tokens per second of the pool's busiest affinity keys, "
            "fleet-wide", labels=["pool", "key"],
        )  # fmt: skip
        key_spills = GaugeMetricFamily(
            "tenantgate_traffic_key_spills_per_second", "Requests per second of the pool's busiest affinity keys "
            "that the scheduler sent off the key's replica set for demand (its homes over the bound, or another "
            "replica predicted faster), fleet-wide", labels=["pool", "key"],
        )  # fmt: skip
        keys = GaugeMetricFamily(
            "tenantgate_traffic_keys", "Affinity keys with a measured rate, fleet-wide (at most traffic.max_keys)",
            labels=["pool"],
        )  # fmt: skip
        for pool, measured in sorted(fleet.items()):
            pool_requests.add_metric([pool], measured.total.requests_per_s)
            pool_tokens.add_metric([pool], measured.total.tokens_per_s)
            keys.add_metric([pool], len(measured.keys))
            for key, rate in busiest(measured.keys.items(), self._metric_keys):
                key_requests.add_metric([pool, key], rate.requests_per_s)
                key_tokens.add_metric([pool, key], rate.tokens_per_s)
                key_spills.add_metric([pool, key], rate.spills_per_s)
        yield from (pool_requests, pool_tokens, key_requests, key_tokens, key_spills, keys)
        gateways = GaugeMetricFamily(
            "tenantgate_traffic_gateways", "Gateways whose figures the last merge summed (1: this one's alone, as "
            "without Redis or while it does not answer)",
        )  # fmt: skip
        gateways.add_metric([], traffic.gateways)
        yield gateways
        exchanged = GaugeMetricFamily(
            "tenantgate_traffic_exchange_bytes", "Bytes of figures this gateway wrote and read at its last Redis swap "
            "(one per traffic.interval_s)", labels=["direction"],
        )  # fmt: skip
        exchanged.add_metric(["written"], traffic.bytes_written)
        exchanged.add_metric(["read"], traffic.bytes_read)
        yield exchanged
        dropped = CounterMetricFamily(
            "tenantgate_traffic_keys_dropped", "Requests whose key came past traffic.max_keys_per_interval distinct "
            "keys in an interval: counted in their pool's total only",
        )  # fmt: skip
        dropped.add_metric([], traffic.meter.dropped_keys)
        yield dropped


class PlacementCollector(Collector):
    """The homes table this gateway routes by (routing.home_placement: traffic)."""

    def __init__(self, placer: Placer) -> None:
        self._placer = placer

    def collect(self) -> Iterator[Metric]:
        placer = self._placer
        table = placer.table
        version = GaugeMetricFamily(
            "tenantgate_placement_version", "Version of the homes table this gateway routes by (0: none yet)"
        )
        version.add_metric([], table.version)
        leader = GaugeMetricFamily(
            "tenantgate_placement_leader", "1 while this gateway holds the placement lease (plans and publishes)"
        )
        leader.add_metric([], 1 if placer.leads else 0)
        moves = CounterMetricFamily(
            "tenantgate_placement_moves", "Keys whose replica set this gateway changed in the versions it published "
            "(moves, swaps, sets grown or shrunk, pins, evacuations; at most placement.max_moves per pool and "
            "interval)",
        )  # fmt: skip
        moves.add_metric([], placer.moves)
        last = GaugeMetricFamily(
            "tenantgate_placement_last_moves", "Keys whose replica set changed in the version this gateway routes by"
        )
        last.add_metric([], table.moves)
        warming = GaugeMetricFamily(
            "tenantgate_placement_keys_warming", "Keys routed by their old set while their adapter warms at a new "
            "member (make before break)", labels=["pool"],
        )  # fmt: skip
        for pool, pool_table in sorted(table.pools.items()):
            warming.add_metric([pool], len(pool_table.warming))
        given_up = CounterMetricFamily(
            "tenantgate_placement_moves_given_up", "Moves given up: the adapter was not resident at the new home "
            "within placement.warm_timeout_s",
        )  # fmt: skip
        given_up.add_metric([], placer.given_up)
        exchanged = GaugeMetricFamily(
            "tenantgate_placement_exchange_bytes", "Bytes of the homes table read at the last poll and written at "
            "the last publish", labels=["direction"],
        )  # fmt: skip
        exchanged.add_metric(["read"], placer.bytes_read)
        exchanged.add_metric(["written"], placer.bytes_written)
        yield from (version, leader, moves, last, warming, given_up, exchanged)
