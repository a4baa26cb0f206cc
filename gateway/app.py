"""The app factory: typed app keys, one cleanup context per resource, the error middleware and the routes."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, cast

from aiohttp import hdrs, web
from aiohttp.web_urldispatcher import UrlMappingMatchInfo
from opentelemetry.sdk.trace.export import SpanExporter

from backends.base import EngineLoad
from gateway.admin import operator
from gateway.admin import routes as admin
from gateway.admin.auth import admin_token, metrics_token
from gateway.admin.drains import DRAINS, Drains, following
from gateway.admin.siblings import SIBLINGS, Siblings
from gateway.appkeys import ADMIN_TOKEN, METRICS, PLACER, STATE, TELEMETRY, TRAFFIC
from gateway.config import GatewayConfig, StateConfig
from gateway.error_answers import error_answer, unread_body
from gateway.fleet.collector import FleetCollector
from gateway.fleet.discovery import discover
from gateway.fleet.discovery import interval_s as discovery_interval_s
from gateway.fleet.fleet import Fleet, make_store
from gateway.fleet.host_scrape import HostScrapes
from gateway.observe import shared_metrics
from gateway.observe.metrics import GatewayMetrics
from gateway.observe.telemetry import Telemetry
from gateway.observe.traffic import TrafficMeter
from gateway.placement.collector import PlacementCollector, TrafficCollector
from gateway.placement.exchange import FleetTraffic, TrafficExchange
from gateway.placement.placer import Placer
from gateway.placement.store import HomesStore, LocalHomesStore, RedisHomesStore
from gateway.redis_client import RedisAccess, make_client, redis_access, secret
from gateway.reload import close_retiring, rediscover, reload_answer
from gateway.reload_fanout import FANOUT, GATEWAY_ID, Fanout
from gateway.residency import owner
from gateway.residency.lifecycle import every
from gateway.residency.signal_redis import RedisSlotChannel
from gateway.residency.timed import TimedStore
from gateway.serving import ingress
from gateway.serving.connections import request_began
from gateway.state import GatewayState, Serving
from gateway.tasks import cancel_and_wait
from gateway.tenants.admission import Admission
from gateway.tenants.directory import TenantDirectory
from gateway.tenants.rate_buckets import RedisBuckets
from gateway.tenants.registry import Registry
from gateway.tenants.signing import derived_key
from gateway.workers import WorkerSockets

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ServerHandler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


def registry_key(state: StateConfig, admin_token: str, environ: Mapping[str, str]) -> bytes | None:
    """The tenant registry's signing key: configured, else derived from the admin token, else none (then nothing
    from Redis is believed and no change can be stored there)."""
    configured = secret(environ, state.registry_key_env, state.registry_key_file, "state.registry_key")
    if configured is not None:
        return configured.encode()
    return derived_key(admin_token) if admin_token else None


def _fleet_traffic(config: GatewayConfig, access: RedisAccess, metrics: GatewayMetrics) -> FleetTraffic:
    """This gateway's traffic meter, and with Redis the exchange that merges it with the other gateways'."""
    settings = config.traffic
    meter = TrafficMeter(settings.window_s, settings.max_keys, settings.max_keys_per_interval)
    exchange = None
    if config.state.redis_url is not None:
        exchange = TrafficExchange(
            config.state.redis_url, operation_timeout_s=config.state.operation_timeout_s,
            stale_after_s=3 * settings.interval_s, cluster=config.state.cluster, access=access,
            max_keys=settings.max_keys, repairs=metrics.key_repairs,
        )  # fmt: skip
    return FleetTraffic(meter, GATEWAY_ID, settings.max_keys, exchange)


def _every(
    interval_s: float, work: Callable[[], Awaitable[None]], what: str, close: Callable[[], Awaitable[None]]
) -> Callable[[web.Application], AsyncIterator[None]]:
    """A cleanup context that runs ``work`` every ``interval_s`` while the app runs, then ``close``."""

    async def context(app: web.Application) -> AsyncIterator[None]:
        ticks = asyncio.create_task(every(interval_s, work, what), name=what)
        yield
        await cancel_and_wait([ticks])
        await close()

    return context


def _placer(config: GatewayConfig, access: RedisAccess, metrics: GatewayMetrics) -> Placer:
    """Homes from traffic: the table in Redis, led by whichever gateway holds the lease; else this gateway's own."""
    store: HomesStore = LocalHomesStore()
    state, url = config.state, config.state.redis_url
    if url is not None:
        client = make_client(url, state.operation_timeout_s, cluster=state.cluster, access=access)
        lease_s = 3 * config.placement.interval_s
        store = RedisHomesStore(
            client, operation_timeout_s=state.operation_timeout_s, lease_s=lease_s,
            repairs=metrics.key_repairs,
        )  # fmt: skip
    return Placer(store, GATEWAY_ID)


@web.middleware
async def front(request: web.Request, handler: Handler, surface: bool = True) -> web.StreamResponse:
    """The app's one middleware, what three did in this order (each a coroutine and an await more per request:
    4-7 us of CPU per request at make bench-overhead's load): the connection guard learns when a request's
    head is in and when it is done (serving/connections.py); every error leaves as an OpenAI error body, nothing a
    client sends can take the gateway down (error_answers.py); a path on the wrong listener is answered as any
    unknown route (admin/operator.py). ``surface`` False: the caller knows the listener check has nothing to do
    (``direct``, for an app without an operator listener: no path is on the wrong one)."""
    connection = request_began(request)
    try:
        try:
            if surface:
                operator.check_surface(request)
            response = await handler(request)
        except Exception as exc:
            response = error_answer(request, exc)
        if not request.content.is_eof():  # the handler left some body unread (a refusal, a route that reads none)
            unread_body(request, response)
        return response
    finally:
        if connection is not None:
            connection.ended()


class GatewayRunner(web.AppRunner):
    """aiohttp's runner for the gateway app, whose server hands the tenant API's inference requests (a POST to one of
    ``ingress.DIRECT_PATHS``) to their handler under ``front`` at once: what aiohttp's ``Application._handle`` does
    first for every request (the router's resolve, a match info built and frozen, the middleware chain and its
    ``current_app`` wrapper: two coroutine frames more) is done once here, at start-up, for those routes. Everything
    else (another path or method, a request with ``Expect``, which aiohttp answers with its expect handler) goes
    through ``Application._handle`` as before, and so do the in-process tests' servers (aiohttp's own runner).
    ``request.app`` and ``request.match_info`` read as the router would have made them: one frozen match info per
    route, shared by its requests (a route without path parameters matches the same way every time)."""

    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        # Drains a site's stop began that run beside aiohttp's own (the gateway's own server's connections:
        # serving/own_server.py's OwnSite), awaited after it and before the app's cleanup closes the fleet they are
        # served by: every connection drains within one shutdown timeout, not one kind after the other.
        self.drains: list[asyncio.Task[None]] = []

    async def _cleanup_server(self) -> None:
        for failed in await asyncio.gather(*self.drains, return_exceptions=True):  # the app's cleanup runs anyway
            if isinstance(failed, Exception):
                log.error("a connection drain failed", exc_info=failed)
        self.drains.clear()
        await super()._cleanup_server()

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.request_handler = direct(self.app, server.request_handler)
        return server


def direct(app: web.Application, handle: ServerHandler) -> ServerHandler:
    """The request handler ``GatewayRunner`` gives its server: ``handle`` (the app's own) for all but the direct
    routes."""
    routes: dict[str, tuple[Handler, UrlMappingMatchInfo]] = {}
    for resource in app.router.resources():
        if resource.canonical not in ingress.DIRECT_PATHS:
            continue
        for route in resource:
            if route.method == hdrs.METH_POST:
                match_info = UrlMappingMatchInfo({}, route)
                match_info.add_app(app)
                match_info.freeze()
                routes[resource.canonical] = (route.handler, match_info)

    # With no operator listener (fixed for the app's life: a reload keeps its listeners) the inference routes are on
    # the one listener there is: front's listener check (the app read through the match info, a lookup in it) has
    # nothing to refuse.
    surface = app[operator.SEPARATE_LISTENER]

    def handler(request: web.BaseRequest) -> Awaitable[web.StreamResponse]:
        # Not a coroutine itself: it hands the server the one to await (a frame less for the request to resume).
        found = routes.get(request.rel_url.path_safe) if request.method == hdrs.METH_POST else None
        if found is None or hdrs.EXPECT in request.headers:
            return handle(request)
        app_request = cast(web.Request, request)  # the app's request factory makes every request a web.Request
        endpoint, app_request._match_info = found
        return front(app_request, endpoint, surface)

    return handler


def create_app(
    config: GatewayConfig,
    config_path: Path | None = None,
    span_exporter: SpanExporter | None = None,
    worker: WorkerSockets | None = None,
) -> web.Application:
    """The gateway app; ``config_path`` is what a reload re-reads; ``span_exporter`` replaces the configured
    trace exporter (tests use an in-memory one); ``worker``: this process is one of serve --workers' workers."""
    app = web.Application(middlewares=[front], client_max_size=config.limits.max_body_bytes)
    metrics = app[METRICS] = GatewayMetrics()
    buckets = None
    access = redis_access(config.state, os.environ)  # ConfigError: a named password that is not there
    if config.state.redis_url is not None:
        buckets = RedisBuckets(
            config.state.redis_url,
            operation_timeout_s=config.state.operation_timeout_s,
            cluster=config.state.cluster,
            access=access,
            repairs=metrics.key_repairs,
        )
    redis_url, timeout_s = config.state.redis_url, config.state.operation_timeout_s
    token = app[ADMIN_TOKEN] = admin_token(config.admin, os.environ)  # ConfigError: a weak token is refused
    registry = Registry(
        redis_url, operation_timeout_s=timeout_s, cluster=config.state.cluster, access=access,
        signing_key=registry_key(config.state, token, os.environ), metrics=metrics,
    )  # fmt: skip
    state = app[STATE] = GatewayState(config, config_path, Admission(metrics, buckets), registry)
    app[operator.METRICS_TOKEN] = metrics_token(config.admin, os.environ)
    app[operator.SEPARATE_LISTENER] = config.admin.listen is not None
    telemetry = app[TELEMETRY] = Telemetry(config.telemetry, metrics, span_exporter)
    metrics.watch(FleetCollector(lambda: state.serving.fleet if state.started else None))

    def took_scrape(pool: str, at: float, loads: dict[str, EngineLoad | None]) -> None:
        """A scrape the host's scraping worker shared (gateway/fleet/host_scrape.py), for the serving fleet."""
        if state.started and (serving_pool := state.serving.fleet.pools.get(pool)) is not None:
            serving_pool.took_scrape(at, loads)

    def took_probes(pool: str, healthy: dict[str, bool]) -> None:
        """A probe round the host's probing worker shared (gateway/fleet/host_scrape.py), for the serving fleet."""
        if state.started and (serving_pool := state.serving.fleet.pools.get(pool)) is not None:
            serving_pool.took_probes(healthy)

    async def fleet_context(app: web.Application) -> AsyncIterator[None]:
        if config.state.identity_dir is not None:  # before any fleet names itself on a lock
            owner.claim(Path(config.state.identity_dir))
        await registry.start(on_change=state.refresh_tenants)
        if worker is not None and worker.workers > 1:  # one worker scrapes and probes the engines for the host's
            state.scrapes = HostScrapes(worker)
            await state.scrapes.start(took_scrape, took_probes)
        discovered = await discover(config, {})
        serving_config = state.compose(config, discovered)
        store = state.residency_store = TimedStore(make_store(config, access, metrics), metrics)
        slots, following = None, None
        if redis_url is not None:  # one gateway alone sees its own slot releases: no signal to follow
            slots = RedisSlotChannel(
                redis_url, metrics, operation_timeout_s=timeout_s, cluster=config.state.cluster, access=access
            )
            state.slot_signal = slots.signal
            following = asyncio.create_task(slots.run(), name="slot signal")
        fleet = Fleet(
            serving_config, metrics, store=store, homes_from=config, scrapes=state.scrapes, signal=state.slot_signal
        )
        await fleet.start()
        state.swap(Serving(serving_config, TenantDirectory(serving_config), fleet), discovered=discovered)
        every_s = discovery_interval_s(config)
        rediscovery = None
        if every_s is not None:
            rediscovery = asyncio.create_task(every(every_s, lambda: rediscover(app), "discovery"), name="discovery")
        yield
        await cancel_and_wait([rediscovery])
        await registry.close()
        await close_retiring()
        await state.serving.fleet.close()
        if state.scrapes is not None:
            state.scrapes.close()
        if slots is not None and following is not None:
            slots.stop()
            await cancel_and_wait([following])
            await slots.close()
        await store.close()
        if buckets is not None:
            await buckets.close()
        telemetry.close()

    app.cleanup_ctx.append(fleet_context)
    # The operator's drains, beside the fleet (a reload keeps them) and with Redis shared by every gateway.
    app[DRAINS] = Drains(
        redis_url, operation_timeout_s=timeout_s, cluster=config.state.cluster, access=access,
        repairs=metrics.key_repairs,
    )  # fmt: skip
    app.cleanup_ctx.append(following)
    traffic = app[TRAFFIC] = _fleet_traffic(config, access, metrics)
    metrics.watch(TrafficCollector(traffic, config.traffic.metric_keys))

    async def traffic_tick() -> None:
        await traffic.tick()
        if state.started:  # a replica that comes back is filled with its busiest keys' adapters first
            state.serving.fleet.order_fill_by(traffic.fleet)

    app.cleanup_ctx.append(_every(config.traffic.interval_s, traffic_tick, "traffic", traffic.close))
    placer = app[PLACER] = _placer(config, access, metrics)
    metrics.watch(PlacementCollector(placer))

    async def placement_tick() -> None:
        # Homes from traffic only with routing.home_placement: traffic (a reload may turn it on or off).
        if state.started and state.config.routing.home_placement == "traffic":
            measured = traffic.meter.measured_s() >= state.config.traffic.window_s
            await placer.tick(state.config, state.serving.fleet, traffic.fleet, measured=measured)

    async def placement_first_look(app: web.Application) -> AsyncIterator[None]:
        """The stored homes table, read before the gateway listens (its ticks begin an interval later)."""
        if state.started and config.routing.home_placement == "traffic":
            await placer.first_look(state.serving.fleet)
        yield

    app.cleanup_ctx.append(placement_first_look)
    app.cleanup_ctx.append(_every(config.placement.interval_s, placement_tick, "placement", placer.close))
    if config.state.redis_url is not None and config_path is not None:  # reload every gateway sharing the Redis
        fanout = app[FANOUT] = Fanout(
            config.state.redis_url, lambda: reload_answer(app), operation_timeout_s=timeout_s,
            cluster=config.state.cluster, access=access, repairs=metrics.key_repairs,
        )  # fmt: skip
        app.cleanup_ctx.append(fanout.running)
    if worker is not None and worker.workers > 1:  # the admin API answers for every worker
        siblings = app[SIBLINGS] = Siblings(app, worker)
        app.cleanup_ctx.append(siblings.running)
    if shared_metrics.shared():  # this worker's metric values written for the others' scrapes, and at its end
        flush = shared_metrics.flush_now
        app.cleanup_ctx.append(_every(shared_metrics.FLUSH_S, flush, "metrics flush", flush))
    ingress.add_routes(app)
    operator.add_routes(app)
    admin.add_routes(app)
    return app
