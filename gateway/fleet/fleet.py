"""The pools of replicas the gateway routes to: their rings, in-flight loads, health and drivers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from functools import partial

from backends.base import AdapterRef, Endpoint, EngineDriver, EngineLoad
from backends.errors import BackendError
from backends.triton import TritonDriver
from backends.vllm import VllmDriver
from gateway.config import GatewayConfig, PoolConfig, ReplicaConfig, RoutingConfig
from gateway.errors import GatewayError
from gateway.fleet.health import ReplicaHealth
from gateway.fleet.retry_budget import RetryBudget
from gateway.observe.metrics import GatewayMetrics
from gateway.residency.lifecycle import PoolResidency, every
from gateway.residency.memory import MemoryStore
from gateway.residency.redis import RedisStore
from gateway.residency.store import ResidencyStore
from gateway.residency.timed import TimedStore
from gateway.routing.decision import ReplicaLoad, RoutingDecision
from gateway.routing.policies import decide
from gateway.routing.reservations import HomeReservations
from gateway.routing.ring import Ring
from gateway.tenants.directory import TenantDirectory, affinity_key

log = logging.getLogger(__name__)


@dataclass
class Replica:
    endpoint: Endpoint
    health: ReplicaHealth
    in_flight: int = 0
    # The engine's own load signals, as last scraped (None until the first scrape answers).
    engine_load: EngineLoad | None = None

    @property
    def healthy(self) -> bool:
        """Takes traffic now: up by its probes, not being re-warmed, not ejected."""
        return self.health.available()


class Pool:
    def __init__(
        self,
        config: PoolConfig,
        routing: RoutingConfig,
        driver: EngineDriver,
        residency: PoolResidency,
        max_in_flight_per_replica: int = 512,
    ) -> None:
        self.config = config
        self.name = config.name
        self.driver = driver
        self.residency = residency
        self.balance_factor = routing.balance_factor
        self.capacity_floor = routing.capacity_floor
        self.max_in_flight_per_replica = max_in_flight_per_replica
        self.prefer_resident = routing.prefer_resident
        self.replicas = {
            replica_id: Replica(endpoint, ReplicaHealth(config.health, config.outlier, config.slow_start_s))
            for replica_id, endpoint in residency.endpoints.items()
        }
        self.retry_budget = RetryBudget(config.retry.budget_ratio, config.retry.min_per_s)
        self.ring = Ring(list(self.replicas), routing.vnodes)
        reserve = config.policy == "bounded_consistent_hash"
        self.reservations = HomeReservations(routing.home_reservation_s if reserve else 0.0)
        # Per replica, what to load and warm when it comes (back) up: (adapter, pinned).
        self.prewarm: dict[str, list[tuple[AdapterRef, bool]]] = {replica_id: [] for replica_id in self.replicas}
        self._ticks = 0
        self._welcomes: set[asyncio.Task[None]] = set()
        self.in_flight = 0
        # Set while no request is in flight: a retired pool waits on it before it closes.
        self.idle = asyncio.Event()
        self.idle.set()

    def explain(self, key: str, engine_model: str | None) -> RoutingDecision:
        """The decision ``place`` would take for ``key`` now, without taking it (for /admin/route)."""
        return self._decide(key, engine_model)

    def place(self, key: str, engine_model: str | None, avoid: Collection[str] = ()) -> RoutingDecision:
        """Decide where ``key``'s request goes and count it there; every placed decision must be released.
        ``avoid``: replicas this request already failed on (a retry goes elsewhere)."""
        self._ticks += 1
        decision = self._decide(key, engine_model, avoid)
        if decision.chosen is not None:
            self.replicas[decision.chosen].in_flight += 1
            self.in_flight += 1
            self.idle.clear()
            self.reservations.arrived(key, decision.home, decision.chosen)
        return decision

    def release(self, decision: RoutingDecision) -> None:
        assert decision.chosen is not None
        self.replicas[decision.chosen].in_flight -= 1
        self.in_flight -= 1
        if not self.in_flight:
            self.idle.set()
        self.reservations.finished(decision.key, decision.chosen)

    def _decide(self, key: str, engine_model: str | None, avoid: Collection[str] = ()) -> RoutingDecision:
        reservations = self.reservations
        reservations.expire()
        loads = [
            ReplicaLoad(
                replica_id,
                r.healthy and replica_id not in avoid and r.in_flight < self.max_in_flight_per_replica,
                r.in_flight,
                reservations.reserved(replica_id),
                r.health.weight(),
            )
            for replica_id, r in self.replicas.items()
        ]
        resident = self.residency.resident_on(engine_model) if engine_model and self.prefer_resident else frozenset()
        return decide(
            self.ring,
            key,
            loads,
            pool=self.name,
            policy=self.config.policy,
            balance_factor=self.balance_factor,
            capacity_floor=self.capacity_floor,
            tick=self._ticks,
            standing=reservations.standing(key),
            resident=resident,
        )

    def is_healthy(self, replica_id: str) -> bool:
        return self.replicas[replica_id].healthy

    @property
    def any_healthy(self) -> bool:
        return any(replica.healthy for replica in self.replicas.values())

    async def probe(self) -> None:
        results = await asyncio.gather(*(self.driver.healthy(r.endpoint) for r in self.replicas.values()))
        for replica, ok in zip(self.replicas.values(), results, strict=True):
            replica_id, health = replica.endpoint.id, replica.health
            if health.returning:
                continue
            change = health.probed(ok)
            if change == "down":
                log.warning("replica %s/%s is down", self.name, replica_id)
            elif change == "up":
                log.warning("replica %s/%s is up again; re-warming it before it takes traffic", self.name, replica_id)
                health.returning = True
                task = asyncio.create_task(self._welcome_back(replica), name=f"rewarm {self.name}/{replica_id}")
                self._welcomes.add(task)
                task.add_done_callback(self._welcomes.discard)

    def report(self, replica_id: str, ok: bool) -> None:
        """A request's outcome on a replica (passive outlier detection): failures in a row eject it."""
        health = self.replicas[replica_id].health
        if ok:
            health.request_succeeded()
            return
        ejected_now = sum(r.health.ejected for r in self.replicas.values())
        may_eject = ejected_now + 1 <= len(self.replicas) * self.config.outlier.max_ejected_percent // 100
        if health.request_failed(may_eject):
            until = health.ejected_until - health.clock()
            log.warning("replica %s/%s ejected for %.0f s after failing requests", self.name, replica_id, until)

    def cancel_welcomes(self) -> None:
        for task in self._welcomes:
            task.cancel()

    async def scrape_engines(self) -> None:
        loads = await asyncio.gather(*(self.driver.load_signals(r.endpoint) for r in self.replicas.values()))
        for replica, load in zip(self.replicas.values(), loads, strict=True):
            replica.engine_load = load

    async def _welcome_back(self, replica: Replica) -> None:
        """A replica back from down has lost its adapters: reset its record from the engine, warm, then serve."""
        try:
            await self.residency.reconcile([replica.endpoint.id])
            await self.warm_replica(replica.endpoint.id)
        finally:
            replica.health.back_in_service()

    async def warm_replica(self, replica_id: str) -> None:
        for adapter, pinned in self.prewarm[replica_id]:
            try:
                await self.residency.warm(replica_id, adapter, pinned=pinned)
            except (BackendError, GatewayError) as exc:  # WorkingSetFull included: log it, warm the others
                log.error("pre-warming %s on %s/%s failed: %s", adapter.engine_name, self.name, replica_id, exc)


def make_driver(config: PoolConfig, metrics: GatewayMetrics) -> EngineDriver:
    if config.backend == "triton":
        events = metrics.engine_adapter_events

        def on_event(replica_id: str, adapter: str, event: str) -> None:
            log.warning("%s/%s: engine reports %s for adapter %s", config.name, replica_id, event, adapter)
            events.labels(config.name, replica_id, event).inc()

        return TritonDriver(
            model=config.triton.model,
            lora_dtype=config.triton.lora_dtype,
            default_max_tokens=config.triton.default_max_tokens,
            chat_template=config.triton.chat_template,
            request_timeout_s=config.request_timeout_s,
            adapter_load_timeout_s=config.adapter_load_timeout_s,
            probe_timeout_s=config.health.timeout_s,
            weights_cache_bytes=config.triton.weights_cache_mib << 20,
            on_event=on_event,
        )
    return VllmDriver(
        connect_timeout_s=config.connect_timeout_s,
        request_timeout_s=config.request_timeout_s,
        adapter_load_timeout_s=config.adapter_load_timeout_s,
        max_connections_per_replica=config.max_connections_per_replica,
        probe_timeout_s=config.health.timeout_s,
    )


def endpoint(pool: PoolConfig, replica: ReplicaConfig) -> Endpoint:
    """A replica's addresses; a Triton replica's gRPC and metrics ports default to the pool's on the url's host."""
    url = str(replica.url).rstrip("/")
    if pool.backend != "triton":
        return Endpoint(replica.id, url)
    host = replica.url.host or "127.0.0.1"  # pydantic keeps an IPv6 host in its brackets
    grpc_address = replica.grpc or f"{host}:{pool.triton.grpc_port}"
    metrics_url = (
        str(replica.metrics_url) if replica.metrics_url else f"http://{host}:{pool.triton.metrics_port}/metrics"
    )
    return Endpoint(replica.id, url, grpc_address, metrics_url)


def make_store(config: GatewayConfig) -> ResidencyStore:
    state = config.state
    if state.redis_url is None:
        return MemoryStore()
    return RedisStore(state.redis_url, operation_timeout_s=state.operation_timeout_s, cluster=state.cluster)


def homed_keys(config: GatewayConfig) -> dict[str, set[str]]:
    """Per pool, the affinity keys of the requests that can reach it, derived as ingress derives them (a request
    without a session id): the tenants, or under adapter affinity the models they run on (a split's variants)."""
    directory = TenantDirectory(config)
    keys: dict[str, set[str]] = {pool.name: set() for pool in config.pools}
    for tenant_config in config.tenants:
        tenant = directory.tenant(tenant_config.id)
        assert tenant is not None  # the directory holds every tenant of the config it was built from
        for target in tenant.targets.values():
            for runs_on in [variant for _, variant in target.variants] or [target]:
                keys[runs_on.pool].add(affinity_key(config.routing, tenant, runs_on, None))
    return keys


def prewarm_homes(config: GatewayConfig, pool: Pool, model: str, split: str | None = None) -> set[str]:
    """Where the traffic that runs on ``model`` (an adapter) starts: under adapter affinity its own home (requests
    are keyed by the model they run on, a split's variant included), else the homes of the tenants that call it,
    directly or through a split (``split``: one it is about to join, as a rollout's new version)."""
    if config.routing.affinity != "adapter":
        names = {model, *([split] if split else [])}
        names.update(s.name for s in config.splits if any(v.model == model for v in s.variants))
        homes = {pool.ring.home(t.id) for t in config.tenants if names.intersection(t.adapters)}
        if homes:
            return homes
    return {pool.ring.home(model)}


class Fleet:
    def __init__(
        self,
        config: GatewayConfig,
        metrics: GatewayMetrics | None = None,
        store: ResidencyStore | None = None,
        *,
        homes_from: GatewayConfig | None = None,
    ) -> None:
        """``store``: the residency record, shared by the fleets a reload swaps (one record per replica, whichever
        fleet manages it); without one the fleet makes (and closes) its own. ``homes_from``: the config file, whose
        tenants and adapters get balanced homes (default ``config``). Not the tenants added at run time: which of
        those a gateway knows depends on when it started, and every gateway with the same file must agree."""
        self.config = config
        self.metrics = metrics or GatewayMetrics()
        self._owns_store = store is None
        self.store = store if store is not None else TimedStore(make_store(config), self.metrics)
        self.pools: dict[str, Pool] = {}
        for pool_config in config.pools:
            driver = make_driver(pool_config, self.metrics)
            endpoints = [endpoint(pool_config, r) for r in pool_config.replicas]
            residency = PoolResidency(
                pool_config.name,
                endpoints,
                driver,
                self.store,
                config.residency,
                max_adapters=pool_config.max_adapters,
                load_timeout_s=pool_config.adapter_load_timeout_s,
                shared=config.state.redis_url is not None,
                metrics=self.metrics,
            )
            self.pools[pool_config.name] = Pool(
                pool_config, config.routing, driver, residency, config.limits.max_in_flight_per_replica
            )
        if config.routing.home_placement == "balanced":
            keys = homed_keys(homes_from or config)
            for name, pool in self.pools.items():
                pool.ring.balance(keys[name])
        for adapter in config.adapters:
            if adapter.prewarm or adapter.pinned:
                pool = self.pools[adapter.pool]
                ref = AdapterRef(adapter.engine_name or adapter.name, adapter.source)
                for replica_id in sorted(prewarm_homes(config, pool, adapter.name)):
                    pool.prewarm[replica_id].append((ref, adapter.pinned))
        self.warmed = False
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Probe every replica once, then start the background loops; readiness waits for the pre-warm."""
        await asyncio.gather(*(pool.probe() for pool in self.pools.values()))
        residency = self.config.residency
        self._tasks = [asyncio.create_task(self._start_up(), name="residency start-up")]
        for pool in self.pools.values():
            life = pool.residency
            loops: list[tuple[float, Callable[[], Awaitable[None]], str]] = [
                (pool.config.health.interval_s, pool.probe, "health probe"),
                (residency.use_flush_interval_s, life.flush_uses, "use flush"),
                (residency.sync_interval_s, life.sync, "residency sync"),
                (residency.reconcile_interval_s, life.reconcile, "reconciliation"),
                (residency.evict_interval_s, partial(life.evict_idle, pool.is_healthy), "eviction"),
                (self.config.telemetry.engine_scrape_interval_s, pool.scrape_engines, "engine metrics scrape"),
            ]
            self._tasks += [
                asyncio.create_task(every(interval, work, f"{what} of pool {pool.name}"), name=f"{what} {pool.name}")
                for interval, work, what in loops
            ]

    async def started_up(self) -> None:
        """Wait until the start-up work (reconciliation, pre-warm) is done."""
        if self._tasks:
            await asyncio.shield(self._tasks[0])

    @property
    def in_flight(self) -> int:
        return sum(pool.in_flight for pool in self.pools.values())

    async def drained(self, timeout_s: float) -> bool:
        """Wait until no request is in flight, up to ``timeout_s``; whether it got there."""
        try:
            await asyncio.wait_for(asyncio.gather(*(pool.idle.wait() for pool in self.pools.values())), timeout_s)
        except TimeoutError:
            return False
        return True

    async def _start_up(self) -> None:
        """Take the engines' truth into the record, then pre-warm every healthy replica."""
        for pool in self.pools.values():
            await pool.residency.sync()
            await pool.residency.reconcile()
            healthy = [r for r, replica in pool.replicas.items() if replica.healthy]
            await asyncio.gather(*(pool.warm_replica(replica_id) for replica_id in healthy))
        self.warmed = True
        log.info("residency start-up done: record reconciled, adapters pre-warmed")

    def stop_background(self) -> None:
        """Stop probing, evicting, reconciling and re-warming: a retired fleet only finishes its requests."""
        for task in self._tasks:
            task.cancel()
        for pool in self.pools.values():
            pool.cancel_welcomes()

    async def close(self, close_store: bool = True) -> None:
        self.stop_background()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.gather(*(pool.residency.flush_uses() for pool in self.pools.values()), return_exceptions=True)
        await asyncio.gather(*(pool.driver.close() for pool in self.pools.values()))
        if close_store and self._owns_store:
            await self.store.close()

    @property
    def unready_pools(self) -> list[str]:
        return [name for name, pool in self.pools.items() if not pool.any_healthy]

    @property
    def store_up(self) -> bool:
        return all(pool.residency.store_up for pool in self.pools.values())
