"""The tenant-facing OpenAI endpoints and the process probes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from gateway.appkeys import STATE, TELEMETRY, TRAFFIC
from gateway.errors import GatewayError, Overloaded
from gateway.observe.telemetry import RequestRecord, Telemetry
from gateway.serving.connections import authenticated
from gateway.serving.context import RequestContext
from gateway.serving.dispatch import RETRY_SOON, dispatch
from gateway.serving.incoming import AiohttpIncoming, Incoming
from gateway.serving.json_body import RefusedInput
from gateway.serving.openai_request import InferenceRequest, Kind, parse_inference
from gateway.serving.openapi import openapi
from gateway.serving.whole_answer import VARIANT_HEADER
from gateway.tenants.admission import (
    clamp_usage,
    completion_ceiling,
    estimate_tokens,
    prompt_ceiling,
    unreported_usage,
)
from gateway.tenants.identity import identify

# nginx's code for a client that went away before the answer: counted, never sent.
CLIENT_CLOSED_REQUEST = 499

# Content part types whose tokens their bytes bound (gateway/tenants/admission.py).
_TEXT = frozenset({"text"})

_PATHS: dict[Kind, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


async def _serve(
    request: Incoming, app: web.Application, kind: Kind, record: RequestRecord, telemetry: Telemetry
) -> int:
    state = app[STATE]
    serving, limits = state.serving, state.config.limits
    with telemetry.span("admission"):
        auth = serving.config.auth
        peer = request.remote if auth.trusted_header else None  # read only where it counts (a property, per call)
        tenant = identify(serving.tenants, request.headers, peer, auth)
        request.authenticated()
        record.tenant = tenant.id
        if request.body_in():  # the whole body is in (the usual case): nothing to wait for, nothing to hold
            body = request.body_now()
            if body is None:
                body = await request.read_body()
        else:  # a half-sent body holds one of the tenant's concurrent requests while it comes
            with state.admission.reading_body(tenant.id):
                body = await request.read_body()
        inference: InferenceRequest = parse_inference(
            body, kind, max_depth=limits.max_json_depth, max_prompt_chars=limits.max_prompt_chars,
            max_choices=limits.max_choices, max_containers=limits.max_json_containers,
        )  # fmt: skip
        record.stream = inference.stream
        session_id = request.headers.get("x-session-id") or inference.user
        routed = serving.tenants.route(tenant, inference.model, session_id, serving.config.routing)
        target = routed.target
        pool_config = serving.fleet.pools[target.pool].config
        inference.check_pool(pool_config.content_part_types, pool_config.chat_template_kwargs)
        max_tokens = state.admission.check_max_tokens(tenant.id, inference.max_tokens)
        estimate = estimate_tokens(inference.prompt_chars, max_tokens, inference.choices)
        # A tenant without limits takes nothing: no coroutine to make and await for it.
        ticket = state.admission.unlimited(tenant.id) or await state.admission.admit(tenant.id, estimate)
        tenant_limits = state.admission.limits(tenant.id)
    # The key's traffic counts the request now, as it is placed (no await from here to placing it): counted at its
    # end, a request that waited in an engine's queue counted late, where the plan must act (observe/traffic.py).
    meter = app[TRAFFIC].meter
    meter.placed(target.pool, routed.key)
    try:
        # What serves now: a reload may have swapped fleets while the body was read or admission awaited. From here
        # to placing the request there is no await, so the fleet counts it before it could be retired.
        serving = state.serving
        if serving.fleet.in_flight >= limits.max_in_flight:
            raise Overloaded("The gateway is at its limit of requests in flight; retry shortly.", headers=RETRY_SOON)
        record.adapter, record.pool = target.model, target.pool
        pool = serving.fleet.pools[target.pool]
        timeout_s = (tenant_limits and tenant_limits.request_timeout_s) or pool.config.request_timeout_s
        ctx = RequestContext(  # by position, in the fields' order: a call by keyword costs twice as much
            tenant,
            target,
            routed.variant,
            routed.key,
            target.adapter_ref,
            _PATHS[kind],
            inference.for_engine(target.engine_model, max_tokens=max_tokens, cache_salt=target.cache_salt),
            inference.stream,
            inference.stream and not inference.client_wants_usage,  # strip_usage
            time.monotonic() + timeout_s,  # deadline
            timeout_s < pool.config.request_timeout_s,  # tenant_deadline
        )
        try:
            return await dispatch(request, telemetry, pool, ctx, record)
        except GatewayError as exc:
            if ctx.variant:  # a failure names the version it failed on, as an answer names the one that served it
                exc.headers = {**exc.headers, VARIANT_HEADER: ctx.variant}
            raise
    finally:
        # The engine's figures, believed up to what this request could have used (a bad engine's absurd figure is
        # clamped and counted, never a debt the tenant cannot pay off).
        context = pool_config.context_tokens
        prompt_most = prompt_ceiling(len(body), inference.part_types <= _TEXT, context)
        completion_most = completion_ceiling(max_tokens, inference.choices, context)
        used = clamp_usage(record, telemetry.metrics, prompt_most, completion_most)  # the app's metrics
        if used is None and record.events:  # a stream cut before its usage event (the client left, the engine broke)
            used = unreported_usage(estimate, inference.prompt_chars, record.events, prompt_most + completion_most)
        ticket.settle(used)
        # The key's traffic (gateway/placement/): what the engine reported, else what admission estimated, and
        # whether the scheduler sent it off the key's replica set for demand (what a replica set grows on).
        spilled = not _DEMAND_SPILLS.isdisjoint(record.reasons) and record.replica not in (
            serving.fleet.pools[target.pool].ring.replica_set(routed.key)
        )
        # The seconds it held an engine's seat: a stream's from its first byte (the wait before it, in the engine's
        # queue or for a load, is no demand for seats), a whole answer's from its arrival (upper bound).
        now, first = time.perf_counter(), record.first_byte
        busy_s = now - (first if record.stream and first is not None else record.started)
        meter.ended(target.pool, routed.key, used if used is not None else estimate, spilled, busy_s)


# A decision left the key's home because the home was over its bound, or another replica was predicted faster.
_DEMAND_SPILLS = frozenset({"spill:over_capacity", "spill:faster"})


async def inference(request: Incoming, app: web.Application, kind: Kind) -> int:
    """Serve one request to ``kind``'s endpoint, recorded around ``_serve``: the status it was answered with; what
    it raised (a ``GatewayError``, say) is its server's to answer."""
    telemetry = app[TELEMETRY]
    record = RequestRecord(_PATHS[kind])
    with telemetry.request_span(record, request.headers):
        try:
            status = record.status = await _serve(request, app, kind, record, telemetry)
            return status
        except GatewayError as exc:
            record.status = exc.status
            if isinstance(exc, RefusedInput):  # the access line is then the refusal's one log line
                record.error = f"refused:{exc.reason}"
            raise
        except web.HTTPException as exc:  # e.g. 413 from aiohttp's body limit
            record.status = exc.status
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            record.status = record.answered if record.answered is not None else CLIENT_CLOSED_REQUEST
            raise
        finally:
            telemetry.finish(record)


def _endpoint(kind: Kind) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """The aiohttp handler of ``kind``'s endpoint (requests the gateway's own server hands to aiohttp's, and the
    in-process tests' servers)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        incoming = AiohttpIncoming(request)
        await inference(incoming, request.app, kind)
        assert incoming.response is not None  # every status returned was answered through it
        return incoming.response

    handler.__name__ = handler.__qualname__ = kind
    return handler


completions, chat_completions = _endpoint("completions"), _endpoint("chat")
# The paths gateway/app.py's runner serves without aiohttp's router (a POST to each).
DIRECT_PATHS = frozenset(_PATHS.values())


async def models(request: web.Request) -> web.Response:
    serving = request.app[STATE].serving
    tenant = identify(serving.tenants, request.headers, request.remote, serving.config.auth)
    authenticated(request)
    created = int(time.time())
    data = [{"id": name, "object": "model", "created": created, "owned_by": "tenantgate"} for name in tenant.targets]
    return web.json_response({"object": "list", "data": data})


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Ready means this gateway can serve: pre-warm is done, some pool has a healthy replica, and shutdown has not
    begun. A pool without one answers its own requests with 503 and is listed here (and tenantgate_pool_up is 0),
    but does not take the gateway out of its Service: the other pools' tenants would lose service too. A down
    residency store is reported but does not make the gateway unready (it routes on from its local view)."""
    state = request.app[STATE]
    fleet = state.serving.fleet
    detail: dict[str, object] = {"residency_store": "up" if fleet.store_up else "down (routing from the local view)"}
    down = fleet.unready_pools
    if down:
        detail["pools_without_healthy_replica"] = down
    if state.draining:
        return web.json_response({"status": "not ready", "reason": "shutting down", **detail}, status=503)
    if len(down) == len(fleet.pools):
        return web.json_response(
            {"status": "not ready", "reason": "no pool has a healthy replica", **detail}, status=503
        )
    if not fleet.warmed:
        return web.json_response({"status": "not ready", "reason": "pre-warming adapters", **detail}, status=503)
    return web.json_response({"status": "ready", **detail})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/openapi.json", openapi)
