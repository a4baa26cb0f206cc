"""Prometheus metrics at ``GET /metrics``, ``tenantgate_`` prefix, base units: every metric recorded as things happen
is declared in this module; the figures read at scrape time by their collectors (gateway/fleet/collector.py,
gateway/placement/collector.py).

Label values come only from config (tenant ids, catalog adapter names, pools, replicas) or from small fixed sets
(status codes, reason codes, error kinds), never from what a request carries (but for the traffic collector's
``key``: under session affinity a digest of a client's session id, bounded to traffic.metric_keys per pool), so
cardinality stays bounded whatever clients send; a request that fails before it is resolved is labelled ``-``.
Fleet state (health, in-flight, engine load signals, residency) is read when Prometheus scrapes, at no cost to the
request path.
"""

from __future__ import annotations

import contextlib
import glob
import os
import platform
from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from prometheus_client.values import MutexValue

from gateway.observe import logs, shared_metrics
from gateway.observe.activity import Activity
from gateway.version import gateway_version

UNRESOLVED = "-"

_HEADER_BYTES = 8  # a multiprocess file's used-length field and padding: written when the file is sized
_READS = 3  # attempts at reading the workers' files before the last, whose error is the scrape's

# Seconds; TTFT and load buckets span a warm token (ms) to a cold adapter load (over 1 s).
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class GatewayMetrics:
    """The metrics the gateway records as things happen; one instance (and registry) per app."""

    def __init__(self) -> None:
        if shared_metrics.shared():  # serve --workers: values kept in the process, written to files at intervals
            shared_metrics.install()
        self.registry = CollectorRegistry(auto_describe=False)
        # No <name>_created series: one more series per counter and histogram child that no dashboard reads.
        disable_created_metrics()  # type: ignore[no-untyped-call]  # untyped in prometheus_client
        # What every Python service exports: process_* (CPU, memory, open fds), python_gc_*, python_info.
        # Collectors read at scrape time, this process's own: under serve --workers they are exported beside the
        # workers' summed values (exposition).
        self._live: list[Collector] = [
            ProcessCollector(registry=self.registry),
            GCCollector(registry=self.registry),
            PlatformCollector(registry=self.registry),
        ]
        # Not Prometheus: the last minutes kept for the status page (gateway/observe/activity.py).
        self.activity = Activity()
        r = self.registry
        self.requests = Counter(
            "tenantgate_requests", "Requests answered, by status", ["tenant", "adapter", "pool", "replica", "status"],
            registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "tenantgate_time_to_first_token_seconds", "Streams only: from the request's arrival to the first chunk "
            "relayed to the client (a whole answer's time is tenantgate_request_duration_seconds)",
            ["tenant", "adapter", "pool"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.ttft_prediction_error = Histogram(
            "tenantgate_ttft_prediction_error_seconds", "predicted_ttft: how far a stream's measured TTFT was from "
            "what the pool's model expected for its regime (absolute), before it learned from it",
            ["pool", "regime"], buckets=_LATENCY_BUCKETS, registry=r,
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
            "tenantgate_adapter_evictions", "Adapters unloaded by the gateway: on the request path, by the "
            "timer, or to bring a set that ran over max_adapters back (over_bound)",
            ["pool", "replica", "trigger"], registry=r,
        )  # fmt: skip
        self.fill_loads = Counter(
            "tenantgate_adapter_fill_loads", "Adapters loaded into free slots by the fill (start-up, a replica's "
            "return) rather than by a request; they are also counted in tenantgate_adapter_loads_total",
            ["pool"], registry=r,
        )  # fmt: skip
        self.warm_aheads = Counter(
            "tenantgate_adapter_warm_aheads", "Adapters loaded and warmed in the background on a replica "
            "predicted_ttft found faster for a key but where the adapter was cold (routing.cold_margin_ms), so the "
            "key's next requests spill there warm; also counted in tenantgate_adapter_loads_total", ["pool"],
            registry=r,
        )  # fmt: skip
        self.stream_regimes = Counter(
            "tenantgate_stream_regimes", "predicted_ttft, streams: the regime each met on its replica (warm, kv_cold, "
            "host, or cold: it waited for its adapter's load)", ["tenant", "pool", "replica", "regime"], registry=r,
        )  # fmt: skip
        self.engine_adapter_events = Counter(
            "tenantgate_engine_adapter_events", "What an engine's own adapter cache answered: an adapter it had "
            "evicted (cache_miss, resent with weights) or no room for one (cache_full)", ["pool", "replica", "event"],
            registry=r,
        )  # fmt: skip
        self.slot_waits = Counter(
            "tenantgate_adapter_slot_waits", "Loads that found every slot of a replica's working set in use: "
            "waited (woke to look again), over (loaded over max_adapters: the engine queues for slots) or refused "
            "(503: the engine refuses when full)", ["pool", "replica", "outcome"], registry=r,
        )  # fmt: skip
        self.slot_releases = Counter(
            "tenantgate_adapter_slot_releases", "Slots freed on a replica where another gateway waits for one, "
            "said through Redis: published (this gateway freed one) or received (another's, waking waits here)",
            ["pool", "direction"], registry=r,
        )  # fmt: skip
        self.slot_signal_up = Gauge(
            "tenantgate_adapter_slot_signal_up", "1 while this gateway hears other gateways' slot releases (its "
            "Redis subscription is up); 0 without Redis or while it is down: a slot another gateway frees is then "
            "seen only once that adapter's use mark leaves the in-use window", registry=r,
        )  # fmt: skip
        self.residency_lookups = Counter(
            "tenantgate_residency_lookups", "Requests whose adapter was resident on their replica (hit) or not (miss)",
            ["pool", "result"], registry=r,
        )  # fmt: skip
        self.rejections = Counter(
            "tenantgate_admission_rejections", "Requests refused by admission control, by reason",
            ["tenant", "reason"], registry=r,
        )  # fmt: skip
        self.client_connections_closed = Counter(
            "tenantgate_client_connections_closed", "Client connections the gateway closed, by reason (header_timeout, "
            "body_rate, body_framing, fragmented, idle, max_connections, max_unauthenticated, stalled_write)",
            ["reason"], registry=r,
        )  # fmt: skip
        self.client_connections = Gauge(
            "tenantgate_client_connections", "Client connections open on the tenant listener, and how many of them "
            "have not presented a valid key yet (state: open, unauthenticated)", ["state"], registry=r,
        )  # fmt: skip
        self.refused_inputs = Counter(
            "tenantgate_refused_inputs", "Bodies refused before anything was sent on (400), by surface (tenant, admin) "
            "and reason (encoding, json, non_finite, unicode, depth, shape, content_part, template_kwargs)",
            ["surface", "reason"], registry=r,
        )  # fmt: skip
        self.registry_refused = Counter(
            "tenantgate_registry_refused", "Tenant registry entries refused (gateway/tenants/signing.py) by reason "
            "(forged: no valid signature; stale: older than what was applied, a replay; altered: stored entries "
            "the signed head does not describe; invalid) and source (message, stored)",
            ["reason", "source"], registry=r,
        )  # fmt: skip
        self.admin_login_failures = Counter(
            "tenantgate_admin_login_failures", "Admin logins refused: a wrong token (wrong_token), or an address "
            "past admin.failed_logins_per_minute refused before its token was compared (rate_limited)",
            ["outcome"], registry=r,
        )  # fmt: skip
        self.usage_clamped = Counter(
            "tenantgate_usage_clamped", "Usage reports above what the request could have used (an engine's bug), "
            "charged at the request's ceiling instead (gateway/tenants/admission.py)", ["pool", "replica"], registry=r,
        )  # fmt: skip
        self.upstream_errors = Counter(
            "tenantgate_upstream_errors", "Errors talking to a replica, by kind", ["pool", "replica", "kind"],
            registry=r,
        )  # fmt: skip
        self.store_operation_seconds = Histogram(
            "tenantgate_residency_store_operation_seconds", "Residency store calls (Redis round trips)",
            ["operation", "outcome"], buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0), registry=r,
        )  # fmt: skip

        self.key_repairs = Counter(
            "tenantgate_redis_key_repairs", "Redis keys of another type than the gateway writes there (someone SET a "
            "string where a hash lives), deleted by the script that met them (gateway/redis_client.py OWNED_LUA), by "
            "the store that owns them", ["store"], registry=r,
        )  # fmt: skip

        build = Info("tenantgate_build", "The running gateway's version", registry=r)
        build.info({"version": gateway_version(), "python": platform.python_version()})
        self._restart_fields: set[str] = set()  # every setting config_restart_pending has named
        self.config_restart_pending = Gauge(
            "tenantgate_config_restart_pending", "1 for each setting the config file changes that applies only after "
            "a restart (gateway/reload.py RESTART_ONLY), as of the last reload", ["field"], registry=r,
        )  # fmt: skip
        dropped = _DroppedLogLines()
        r.register(dropped)
        self._live += [build, dropped]
        # serve --workers (gateway/workers.py) sets prometheus-client's multiprocess directory: every worker's
        # counters and histograms are written there (gateway/observe/shared_metrics.py), and a scrape of any worker
        # sums them all; gauges are exported per worker (a pid label).
        self._exposed = r
        if shared_metrics.shared():
            self._exposed = CollectorRegistry(auto_describe=False)
            _WorkersFiles(self._exposed)  # type: ignore[no-untyped-call]  # untyped in prometheus_client
            for collector in self._live:
                self._exposed.register(collector)

    def restart_pending(self, fields: list[str]) -> None:
        # A setting no longer pending is set to 0, not cleared: under serve --workers its series lives in the
        # worker's multiprocess file, which clearing the gauge in the process leaves at its last value (1 for good).
        for name in self._restart_fields - set(fields):
            self.config_restart_pending.labels(name).set(0)
        for name in fields:
            self.config_restart_pending.labels(name).set(1)
        self._restart_fields |= set(fields)

    def watch(self, collector: Collector) -> None:
        """Export what ``collector`` reads at each scrape (the fleet's live state: gateway/fleet/collector.py)."""
        self.registry.register(collector)
        if self._exposed is not self.registry:
            self._exposed.register(collector)

    def exposition(self) -> bytes:
        if self._exposed is self.registry:
            return generate_latest(self._exposed)
        shared_metrics.flush()  # this worker's own values up to now (its siblings flush when asked)
        for _ in range(_READS):
            # The supervisor removes a dead worker's gauge files (gateway/workers.py); one removed between the
            # collector's listing of the directory and its read fails the read: read again, without it.
            with contextlib.suppress(FileNotFoundError):
                return generate_latest(self._exposed)
        return generate_latest(self._exposed)


class _WorkersFiles(MultiProcessCollector):
    """prometheus-client's merge of every worker's files, less the files a starting worker has not sized yet: it
    opens a file empty and only then sizes it and writes its header, and reading an empty file fails the whole
    scrape (``struct.error``), so a scrape while the supervisor replaces a worker answered 500. Such a file holds no
    value yet; the next scrape reads it."""

    def collect(self) -> Iterator[Metric]:
        files = []
        for path in glob.glob(os.path.join(self._path, "*.db")):
            with contextlib.suppress(FileNotFoundError):  # a dead worker's, removed since the listing
                if os.stat(path).st_size >= _HEADER_BYTES:
                    files.append(path)
        return self.merge(files, accumulate=True)  # type: ignore[no-any-return,no-untyped-call]  # untyped


class _DroppedLogLines(Collector):
    """Log lines dropped because the log's writer thread was a full queue behind (gateway/observe/logs.py), read at
    each scrape: the count lives with the writer, which is the process's, not an app's."""

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "tenantgate_log_lines_dropped", "Log lines (access lines included) dropped because the log's writer "
            "was a full queue behind", value=logs.dropped_lines(),
        )  # fmt: skip


# What a request records, per labelled child, without the public methods' per-call checks (Counter.inc and
# Histogram.observe check the metric is a labelled child, refuse a negative amount and look at an exemplar, and
# observe walks its buckets in Python): the child's own value objects, added to directly. About a third of a
# microsecond less per call, seven or eight calls per request (telemetry.py, the residency's hit count).
# tests/gateway/observe/test_metrics.py checks both give the same exposition.
Add = Callable[[float], None]


def _add_to(value: Any) -> Add:
    """An add to one of prometheus-client's value objects. The in-process one (``MutexValue``) is added to without
    its lock: its children are written only on the event loop's thread (requests, and the scrape that reads them,
    run there), so no other writer can interleave, and the lock was most of the call (about 210 -> 57 ns). So is a
    worker's (``serve --workers``: gateway/observe/shared_metrics.py), which its flush writes to the shared file."""
    if type(value) is not MutexValue and not shared_metrics.is_buffered(value):
        add: Add = value.inc
        return add

    def add_unlocked(amount: float) -> None:
        value._value += amount

    return add_unlocked


def adder(counter: Counter) -> Add:
    """``counter.inc`` for a labelled counter child and a non-negative amount, written from the event loop."""
    return _add_to(counter._value)


def observer(histogram: Histogram) -> Add:
    """``histogram.observe`` for a labelled histogram child written from the event loop: the sum, and the first
    bucket whose upper bound the amount does not exceed (found by bisection; the last bound is +Inf)."""
    total = _add_to(histogram._sum)
    buckets = [_add_to(bucket) for bucket in histogram._buckets]
    bounds: list[float] = histogram._upper_bounds

    def observe(amount: float) -> None:
        total(amount)
        buckets[bisect_left(bounds, amount)](1)

    return observe
