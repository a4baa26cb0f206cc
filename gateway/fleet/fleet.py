"""The fleet: every pool the gateway routes to, their background loops, and where adapters are pre-warmed."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial

from backends import registry
from backends.base import AdapterRef
from gateway.config import GatewayConfig
from gateway.fleet.engines import endpoint, make_driver
from gateway.fleet.fill import fill_entries, fill_order
from gateway.fleet.host_scrape import HostScrapes
from gateway.fleet.plan_bound import PlanBound
from gateway.fleet.pool import Pool
from gateway.observe.metrics import GatewayMetrics
from gateway.observe.traffic import Traffic
from gateway.redis_client import NO_ACCESS, RedisAccess
from gateway.residency.lifecycle import PoolResidency, every
from gateway.residency.memory import MemoryStore
from gateway.residency.redis import RedisStore
from gateway.residency.signal import NO_SIGNAL, Signal
from gateway.residency.store import ResidencyStore
from gateway.residency.timed import TimedStore
from gateway.tasks import cancel_and_wait
from gateway.tenants.directory import keyed_targets

log = logging.getLogger(__name__)


def make_store(
    config: GatewayConfig, access: RedisAccess = NO_ACCESS, metrics: GatewayMetrics | None = None
) -> ResidencyStore:
    state = config.state
    if state.redis_url is None:
        return MemoryStore()
    return RedisStore(
        state.redis_url,
        operation_timeout_s=state.operation_timeout_s,
        cluster=state.cluster,
        access=access,
        metrics=metrics,
    )


def homed_keys(config: GatewayConfig) -> dict[str, set[str]]:
    """Per pool, the affinity keys of the requests that can reach it, derived as ingress derives them (a request
    without a session id): the tenants, or under adapter affinity the models they run on (a split's variants)."""
    keys: dict[str, set[str]] = {pool.name: set() for pool in config.pools}
    for runs_on, key in keyed_targets(config):
        keys[runs_on.pool].add(key)
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


@dataclass(frozen=True)
class InstalledHomes:
    """The placement table as a fleet routes by it (gateway/placement/placer.py installs it): per pool and key, the
    replica set requests go to (``routed``), that set with its members still warming (``planned``: what the fill
    plans, and so the eviction timer, count as each replica's own keys), and why."""

    version: int = 0
    routed: Mapping[str, Mapping[str, tuple[str, ...]]] = field(default_factory=dict)
    planned: Mapping[str, Mapping[str, tuple[str, ...]]] = field(default_factory=dict)
    # Per pool, the keys whose adapter has no planned slot: the fill plans nothing for them, and their requests go
    # where a load pushes out no planned adapter in use (gateway/fleet/plan_bound.py).
    unplanned: Mapping[str, frozenset[str]] = field(default_factory=dict)
    why: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # Planned from a whole window of traffic (placement's HomesTable.measured): only then are spills confined.
    measured: bool = True


def pinned_homes(config: GatewayConfig, pools: Mapping[str, Pool]) -> InstalledHomes:
    """The homes the config's pins (``placement.pins``) give before any table, with homes from traffic (none
    otherwise): each pinned key alone on its replica, in each pool that has the replica; the others' homes stay
    count-balanced. Not measured: nothing is confined by them."""
    if config.routing.home_placement != "traffic":
        return InstalledHomes()
    sets = {
        name: {key: (replica_id,) for key, replica_id in config.placement.pins.items() if replica_id in pool.replicas}
        for name, pool in pools.items()
    }
    why = {name: {key: f"pinned to {members[0]}" for key, members in keyed.items()} for name, keyed in sets.items()}
    return InstalledHomes(0, routed=sets, planned=sets, why=why, measured=False)


class Fleet:
    def __init__(
        self,
        config: GatewayConfig,
        metrics: GatewayMetrics | None = None,
        store: ResidencyStore | None = None,
        *,
        homes_from: GatewayConfig | None = None,
        scrapes: HostScrapes | None = None,
        signal: Signal = NO_SIGNAL,
    ) -> None:
        """``store``: the residency record, shared by the fleets a reload swaps (one record per replica, whichever
        fleet manages it); without one the fleet makes (and closes) its own. ``signal``: slot releases across the
        gateways sharing that store (gateway/residency/signal.py), shared the same way. ``homes_from``: the config
        file, whose tenants and adapters get balanced homes (default ``config``). Not the tenants added at run time:
        which of those a gateway knows depends on when it started, and every gateway with the same file must agree.
        ``scrapes``: under serve --workers, whether this worker scrapes the engines for the host's workers."""
        self.config = config
        self.scrapes = scrapes
        self.metrics = metrics or GatewayMetrics()
        self._owns_store = store is None
        self.store = store if store is not None else TimedStore(make_store(config, metrics=self.metrics), self.metrics)
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
                overcommit=registry.spec(pool_config.backend).queues_when_full,
                settle_loads=registry.spec(pool_config.backend).loads_between_steps,
                metrics=self.metrics,
                signal=signal,
            )
            self.pools[pool_config.name] = Pool(
                pool_config, config.routing, driver, residency, config.limits.max_in_flight_per_replica
            )
        if config.routing.home_placement != "ring":  # balanced, and traffic's homes start from balanced ones
            keys = homed_keys(homes_from or config)
            for name, pool in self.pools.items():
                pool.ring.balance(keys[name])
        for adapter in config.adapters:
            if adapter.prewarm or adapter.pinned:
                pool = self.pools[adapter.pool]
                ref = AdapterRef(adapter.engine_name or adapter.name, adapter.source)
                for replica_id in sorted(prewarm_homes(config, pool, adapter.name)):
                    pool.prewarm[replica_id].append((ref, adapter.pinned))
        # Per pool, the adapters its tenants' keys run on at their homes: what the fill plans are sorted from.
        self._fill_entries = fill_entries(config, self.pools)
        # Per pool, the placement table's replica sets, new members still warming included (placer.py installs
        # them): what the fill plans, and so the eviction timer, count as each replica's own keys.
        self.homes = InstalledHomes()
        # Before any table: the config's pins (homes from traffic only), so that the start-up fill loads a pinned
        # key's adapter at its pinned replica rather than at its balanced home, where the first table's move would
        # have to warm it again and push a planned neighbour out.
        self._pinned = pinned_homes(config, self.pools)
        self._traffic: Traffic = {}
        self.install_homes(self._pinned)
        self.warmed = False
        self._tasks: list[asyncio.Task[None]] = []

    def order_fill_by(self, traffic: Traffic) -> None:
        """(Re)plan each replica's fill, its busiest keys' adapters first by ``traffic`` (the fleet's measured
        figure; empty: the config's order): what a replica that comes back is filled with next."""
        self._traffic = traffic
        for pool in self.pools.values():
            measured = traffic.get(pool.name)
            rates = {key: rate.requests_per_s for key, rate in measured.keys.items()} if measured else {}
            planned = self.homes.planned.get(pool.name, {})
            unplanned = self.homes.unplanned.get(pool.name, frozenset())

            def homes(
                key: str, planned: Mapping[str, tuple[str, ...]] = planned, pool: Pool = pool,
                unplanned: frozenset[str] = unplanned,
            ) -> Iterable[str]:  # fmt: skip
                if key in unplanned:
                    return ()
                return planned.get(key) or pool.ring.replica_set(key)

            pool.fill = fill_order(self._fill_entries[pool.name], homes, pool.replicas, rates)
            pool.residency.plan = {r: frozenset(a.engine_name for a in refs) for r, refs in pool.fill.items()}

    def install_homes(self, table: InstalledHomes) -> None:
        """Route each pool by the placement table's routed sets and plan its fill by its planned ones (the routed
        sets with the members still warming)."""
        # Spills kept on the plan's replica sets once a table planned from a whole window of traffic is in force:
        # before it the sets are count-balanced homes no traffic chose, and a key confined to one it shares with
        # another heavy key queues there (docs/benchmarks.md, 2026-12-02 morning).
        if table.version == 0:  # no plan published yet (or none readable): route by the config's pins
            table = self._pinned
        confining = self.config.routing.home_placement == "traffic" and table.version > 0 and table.measured
        for name, pool in self.pools.items():
            pool.ring.install(table.routed.get(name, {}))
            pool.unplanned = table.unplanned.get(name, frozenset())
            pool.plan_bound = PlanBound.of(self.config.placement) if confining else None
        self.homes = table
        self.order_fill_by(self._traffic)

    async def start(self) -> None:
        """Probe every replica once, then start the background loops; readiness waits for the pre-warm."""
        await asyncio.gather(*(pool.probe() for pool in self.pools.values()))
        residency = self.config.residency
        self._tasks = [asyncio.create_task(self._start_up(), name="residency start-up")]
        for pool in self.pools.values():
            life = pool.residency
            loops: list[tuple[float, Callable[[], Awaitable[None]], str]] = [
                (pool.config.health.interval_s, partial(self._probe, pool), "health probe"),
                (residency.use_flush_interval_s, partial(self._flush_and_trim, pool), "use flush and over-bound trim"),
                (residency.sync_interval_s, life.sync, "residency sync"),
                (residency.reconcile_interval_s, life.reconcile, "reconciliation"),
                (residency.evict_interval_s, partial(life.evict_idle, pool.is_healthy), "eviction"),
                (self._scrape_interval_s(), partial(self._scrape, pool), "engine metrics scrape"),
            ]
            self._tasks += [
                asyncio.create_task(every(interval, work, f"{what} of pool {pool.name}"), name=f"{what} {pool.name}")
                for interval, work, what in loops
            ]

    @staticmethod
    async def _flush_and_trim(pool: Pool) -> None:
        """The use flush, then the over-bound trim: one timer for the two chores of the same interval (a wake-up
        every ``use_flush_interval_s`` instead of two, in every worker); a failed flush does not skip the trim."""
        life = pool.residency
        try:
            await life.flush_uses()
        except Exception:
            log.exception("use flush of pool %s failed", pool.name)
        await life.trim_over_bound(pool.is_healthy)

    async def _probe(self, pool: Pool) -> None:
        """Probe the pool's replicas, unless another worker on this host does it for this one (its rounds arrive
        through ``scrapes``) and its latest came recently; the worker that probes shares each round with the
        others."""
        scrapes = self.scrapes
        if scrapes is not None and not scrapes.leading:
            health = pool.config.health
            if not scrapes.probes_heard(pool.name, 3 * (health.interval_s + health.timeout_s)):
                await pool.probe()  # the leader's rounds stopped coming: this worker probes for itself meanwhile
                return
            # Replicas the leader's rounds do not name (its discovery or config differs from this worker's, e.g. a
            # reload with ?scope=local): probed here, else their health stayed what the start-up probe said.
            named = scrapes.probes_named(pool.name)
            unnamed = [r.endpoint.id for r in pool.replicas.values() if r.endpoint.url not in named]
            if unnamed:
                await pool.probe(unnamed)
            return
        healthy = await pool.probe()
        if scrapes is not None:
            scrapes.publish_probes(pool.name, healthy)

    async def _scrape(self, pool: Pool) -> None:
        """Scrape the pool's engines, unless another worker on this host does it for this one (then its scrapes
        arrive through ``scrapes``); the worker that scrapes shares each scrape with the others."""
        scrapes = self.scrapes
        if scrapes is not None and not scrapes.leading:
            return
        at, loads = await pool.scrape_engines()
        if scrapes is not None:
            scrapes.publish(pool.name, at, loads)

    def _scrape_interval_s(self) -> float:
        """How often the engines' own load is read: for the dashboards, or often enough to route by (the engine's
        load view, or predicted_ttft reading the adapters running on each GPU)."""
        interval = self.config.telemetry.engine_scrape_interval_s
        routing_reads_it = any(pool.policy == "predicted_ttft" for pool in self.config.pools)
        if self.config.routing.load_view == "engine" or routing_reads_it:
            interval = min(interval, self.config.routing.load_scrape_interval_s)
        return interval

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
            await asyncio.wait_for(asyncio.gather(*(pool.wait_idle() for pool in self.pools.values())), timeout_s)
        except TimeoutError:
            return False
        return True

    async def _start_up(self) -> None:
        """Take the engines' truth into the record, pre-warm every healthy replica, then fill their free slots:
        readiness waits for the fill up to ``residency.fill_wait_s``, and the rest goes on in the background."""
        for pool in self.pools.values():
            await pool.residency.sync()
            await pool.residency.break_dead_locks()
            await pool.residency.reconcile()
            healthy = [r for r, replica in pool.replicas.items() if replica.healthy]
            await asyncio.gather(*(pool.warm_replica(replica_id) for replica_id in healthy))
        fill = asyncio.create_task(self._fill(), name="fill free slots")
        self._tasks.append(fill)
        done, _ = await asyncio.wait({fill}, timeout=self.config.residency.fill_wait_s)
        self.warmed = True
        if done:
            log.info("residency start-up done: record reconciled, adapters pre-warmed, free slots filled")
        else:
            log.warning("residency start-up done; filling free slots goes on in the background")

    async def _fill(self) -> None:
        """Fill every healthy replica's free slots with its planned adapters, the replicas at once."""
        await asyncio.gather(
            *(
                pool.fill_replica(replica_id)
                for pool in self.pools.values()
                for replica_id, replica in pool.replicas.items()
                if replica.healthy and pool.fill[replica_id]
            )
        )

    def stop_background(self) -> None:
        """Stop probing, evicting, reconciling and re-warming: a retired fleet only finishes its requests."""
        for task in self._tasks:
            task.cancel()
        for pool in self.pools.values():
            pool.cancel_welcomes()

    async def close(self, close_store: bool = True) -> None:
        self.stop_background()
        await cancel_and_wait(self._tasks)
        await asyncio.gather(*(pool.residency.flush_uses() for pool in self.pools.values()), return_exceptions=True)
        for pool in self.pools.values():
            pool.residency.detach()  # its requests are over: it holds nothing another gateway should hear of
        await asyncio.gather(*(pool.driver.close() for pool in self.pools.values()))
        if close_store and self._owns_store:
            await self.store.close()

    @property
    def unready_pools(self) -> list[str]:
        return [name for name, pool in self.pools.items() if not pool.any_healthy]

    @property
    def store_up(self) -> bool:
        return all(pool.residency.store_up for pool in self.pools.values())
