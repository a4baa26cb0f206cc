"""Send a routed request to its replica and relay the answer: whole, or chunk by chunk as the engine streams.

Engine errors are mapped to gateway errors here, at the boundary. Once the first byte of a stream has gone to
the client, an error can only end the stream with an OpenAI error event.
"""

from __future__ import annotations

import logging

from aiohttp import web

from backends.base import AdapterRef, EngineRequest, EngineResponse
from backends.errors import (
    AdapterLoadFailed,
    AdapterNotLoaded,
    BackendError,
    EngineRejected,
    EngineTimeout,
    EngineUnavailable,
)
from gateway.errors import GatewayError, InvalidRequest, UpstreamError, UpstreamTimeout
from gateway.fleet import Pool, Replica
from gateway.tenancy import Target

log = logging.getLogger(__name__)

_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


async def relay(
    request: web.Request, pool: Pool, replica: Replica, target: Target, engine_request: EngineRequest
) -> web.StreamResponse:
    try:
        upstream = await _open(pool, replica, target, engine_request)
        try:
            if not engine_request.stream:
                body = await upstream.read()
                return web.Response(body=body, status=upstream.status, content_type="application/json")
            return await _stream(request, upstream)
        finally:
            upstream.release()
    except BackendError as exc:
        raise to_gateway_error(exc) from exc


async def _open(pool: Pool, replica: Replica, target: Target, engine_request: EngineRequest) -> EngineResponse:
    if target.adapter is None:
        return await pool.driver.send(replica.endpoint, engine_request)
    adapter = AdapterRef(target.engine_model, target.adapter.source)
    replica_id = replica.endpoint.id
    await pool.residency.ensure(replica_id, adapter)
    try:
        return await pool.driver.send(replica.endpoint, engine_request)
    except AdapterNotLoaded:
        # The engine lost the adapter (restart, manual unload) since we loaded it: load it again, once.
        log.warning("adapter %s vanished from %s/%s; reloading", adapter.engine_name, pool.name, replica_id)
        await pool.residency.lost(replica_id, adapter.engine_name)
        await pool.residency.ensure(replica_id, adapter)
        return await pool.driver.send(replica.endpoint, engine_request)


async def _stream(request: web.Request, upstream: EngineResponse) -> web.StreamResponse:
    response = web.StreamResponse(status=upstream.status, headers=_SSE_HEADERS)
    await response.prepare(request)
    try:
        async for chunk in upstream.chunks():
            await response.write(chunk)
    except BackendError as exc:
        log.warning("stream broke after it started: %s", exc)
        await response.write(to_gateway_error(exc).sse_event())
    await response.write_eof()
    return response


def to_gateway_error(exc: BackendError) -> GatewayError:
    if isinstance(exc, EngineTimeout):
        return UpstreamTimeout("The model replica did not answer in time.")
    if isinstance(exc, EngineUnavailable):
        return UpstreamError("The model replica is unavailable; try again.")
    if isinstance(exc, AdapterLoadFailed):
        return UpstreamError("The model could not be loaded on its replica.")
    if isinstance(exc, EngineRejected) and 400 <= exc.status < 500 and exc.status != 404:
        return InvalidRequest(exc.message)  # the engine's own validation, e.g. max_tokens over the context
    return UpstreamError("The model replica failed to answer.")
