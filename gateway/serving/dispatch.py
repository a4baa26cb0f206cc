"""A request's life after admission, in one place: place it (a lease on a replica, its adapter marked in use),
make sure its adapter is loaded there, send it, relay the answer, and on a failure decide once what it means
(gateway/failures.py): report it to the replica's outlier detection, retry once elsewhere, or answer the error.

The retry rule: a request that failed before its first byte reached the client, in a way another replica may not
(refused connection, dropped answer, engine overloaded), is tried once more on another replica, while the pool's
retry budget allows and its deadline has not passed.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from backends.base import EngineRequest, EngineResponse
from backends.errors import AdapterCacheFull, AdapterNotLoaded, BackendError, DeadlineExceeded
from gateway.errors import GatewayError, NoHealthyReplica, Overloaded
from gateway.failures import Verdict, classify
from gateway.fleet.pool import Lease, Pool
from gateway.observe.telemetry import RequestRecord, Telemetry
from gateway.routing.decision import RoutingDecision
from gateway.serving import relay
from gateway.serving.context import RequestContext

log = logging.getLogger(__name__)

RETRY_SOON = {"Retry-After": "1"}


async def dispatch(
    request: web.Request, telemetry: Telemetry, pool: Pool, ctx: RequestContext, record: RequestRecord
) -> web.StreamResponse:
    """Serve ``ctx`` on ``pool`` and return the client's response; raises a ``GatewayError`` when it cannot."""
    pool.retry_budget.request()
    avoid: tuple[str, ...] = ()
    while True:
        with _lease(telemetry, record, pool, ctx, avoid) as lease:
            if lease.replica is None:
                raise _unavailable(lease.decision)
            record.replica = lease.replica_id
            try:
                response, broken = await _attempt(request, telemetry, ctx, record, lease)
            except BackendError as exc:
                verdict = classify(exc, ctx.tenant_deadline)
                record.error = type(exc).__name__
                if verdict.replica_fault:
                    lease.report(ok=False)
                if not (verdict.retryable and _may_retry(pool, record, ctx.deadline)):
                    raise verdict.error from exc
                avoid = (lease.replica_id,)
                record.retries += 1
            else:
                # The attempt's one outcome report, once the client has its answer: a stream that broke mid-way
                # counts against the replica only when the break says the replica is at fault.
                lease.report(ok=broken is None or not broken.replica_fault)
                return response


async def _attempt(
    request: web.Request, telemetry: Telemetry, ctx: RequestContext, record: RequestRecord, lease: Lease
) -> tuple[web.StreamResponse, Verdict | None]:
    """One try on the leased replica: the client's response, and the verdict on a stream that broke after its first
    byte (None if it did not). Raises ``BackendError`` only before the client has seen a byte."""
    if ctx.adapter is not None and not lease.adapter_resident():
        await _load_within_deadline(telemetry, lease, ctx.deadline)
    broken: Verdict | None = None

    def stream_broke(exc: BackendError) -> GatewayError:
        nonlocal broken
        log.warning("stream from %s/%s broke after it started: %s", lease.pool.name, lease.replica_id, exc)
        broken = classify(exc, ctx.tenant_deadline)
        record.error = type(exc).__name__
        return broken.error

    with telemetry.span("upstream", **{"server.address": lease.replica_id}):
        engine_request = EngineRequest(
            ctx.engine_path, ctx.body, ctx.stream, telemetry.upstream_headers(), _remaining(ctx.deadline), ctx.adapter
        )
        upstream = await _send(lease, engine_request)
        try:
            if ctx.stream:
                return await relay.stream(request, telemetry, ctx, record, upstream, stream_broke), broken
            answer = await upstream.read()
            return relay.respond(telemetry, ctx, record, upstream, answer), None
        finally:
            upstream.release()


async def _send(lease: Lease, engine_request: EngineRequest) -> EngineResponse:
    """Send to the leased replica; an engine that no longer holds the adapter gets it once more."""
    driver, endpoint = lease.pool.driver, lease.pool.replicas[lease.replica_id].endpoint
    try:
        return await driver.send(endpoint, engine_request)
    except AdapterCacheFull:
        if lease.adapter is not None:  # the engine does not hold it: stop routing by it being there
            await lease.adapter_lost()
        raise
    except AdapterNotLoaded:
        if lease.adapter is None:
            raise
        # The engine lost the adapter (restart, manual unload) since we loaded it: load it again, once.
        log.warning(
            "adapter %s vanished from %s/%s; reloading", lease.adapter.engine_name, lease.pool.name, lease.replica_id
        )
        await lease.adapter_lost()
        await lease.load_adapter()
        return await driver.send(endpoint, engine_request)


async def _load_within_deadline(telemetry: Telemetry, lease: Lease, deadline: float) -> None:
    """Wait for the adapter's load; the load goes on for others (it is shielded), this request stops waiting at its
    deadline."""
    assert lease.adapter is not None
    with telemetry.span("adapter.load", **{"tenantgate.adapter": lease.adapter.engine_name}):
        try:
            async with asyncio.timeout(_remaining(deadline)):
                await lease.load_adapter()
        except TimeoutError as exc:
            raise DeadlineExceeded(
                f"{lease.replica_id} did not load the adapter within the request's deadline"
            ) from exc


def _remaining(deadline: float) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise DeadlineExceeded("the request's deadline passed before it was sent")
    return remaining


def _lease(
    telemetry: Telemetry, record: RequestRecord, pool: Pool, ctx: RequestContext, avoid: tuple[str, ...]
) -> Lease:
    """Place the request (a retry: away from where it failed) and record why it went where it did."""
    if avoid:
        lease = pool.lease(ctx.key, ctx.adapter, avoid)
        lease.decision.reasons.append("retry")
        record.reasons = record.reasons + lease.decision.reasons
        return lease
    with telemetry.span("route") as span:
        lease = pool.lease(ctx.key, ctx.adapter)
        record.reasons = lease.decision.reasons
        if span is not None:
            span.set_attributes(lease.decision.span_attributes())
    return lease


def _unavailable(decision: RoutingDecision) -> GatewayError:
    if decision.unavailable == "full":
        return Overloaded(
            "Every replica of this model is at its limit of requests in flight; retry shortly.", headers=RETRY_SOON
        )
    return NoHealthyReplica("No replica of this model is available right now; try again shortly.")


def _may_retry(pool: Pool, record: RequestRecord, deadline: float) -> bool:
    return (
        pool.config.retry.enabled
        and record.retries == 0
        and time.monotonic() < deadline
        and pool.retry_budget.try_spend()
    )
