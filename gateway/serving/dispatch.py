"""A request's life after admission, in one place: place it (a lease on a replica, its adapter marked in use),
make sure its adapter is loaded there, send it, relay the answer, and on a failure decide once what it means
(gateway/failures.py): report it to the replica's outlier detection, retry once elsewhere, or answer the error.
A failure that may be the request's own doing (an engine 5xx) is reported after the retry, which says whose it
was: the rule is gateway/fleet/outlier.py's.

The retry rule: a request that failed before its first byte reached the client, in a way another replica may not
(refused connection, dropped answer, engine overloaded), is tried once more on another replica, while the pool's
retry budget allows and its deadline has not passed.
"""

from __future__ import annotations

import asyncio
import logging
import time

from backends.base import EngineRequest, EngineResponse
from backends.errors import AdapterCacheFull, AdapterLoadFailed, AdapterNotLoaded, BackendError, DeadlineExceeded
from gateway.errors import GatewayError, NoHealthyReplica, Overloaded
from gateway.failures import Verdict, classify
from gateway.fleet.outlier import Failure
from gateway.fleet.pool import Lease, Pool
from gateway.observe.telemetry import RequestRecord, Telemetry
from gateway.routing.decision import RoutingDecision
from gateway.serving import relay
from gateway.serving.context import RequestContext
from gateway.serving.incoming import Incoming

log = logging.getLogger(__name__)

RETRY_SOON = {"Retry-After": "1"}


async def dispatch(
    request: Incoming, telemetry: Telemetry, pool: Pool, ctx: RequestContext, record: RequestRecord
) -> int:
    """Serve ``ctx`` on ``pool``: the status the client was answered with; raises a ``GatewayError`` when it
    cannot answer."""
    lease = _first_lease(telemetry, record, pool, ctx)
    if lease.replica is None:
        raise _unavailable(lease.decision)
    tenant = ctx.tenant.id
    # The first attempt's lease when it failed in a way that may be the request's own doing (outlier.py): how the
    # retry ends decides whether it counts against that replica.
    suspect: Lease | None = None
    while True:
        with lease:
            record.replica = lease.replica_id
            try:
                status, broken = await _attempt(request, telemetry, ctx, record, lease)
            except BackendError as exc:
                verdict = classify(exc, ctx.tenant_deadline)
                record.error, record.error_replica = type(exc).__name__, lease.replica_id
                if isinstance(exc, AdapterLoadFailed):  # the engine's reason, for the operator (not the client)
                    record.error_detail = str(exc)
                failure, failed_on = exc, lease.replica_id
            else:
                # The attempt's one outcome report, once the client has its answer: a stream that broke mid-way
                # reports the break's blame. A success does not wipe out failures the replica had since this
                # attempt started (health.py).
                lease.report(None if broken is None else Failure(broken.blame, tenant))
                if suspect is not None:  # the same request went well here: the first replica's failure was its own
                    suspect.report(Failure("suspect", tenant, succeeded_elsewhere=broken is None))
                return status
        # The failed attempt's lease is released: try once more elsewhere, or answer its error.
        if suspect is not None:  # this was the retry, and it failed too
            if verdict.blame != "suspect":  # else it failed alike on two replicas: the request's doing, neither counts
                suspect.report(Failure("suspect", tenant))
                lease.report(Failure(verdict.blame, tenant))
            raise verdict.error from failure
        retry = _retry_lease(record, pool, ctx, failed_on) if verdict.retryable else None
        if verdict.blame == "suspect" and retry is not None:
            suspect = lease
        else:
            lease.report(Failure(verdict.blame, tenant))
        if retry is None:
            raise verdict.error from failure
        lease = retry


async def _attempt(
    request: Incoming, telemetry: Telemetry, ctx: RequestContext, record: RequestRecord, lease: Lease
) -> tuple[int, Verdict | None]:
    """One try on the leased replica: the status the client was answered with, and the verdict on a stream that
    broke after its first byte (None if it did not). Raises ``BackendError`` only before the client has seen a
    byte."""
    if ctx.adapter is not None and not lease.adapter_resident():
        await _load_within_deadline(telemetry, lease, ctx.deadline)
        if lease.starting:
            record.on_first_byte = lease.first_byte
    with telemetry.upstream_span(lease.replica_id):
        driver, endpoint = lease.pool.driver, lease.pool.replicas[lease.replica_id].endpoint
        try:  # the driver is awaited here, not in a helper coroutine: a frame less for the request to resume
            upstream = await driver.send(endpoint, _engine_request(telemetry, ctx))
        except (AdapterCacheFull, AdapterNotLoaded) as exc:
            upstream = await _adapter_missing(exc, telemetry, lease, ctx)
        try:
            if not ctx.stream:
                answer = await upstream.read()
                return await relay.respond(request, telemetry, ctx, record, upstream, answer), None
            broken: Verdict | None = None

            def stream_broke(exc: BackendError) -> GatewayError:
                nonlocal broken
                log.warning("stream from %s/%s broke after it started: %s", lease.pool.name, lease.replica_id, exc)
                broken = classify(exc, ctx.tenant_deadline)
                record.error, record.error_replica = type(exc).__name__, lease.replica_id
                return broken.error

            try:
                status = await relay.stream(request, telemetry, ctx, record, upstream, stream_broke)
            finally:  # a stream's first byte is its TTFT, what predicted_ttft learns: even if the client left since
                if record.first_byte is not None:
                    telemetry.ttft_learned(record, lease.pool.name, lease.learn_ttft(record.first_byte))
            return status, broken
        finally:
            upstream.release()


async def _adapter_missing(
    exc: AdapterCacheFull | AdapterNotLoaded, telemetry: Telemetry, lease: Lease, ctx: RequestContext
) -> EngineResponse:
    """The engine did not hold the request's adapter when it was sent: a full adapter cache is raised on (the
    record stops counting the adapter there); an engine that lost the adapter gets it once more, and the request
    again, within its deadline."""
    if isinstance(exc, AdapterCacheFull):
        if lease.adapter is not None:  # the engine does not hold it: stop routing by it being there
            await lease.adapter_lost()
        raise exc
    if lease.adapter is None:
        raise exc
    # The engine lost the adapter (restart, manual unload) since we loaded it: load it again, once.
    log.warning(
        "adapter %s vanished from %s/%s; reloading", lease.adapter.engine_name, lease.pool.name, lease.replica_id
    )
    await lease.adapter_lost()
    await _load_within_deadline(telemetry, lease, ctx.deadline)
    return await lease.pool.driver.send(lease.pool.replicas[lease.replica_id].endpoint, _engine_request(telemetry, ctx))


def _engine_request(telemetry: Telemetry, ctx: RequestContext) -> EngineRequest:
    """The request for the engine, with what is left of its deadline now."""
    remaining = _remaining(ctx.deadline)
    return EngineRequest(ctx.engine_path, ctx.body, ctx.stream, telemetry.upstream_headers(), remaining, ctx.adapter)


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


def _first_lease(telemetry: Telemetry, record: RequestRecord, pool: Pool, ctx: RequestContext) -> Lease:
    """Place the request and record why it went where it did. Nothing between placing and the caller's ``with``
    can raise: a lease placed must be released."""
    with telemetry.span("route") as span:
        lease = pool.lease(ctx.key, ctx.adapter)
        record.reasons = lease.decision.reasons
        if telemetry.tracer is not None:  # telemetry never raises: OpenTelemetry drops a bad attribute with a warning
            span.set_attributes(lease.decision.span_attributes())
    return lease


def _retry_lease(record: RequestRecord, pool: Pool, ctx: RequestContext, failed_on: str) -> Lease | None:
    """A lease on another replica for the request's one retry, or None: retries off, already retried, past its
    deadline, nowhere else to go (then the client gets the first failure's own error), or over the retry budget."""
    if not (pool.config.retry.enabled and record.retries == 0 and time.monotonic() < ctx.deadline):
        return None
    lease = pool.lease(ctx.key, ctx.adapter, (failed_on,))
    if lease.replica is None:
        return None
    if not pool.retry_budget.try_spend():
        with lease:  # placed, not used: give its place back
            return None
    lease.decision.reasons.append("retry")
    record.reasons = record.reasons + lease.decision.reasons
    record.retries += 1
    return lease


def _unavailable(decision: RoutingDecision) -> GatewayError:
    if decision.unavailable == "full":
        return Overloaded(
            "Every replica of this model is at its limit of requests in flight; retry shortly.", headers=RETRY_SOON
        )
    return NoHealthyReplica("No replica of this model is available right now; try again shortly.")
