"""Send a routed request to its replica and relay the answer: whole, or chunk by chunk as the engine streams.

Engine errors are mapped to gateway errors here, at the boundary. Once the first byte of a stream has gone to
the client, an error can only end the stream with an OpenAI error event.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from backends.base import AdapterRef, EngineRequest, EngineResponse
from backends.errors import (
    AdapterCacheFull,
    AdapterLoadFailed,
    AdapterNotLoaded,
    BackendError,
    DeadlineExceeded,
    EngineRejected,
    EngineTimeout,
    EngineUnavailable,
    StreamBroken,
)
from gateway.appkeys import TELEMETRY
from gateway.errors import GatewayError, InvalidRequest, UpstreamError, UpstreamTimeout, WorkingSetFull
from gateway.fleet.pool import Pool, Replica
from gateway.observe.telemetry import RequestRecord, Telemetry
from gateway.tenants.directory import Target

log = logging.getLogger(__name__)

# The engine's path for each tenant path (the same OpenAI paths on every engine today).
_PATHS = {"/v1/completions": "/v1/completions", "/v1/chat/completions": "/v1/chat/completions"}
VARIANT_HEADER = "x-tenantgate-variant"
_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


class RetryableFailure(Exception):
    """The request failed before the client saw a byte, in a way another replica may not (refused connection,
    dropped answer, engine overloaded): the caller may try once more elsewhere, or raise ``error``."""

    def __init__(self, error: GatewayError) -> None:
        super().__init__(str(error))
        self.error = error


async def relay(
    request: web.Request,
    pool: Pool,
    replica: Replica,
    target: Target,
    body: bytes,
    record: RequestRecord,
    deadline: float,
    tenant_deadline: bool = False,
) -> web.StreamResponse:
    """Send the request to the replica and relay its answer. Before the first byte reaches the client, a failure
    raises (``RetryableFailure`` when another replica may succeed); after it, it ends the stream with an OpenAI
    error event. Every outcome is reported to the pool's outlier detection."""
    telemetry, replica_id = request.app[TELEMETRY], replica.endpoint.id
    adapter = AdapterRef(target.engine_model, target.adapter.source) if target.adapter is not None else None
    try:
        if adapter is not None:
            if pool.residency.is_resident(replica_id, adapter.engine_name):
                pool.residency.count_hit()  # the common case: no load, no timer, no task
            else:
                await _load_within_deadline(telemetry, pool, replica, adapter, deadline)
        with telemetry.span("upstream", **{"server.address": replica_id}):
            remaining = _remaining(deadline)
            headers = telemetry.upstream_headers()
            engine_request = EngineRequest(_PATHS[record.path], body, record.stream, headers, remaining, adapter)
            upstream = await _send(pool, replica, engine_request)
            try:
                if not record.stream:
                    answer = await upstream.read()
                    pool.report(replica_id, ok=True)
                    telemetry.first_byte(record)
                    record.read_usage(answer)
                    variant = {VARIANT_HEADER: record.variant} if record.variant else None
                    return web.Response(
                        body=answer, status=upstream.status, content_type="application/json", headers=variant
                    )
                pool.report(replica_id, ok=True)
                return await _stream(request, pool, replica_id, upstream, record, tenant_deadline)
            finally:
                upstream.release()
    except BackendError as exc:
        record.error = type(exc).__name__
        if _counts_against_replica(exc, tenant_deadline):
            pool.report(replica_id, ok=False)
        error = to_gateway_error(exc)
        if isinstance(exc, EngineUnavailable | StreamBroken) or (isinstance(exc, EngineRejected) and exc.status == 503):
            raise RetryableFailure(error) from exc
        raise error from exc


def _remaining(deadline: float) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise DeadlineExceeded("the request's deadline passed before it was sent")
    return remaining


def _counts_against_replica(exc: BackendError, tenant_deadline: bool) -> bool:
    """A replica fault, unless it is a timeout of the tenant's own (shorter) deadline, which says nothing of it."""
    return _replica_fault(exc) and not (tenant_deadline and isinstance(exc, EngineTimeout))


def _replica_fault(exc: BackendError) -> bool:
    """Whether the failure says something about the replica (not about the request, its deadline or the adapter)."""
    if isinstance(exc, AdapterCacheFull):
        return False  # busy with other adapters, not broken
    if isinstance(exc, EngineRejected):
        return exc.status >= 500
    if isinstance(exc, DeadlineExceeded):
        return False
    return isinstance(exc, EngineUnavailable | EngineTimeout | StreamBroken)


async def _load_within_deadline(
    telemetry: Telemetry, pool: Pool, replica: Replica, adapter: AdapterRef, deadline: float
) -> None:
    """Wait for the adapter's load; the load goes on for others (it is shielded), this request stops waiting at its
    deadline."""
    replica_id = replica.endpoint.id
    with telemetry.span("adapter.load", **{"tenantgate.adapter": adapter.engine_name}):
        try:
            async with asyncio.timeout(_remaining(deadline)):
                await pool.residency.ensure(replica_id, adapter)
        except TimeoutError as exc:
            raise DeadlineExceeded(f"{replica_id} did not load the adapter within the request's deadline") from exc


async def _send(pool: Pool, replica: Replica, engine_request: EngineRequest) -> EngineResponse:
    adapter, replica_id = engine_request.adapter, replica.endpoint.id
    try:
        return await pool.driver.send(replica.endpoint, engine_request)
    except AdapterCacheFull:
        if adapter is not None:  # the engine does not hold it: stop routing by it being there
            await pool.residency.lost(replica_id, adapter.engine_name)
        raise
    except AdapterNotLoaded:
        if adapter is None:
            raise
        # The engine lost the adapter (restart, manual unload) since we loaded it: load it again, once.
        log.warning("adapter %s vanished from %s/%s; reloading", adapter.engine_name, pool.name, replica_id)
        await pool.residency.lost(replica_id, adapter.engine_name)
        await pool.residency.ensure(replica_id, adapter)
        return await pool.driver.send(replica.endpoint, engine_request)


async def _stream(
    request: web.Request,
    pool: Pool,
    replica_id: str,
    upstream: EngineResponse,
    record: RequestRecord,
    tenant_deadline: bool,
) -> web.StreamResponse:
    telemetry = request.app[TELEMETRY]
    headers = {**_SSE_HEADERS, VARIANT_HEADER: record.variant} if record.variant else _SSE_HEADERS
    response = web.StreamResponse(status=upstream.status, headers=headers)
    await response.prepare(request)
    try:
        async for chunk in upstream.chunks():
            if record.first_byte is None:
                telemetry.first_byte(record)
            record.read_usage(chunk)
            await response.write(chunk)
    except BackendError as exc:
        log.warning("stream from %s/%s broke after it started: %s", pool.name, replica_id, exc)
        record.error = type(exc).__name__
        if _counts_against_replica(exc, tenant_deadline):
            pool.report(replica_id, ok=False)
        await response.write(to_gateway_error(exc).sse_event())
    await response.write_eof()
    return response


def to_gateway_error(exc: BackendError) -> GatewayError:
    if isinstance(exc, AdapterCacheFull):
        return WorkingSetFull("The model replica has no room for this adapter now; retry shortly.")
    if isinstance(exc, EngineTimeout):
        return UpstreamTimeout("The model replica did not answer in time.")
    if isinstance(exc, EngineUnavailable):
        return UpstreamError("The model replica is unavailable; try again.")
    if isinstance(exc, AdapterLoadFailed):
        return UpstreamError("The model could not be loaded on its replica.")
    if isinstance(exc, EngineRejected) and 400 <= exc.status < 500 and exc.status != 404:
        return InvalidRequest(exc.message)  # the engine's own validation, e.g. max_tokens over the context
    return UpstreamError("The model replica failed to answer.")
