"""Per-request telemetry: the record a request fills on its way, its OpenTelemetry spans, its metrics and its one
JSON access-log line. Telemetry never raises into a request and never blocks it.

Tracing is off by default: then no tracer exists and ``span`` is a shared null context, so it costs nothing.
When on, each request gets a span tree (``tenantgate.request`` > ``admission``, ``route``, ``adapter.load`` when
the adapter was not resident, ``upstream`` with a ``first_byte`` event); a client's W3C ``traceparent`` is
honoured and the upstream span's context is sent on to the engine.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.config import TelemetryConfig, TracingConfig
from gateway.observe import logs
from gateway.observe.metrics import UNRESOLVED, Add, GatewayMetrics, adder, observer

access_log = logging.getLogger("tenantgate.access")
log = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()


class _NoSpan:
    """The span when tracing is off: a context manager whose enter and exit are one C call each. A request passes
    through four (the request, admission, route, upstream); ``contextlib.nullcontext``'s enter and exit are Python
    calls, about 2,200 instructions a ``with`` against about 1,100 here. ``"".format`` takes whatever it is given
    and returns "": the block's value is "" (no span), and "" is falsy, so an exception leaving the block is never
    suppressed (tests/gateway/observe/test_no_span.py)."""

    __slots__ = ()
    # A builtin method is no descriptor: ``with`` calls it as it is, with no self (and exit with the exception's
    # type, value and traceback).
    __enter__ = __exit__ = "".format


_NO_SPAN: contextlib.AbstractContextManager[Any] = _NoSpan()  # type: ignore[assignment]  # the protocol, in C
_NO_HEADERS: Mapping[str, str] = MappingProxyType({})
# At most 15 digits (a float counts them exactly): the figure is the engine's, and a longer one (more digits than
# int() converts, at 4,300) raised on the request path; it is left out.
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d{1,15})(?!\d)')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d{1,15})(?!\d)')


@dataclass
class RequestRecord:
    """What one request did, filled in as it goes; labels stay ``-`` until known."""

    path: str
    started: float = field(default_factory=time.perf_counter)
    stream: bool = False
    tenant: str = UNRESOLVED
    adapter: str = UNRESOLVED
    pool: str = UNRESOLVED
    replica: str = UNRESOLVED
    reasons: list[str] = field(default_factory=list)
    status: int = 500
    first_byte: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    # A stream's SSE events relayed whole (what it is charged if it ends without the engine's usage event).
    events: int = 0
    error: str | None = None
    # The replica the error came from: a retry may have served the request elsewhere since (``replica``).
    error_replica: str = UNRESOLVED
    # The engine's own reason, for failures whose message is the engine's about its state, never the request's
    # content (a refused adapter load: bad path, rank above the limit).
    error_detail: str | None = None
    retries: int = 0
    trace_id: str | None = None
    # predicted_ttft, streams: the regime the stream met on its replica (cold: it waited for its adapter's load).
    regime: str | None = None
    # A stream's status once its last event was handed to the connection: a client that closes as soon as it has
    # read it may cancel the handler on its way out, and was answered all the same (not a 499).
    answered: int | None = None
    # Called once at the first byte: set by dispatch for an attempt that waited for its adapter's load (the load
    # holds the replica's lock until its requests have started: PoolResidency._settle).
    on_first_byte: Callable[[], None] | None = None

    def mark_first_byte(self) -> None:
        if self.first_byte is None:
            self.first_byte = time.perf_counter()

    def read_usage(self, data: bytes) -> None:
        """Take token counts from an OpenAI body or SSE chunk that carries ``usage``; a cheap byte search first."""
        at = data.find(b'"prompt_tokens"')
        if at < 0:
            return
        prompt = _first(_PROMPT_TOKENS, data, at)
        completion = _first(_COMPLETION_TOKENS, data, data.find(b'"completion_tokens"'))
        if prompt:
            self.prompt_tokens = int(prompt.group(1))
        if completion:
            self.completion_tokens = int(completion.group(1))


def _first(pattern: re.Pattern[bytes], data: bytes, at: int) -> re.Match[bytes] | None:
    """``pattern.search(data)``, the same match, found cheaper: the pattern anchored at ``at``, where its field's
    name first occurs (a byte search found it), and only where that is no ``"name": digits`` does the regular
    expression search the rest (sre's search of the whole answer cost about 4,000 instructions per pattern per
    request)."""
    if at < 0:
        return None
    return pattern.match(data, at) or pattern.search(data, at + 1)


def make_tracer_provider(config: TracingConfig, exporter: SpanExporter | None = None) -> TracerProvider | None:
    """A provider for the configured exporter, or None when tracing is off. ``exporter`` overrides it (tests)."""
    if exporter is None:
        if config.exporter == "none":
            return None
        exporter = _exporter(config)
    provider = TracerProvider(
        resource=Resource.create({"service.name": config.service_name}),
        sampler=ParentBasedTraceIdRatio(config.sample_ratio),
    )
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _exporter(config: TracingConfig) -> SpanExporter:
    if config.exporter == "console":
        return ConsoleSpanExporter()
    # The config refuses otlp when this is not installed (tenantgate[otlp]), so check-config says so first.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    endpoint = str(config.otlp_endpoint) if config.otlp_endpoint else None
    otlp: SpanExporter = OTLPSpanExporter(endpoint=endpoint)
    return otlp


class Telemetry:
    def __init__(self, config: TelemetryConfig, metrics: GatewayMetrics, exporter: SpanExporter | None = None):
        self.metrics = metrics
        self.provider = make_tracer_provider(config.tracing, exporter)
        self.tracer = self.provider.get_tracer("tenantgate") if self.provider is not None else None
        self.access_log = config.access_log
        self._series: dict[tuple[str, str, str, str], _Series] = {}

    def close(self) -> None:
        """Export the spans still buffered; called when the app stops."""
        if self.provider is not None:
            self.provider.shutdown()

    def request_span(self, record: RequestRecord, headers: Mapping[str, str]) -> contextlib.AbstractContextManager[Any]:
        """The request's root span, continuing the client's trace when it sent a ``traceparent``; the shared null
        context when tracing is off (no generator made and run per request)."""
        if self.tracer is None:
            return _NO_SPAN
        return self._request_span(self.tracer, record, headers)

    @contextlib.contextmanager
    def _request_span(self, tracer: trace.Tracer, record: RequestRecord, headers: Mapping[str, str]) -> Iterator[None]:
        parent = _PROPAGATOR.extract(headers) if "traceparent" in headers else None
        with tracer.start_as_current_span(
            "tenantgate.request", context=parent, kind=trace.SpanKind.SERVER, attributes={"http.route": record.path}
        ) as span:
            record.trace_id = format(span.get_span_context().trace_id, "032x")
            try:
                yield
            finally:  # errors too: the status is what the client got
                span.set_attributes(_span_attributes(record))

    def span(self, name: str, **attributes: Any) -> contextlib.AbstractContextManager[Any]:
        if self.tracer is None:
            return _NO_SPAN
        kind = trace.SpanKind.CLIENT if name == "upstream" else trace.SpanKind.INTERNAL
        return self.tracer.start_as_current_span(name, kind=kind, attributes=attributes)

    def upstream_span(self, replica: str) -> contextlib.AbstractContextManager[Any]:
        """The span of the call to the engine on ``replica`` (``span("upstream", ...)``, without building its
        attributes when tracing is off)."""
        if self.tracer is None:
            return _NO_SPAN
        return self.span("upstream", **{"server.address": replica})

    def upstream_headers(self) -> Mapping[str, str]:
        """``traceparent`` for the engine from the current (upstream) span; empty when tracing is off."""
        if self.tracer is None:
            return _NO_HEADERS
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier)
        return carrier

    def first_byte(self, record: RequestRecord) -> None:
        record.mark_first_byte()
        hook = record.on_first_byte
        if hook is not None:
            record.on_first_byte = None
            hook()
        if self.tracer is not None:
            trace.get_current_span().add_event("first_byte")

    def ttft_learned(self, record: RequestRecord, pool: str, learned: tuple[str, float, float] | None) -> None:
        """predicted_ttft's model learned a stream's TTFT (regime, what it expected, what it measured, in ms):
        count how far off it was, and keep the regime the stream met for its counts (``finish``)."""
        if learned is not None:
            regime, expected_ms, measured_ms = learned
            record.regime = regime
            self.metrics.ttft_prediction_error.labels(pool, regime).observe(abs(measured_ms - expected_ms) / 1000)

    def finish(self, record: RequestRecord) -> None:
        try:
            now = time.perf_counter()
            key = (record.tenant, record.adapter, record.pool, record.replica)
            series = self._series.get(key)
            if series is None:  # label children are looked up once per label set: .labels() costs a microsecond
                series = self._series[key] = _Series(self.metrics, *key)
            series.count(record, now)
            if record.adapter != UNRESOLVED:
                ttft = None if record.first_byte is None else record.first_byte - record.started
                self.metrics.activity.request(
                    record.tenant, record.adapter, record.replica, record.reasons, record.status, ttft
                )
            if self.access_log and access_log.isEnabledFor(logging.INFO):
                # The line's fields are made on the log's writer thread (gateway/observe/logs.py), from the record
                # as it is now (it is finished) and the duration taken here.
                logs.access_line(access_log, "request", _log_line, record, now)
        except Exception:  # telemetry must never fail a request
            log.exception("recording a request's telemetry failed")


class _Series:
    """One label set's metric children, as the functions that add to them (metrics.adder, metrics.observer). The
    number of sets is bounded by config (tenants x their adapters x replicas, plus the unresolved ``-``), so the
    cache is too."""

    def __init__(self, m: GatewayMetrics, tenant: str, adapter: str, pool: str, replica: str) -> None:
        self._metrics, self._labels = m, (tenant, adapter, pool, replica)
        self._requests: dict[int, Add] = {}
        self._routing: dict[str, Add] = {}
        self._regimes: dict[str, Add] = {}
        self._errors: dict[tuple[str, str], Any] = {}
        self.ttft = observer(m.ttft.labels(tenant, adapter, pool))
        self.duration = observer(m.duration.labels(tenant, adapter, pool))
        self.prompt_tokens = adder(m.prompt_tokens.labels(tenant, adapter))
        self.completion_tokens = adder(m.completion_tokens.labels(tenant, adapter))

    def count(self, record: RequestRecord, now: float) -> None:
        requests = self._requests.get(record.status)
        if requests is None:
            m, (tenant, adapter, pool, replica) = self._metrics, self._labels
            requests = self._requests[record.status] = adder(
                m.requests.labels(tenant, adapter, pool, replica, record.status)
            )
        requests(1)
        if self._labels[2] == UNRESOLVED:
            return
        self.duration(now - record.started)
        # Only a stream's first byte is its first token: a whole answer's first byte is its last.
        if record.first_byte is not None and record.stream:
            self.ttft(record.first_byte - record.started)
        if record.prompt_tokens is not None:
            self.prompt_tokens(record.prompt_tokens)
        if record.completion_tokens is not None:
            self.completion_tokens(record.completion_tokens)
        for reason in record.reasons:
            routing = self._routing.get(reason)
            if routing is None:
                routing = self._routing[reason] = adder(
                    self._metrics.routing.labels(self._labels[0], self._labels[2], reason)
                )
            routing(1)
        if record.regime is not None:
            regimes = self._regimes.get(record.regime)
            if regimes is None:
                tenant, _, pool, replica = self._labels
                regimes = self._regimes[record.regime] = adder(
                    self._metrics.stream_regimes.labels(tenant, pool, replica, record.regime)
                )
            regimes(1)
        if record.error is not None and self._labels[3] != UNRESOLVED:
            self._error(record)

    def _error(self, record: RequestRecord) -> None:
        m, (_, _, pool, replica) = self._metrics, self._labels
        assert record.error is not None
        failed_on = record.error_replica if record.error_replica != UNRESOLVED else replica
        errors = self._errors.get((record.error, failed_on))
        if errors is None:
            errors = self._errors[(record.error, failed_on)] = m.upstream_errors.labels(pool, failed_on, record.error)
        errors.inc()


def _span_attributes(record: RequestRecord) -> dict[str, Any]:
    return {
        "tenantgate.tenant": record.tenant,
        "tenantgate.adapter": record.adapter,
        "tenantgate.pool": record.pool,
        "tenantgate.replica": record.replica,
        "http.response.status_code": record.status,
    }


def _log_line(line: dict[str, Any], record: RequestRecord, now: float) -> None:
    """The access line's fields, set in ``line`` (logs.access_line): the same keys, in the same order, every time."""
    line["event"] = "request"
    line["path"] = record.path
    line["tenant"] = record.tenant
    line["adapter"] = record.adapter
    line["pool"] = record.pool
    line["replica"] = record.replica
    line["reasons"] = record.reasons
    line["status"] = record.status
    line["stream"] = record.stream
    # streams only, as the TTFT histogram
    first_byte = record.first_byte
    line["ttft_ms"] = None if first_byte is None or not record.stream else _ms(first_byte - record.started)
    line["duration_ms"] = _ms(now - record.started)
    line["prompt_tokens"] = record.prompt_tokens
    line["completion_tokens"] = record.completion_tokens
    line["error"] = record.error
    line["error_detail"] = record.error_detail
    line["retries"] = record.retries
    line["trace_id"] = record.trace_id


def _ms(seconds: float) -> float:
    """``seconds`` in milliseconds to the microsecond (``round(1000 * seconds, 3)`` but for a halfway case, about
    one in a million): a round to an integer and a division, not round()'s decimal rounding, which formats the
    float through snprintf (a few thousand instructions per call on the writer thread)."""
    return round(seconds * 1_000_000) / 1000
