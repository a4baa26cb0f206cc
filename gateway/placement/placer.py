"""Homes from traffic, run: every ``placement.interval_s`` each gateway polls the homes table (one Redis call, which
also takes or renews the leader's lease); the leader plans each pool from the fleet's traffic (plan.py), publishes
the next version, and warms the adapters of the keys that move; every gateway routes by the version it has.

Make before break: a key whose set gains a replica (a move, or a hot key's second home) is published with its new
set in ``homes`` and its old one in ``warming``. Every gateway routes it by the old set and plans the new members'
fill with its adapters (so the eviction timer keeps them); the leader loads and warms them there (the residency
lifecycle's ``warm``: a load and a one-token request), and publishes the switch only once every adapter of the key
is resident at every new member by the record (as soon as a warm-up ends, not an interval later), or at once when
no replica of the old set is up or holds its adapter any more (a swap's partner pushed out by the warm-up that
takes its place). A move not warm
after ``warm_timeout_s`` is given up (the key keeps its old set).

When the leader dies the table stays as it is (the other gateways keep routing by the last version) until another
gateway takes the lease (it lapses after 3 intervals). When Redis does not answer, every gateway keeps the last
table it installed. Without Redis each gateway plans from its own traffic (gateways may then differ).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace

from backends.base import AdapterRef
from backends.errors import BackendError
from gateway.config import GatewayConfig, PlacementConfig
from gateway.errors import GatewayError
from gateway.fleet.fill import FillEntry, keyed_adapters
from gateway.fleet.fleet import Fleet, InstalledHomes, homed_keys
from gateway.fleet.pool import Pool
from gateway.observe.traffic import Rate, Traffic
from gateway.placement.plan import Homes, PlanInput, PlanSettings, plan
from gateway.placement.store import HomesStore, Operator
from gateway.placement.table import EMPTY, HomesTable, PoolTable
from gateway.residency.store import StoreUnavailable
from gateway.tasks import cancel_and_wait

log = logging.getLogger(__name__)


def plan_settings(config: GatewayConfig) -> PlanSettings:
    placement = config.placement
    return PlanSettings(
        max_moves=placement.max_moves, min_gain=placement.min_gain, grow_above=placement.grow_above,
        shrink_below=placement.shrink_below, shrink_after_s=placement.shrink_after_s,
        replicate_min_rps=placement.replicate_min_rps, max_replicas_per_key=placement.max_replicas_per_key,
        window_s=config.traffic.window_s, sigmas=placement.sigmas, spill_share=placement.spill_share,
        seat_share=placement.seat_share, unplan_below_rps=1 / placement.off_plan_idle_s if placement.off_plan_idle_s
        else math.inf, repay_after_s=placement.repay_after_s,
    )  # fmt: skip


class Placer:
    def __init__(self, store: HomesStore, gateway_id: str, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.gateway_id = gateway_id
        self._clock = clock  # wall clock: the table's timers pass from one leader to the next
        self.table: HomesTable = EMPTY
        self.leads = False
        self.store_up = True
        self.moves = 0  # keys whose set changed, over every version this gateway published
        self.given_up = 0  # moves given up (not warm in time)
        self.bytes_read = 0  # at the last poll, and at the last publish
        self.bytes_written = 0
        self.operator = Operator()  # the run-time freeze and pins, as the leader read them last
        self._installed: tuple[Fleet | None, int] = (None, -1)  # the fleet and version installed last
        self._warming: dict[tuple[str, str, str], asyncio.Task[None]] = {}
        # One tick at a time: the interval's, or the switch a finished warm-up brings forward.
        self._lock = asyncio.Lock()
        self._last: tuple[GatewayConfig, Fleet, Traffic, bool] | None = None
        self._switch: asyncio.Task[None] | None = None

    async def tick(self, config: GatewayConfig, fleet: Fleet, traffic: Traffic, *, measured: bool = True) -> None:
        """One interval: poll, plan and publish when leading, warm what moves, install the table into ``fleet``.
        ``measured``: this gateway's traffic covers a whole ``traffic.window_s``. Until then a leader plans from no
        traffic (the pins and evacuations only; a leader that took over a measured table keeps it) and its table
        says so (``HomesTable.measured``), so that routing confines no spill to sets no traffic chose: the
        count-balanced homes, where collide's two heavy tenants queued 39 deep on the replica they shared until a
        plan from the first seconds of a moving average split them (docs/benchmarks.md, 2026-12-02 morning)."""
        async with self._lock:
            self._last = (config, fleet, traffic, measured)
            await self._tick(config, fleet, traffic, plan_moves=True, measured=measured)

    async def first_look(self, fleet: Fleet) -> None:
        """Read the stored table once and route ``fleet`` by it, before this gateway serves; lead (plan, publish)
        only from the first interval on, as before. A gateway (re)started beside a leader routed by count-balanced
        homes until its first interval had passed (10 s by default) while the others routed by the table: its
        requests for moved keys went where their adapters were not planned, cold loads pushing out planned ones
        (tests/gateway/test_gateway_restart.py)."""
        async with self._lock:
            try:
                polled = await self.store.poll(self.gateway_id, self.table.version)
            except StoreUnavailable as exc:
                log.warning("placement table unreachable at start, routing by version %d: %s", self.table.version, exc)
                self.store_up = False
                return
            self.bytes_read, self.operator = polled.bytes_read, polled.operator
            if polled.table is not None:
                self.table = polled.table
            self.install(fleet)

    async def _switch_warm(self) -> None:
        """A warm-up finished: publish the moves that are warm now rather than an interval later (no new moves:
        those stay once per interval)."""
        async with self._lock:
            if self._last is not None and self.leads:
                config, fleet, traffic, measured = self._last
                await self._tick(config, fleet, traffic, plan_moves=False, measured=measured)

    async def _tick(
        self, config: GatewayConfig, fleet: Fleet, traffic: Traffic, *, plan_moves: bool, measured: bool
    ) -> None:
        try:
            polled = await self.store.poll(self.gateway_id, self.table.version)
        except StoreUnavailable as exc:
            if self.store_up:
                log.warning("placement table unreachable, routing by version %d: %s", self.table.version, exc)
            self.store_up, self.leads = False, False
            self.install(fleet)
            return
        if not self.store_up:
            log.warning("placement table reachable again")
        self.store_up = True
        self.bytes_read = polled.bytes_read
        self.leads = polled.leads
        self.operator = polled.operator
        if polled.table is not None:
            self.table = polled.table
        if self.leads:
            # A stored version above ours that did not come back as a table did not decode: publish over it even
            # with nothing changed, or no gateway could read the table again.
            unreadable = polled.version > self.table.version
            version = max(polled.version, self.table.version) + 1
            # Before a whole window of traffic: no traffic to plan by, and a measured table (a leader before this
            # one planned it) kept as it is; once a table is measured it stays so.
            kept = self.table.measured and self.table.version > 0
            plan_moves = plan_moves and (measured or not kept)
            traffic = traffic if measured else {}
            await self._lead(
                config, fleet, traffic, version, plan_moves, republish=unreadable, measured=measured or kept
            )
        self.install(fleet)

    def install(self, fleet: Fleet) -> None:
        """Route ``fleet`` by the table (once per version and fleet: a reload's new fleet gets it at the next tick)."""
        if self._installed[0] is fleet and self._installed[1] == self.table.version:
            return
        pools = self.table.pools
        fleet.install_homes(
            InstalledHomes(
                self.table.version,
                measured=self.table.measured,
                routed={name: pool.routed() for name, pool in pools.items()},
                planned={
                    name: {key: _union(members, pool.warming.get(key, ())) for key, members in pool.homes.items()}
                    for name, pool in pools.items()
                },
                unplanned={name: pool.unplanned for name, pool in pools.items()},
                why={name: dict(pool.why) for name, pool in pools.items()},
            )
        )
        self._installed = (fleet, self.table.version)

    async def _lead(
        self,
        config: GatewayConfig,
        fleet: Fleet,
        traffic: Traffic,
        version: int,
        plan_moves: bool,
        *,
        republish: bool,
        measured: bool,
    ) -> None:
        settings, planning = config.placement, plan_settings(config)
        now = self._clock()
        known = homed_keys(config)
        pools: dict[str, PoolTable] = {}
        moves = 0
        entries = keyed_adapters(config, fleet.pools)
        for name, pool in fleet.pools.items():
            adapters = _adapters_by_key(entries[name])
            pool_traffic = traffic.get(name)
            rates = pool_traffic.keys if pool_traffic else {}
            before = self.table.pools.get(name, PoolTable())
            planned, changed = await self._plan_pool(
                settings, planning, pool, before, adapters, rates, known.get(name, set()), now, plan_moves
            )
            pools[name] = planned
            moves += changed
            self._warm(pool, planned, adapters)
        if pools == dict(self.table.pools) and measured == self.table.measured and not republish:
            return
        table = HomesTable(version, self.gateway_id, pools, moves, measured)
        try:
            written = await self.store.publish(self.gateway_id, table)
        except StoreUnavailable as exc:
            log.warning("placement table not published: %s", exc)
            return
        if written:
            self.table, self.bytes_written = table, written
            self.moves += moves
            if moves:
                log.info("placement version %d: %d key(s) moved", version, moves)

    async def _plan_pool(
        self,
        settings: PlacementConfig,
        planning: PlanSettings,
        pool: Pool,
        before: PoolTable,
        adapters: Mapping[str, list[AdapterRef]],
        rates: Mapping[str, Rate],
        known: set[str],
        now: float,
        plan_moves: bool,
    ) -> tuple[PoolTable, int]:
        """The pool's next table, and how many keys changed set in it."""
        homes = dict(before.homes)
        warming, warming_since = dict(before.warming), dict(before.warming_since)
        why = dict(before.why)
        settled: set[str] = set()  # keys whose move ends this interval: not moved again in it
        for key, old in before.warming.items():  # switch the moves that are warm, give up the ones that stall
            new = [r for r in homes.get(key, ()) if r not in old]
            settled.add(key)
            gone = [r for r in new if r not in pool.replicas]  # a rebuild's fleet (discovery) no longer has it
            stalled = now - before.warming_since.get(key, now) > settings.warm_timeout_s
            if gone or stalled:
                why[key] = f"move to {', '.join(new)} given up: " + ("left the pool" if gone else "not warm in time")
                log.warning("placement: %s/%s: %s; it stays put", pool.name, key, why[key])
                homes[key] = old
                del warming[key], warming_since[key]
                self.given_up += 1
                continue
            up = any(r in pool.replicas and pool.is_healthy(r) for r in old)
            residency, refs = pool.residency, adapters.get(key, ())
            warm = all(residency.is_resident(r, a.engine_name) for r in new for a in refs)
            # Pushed out of every old member (a swap: the partner's warm-up there took its slot): routed there, each
            # request reloaded it and pushed out a neighbour, who reloaded in turn (collide: 12 cold loads at the
            # heavy key's new home while the partner's own warm-up waited; docs/benchmarks.md). No break is left to
            # avoid: its requests go to the new set, where its warm-up is under way.
            # Only the old members still in the pool are read (a rebuild's fleet may have dropped one: KeyError).
            held = [r for r in old if r in pool.replicas]
            gone_old = bool(refs) and not any(residency.is_resident(r, a.engine_name) for r in held for a in refs)
            if warm or not up or gone_old:
                del warming[key], warming_since[key]
        if not plan_moves:
            return replace(before, homes=homes, warming=warming, warming_since=warming_since, why=why), 0
        replicas = [r for r, replica in pool.replicas.items() if not replica.health.drained]
        pins = {key: r for key, r in self.pins(settings, pool.name).items() if r in pool.replicas}
        fixed = set(warming) | settled
        if self.frozen(settings):  # the table stays as it is but for the pins (operators stay in charge)
            fixed |= {*homes, *rates, *known} - set(pins)
        # In a thread: thousands of keys take tens of milliseconds (loadtests/bench_placement.py), which the event
        # loop must not wait out. The input is a snapshot; the ring's balanced homes change only with a new fleet.
        result = await asyncio.to_thread(
            plan,
            PlanInput(
                replicas,
                {key: rate.requests_per_s for key, rate in rates.items()},
                homes,
                pool.ring.balanced_home,
                known=known,
                pinned=pins,
                spills={key: rate.spills_per_s for key, rate in rates.items() if rate.spills_per_s},
                frozen_keys=fixed,
                below_since=before.below_since,
                now=now,
                slots=pool.residency.max_adapters,
                in_flight={key: rate.in_flight for key, rate in rates.items() if rate.in_flight},
                seats=pool.seats,
                unplanned=before.unplanned,
                cooled_at=before.cooled_at,
            ),
            planning,
        )
        for change in result.changes:
            why[change.key] = change.why
            log.info("placement: %s/%s %s -> %s: %s", pool.name, change.key, change.before, change.after, change.why)
            gained = [r for r in change.after if r not in change.before]
            old_up = any(r in pool.replicas and pool.is_healthy(r) for r in change.before)
            if gained and old_up and adapters.get(change.key):
                warming[change.key], warming_since[change.key] = change.before, now
        why.update((key, f"pinned to {replica_id}") for key, replica_id in pins.items() if replica_id in replicas)
        # A key back on its ring home leaves the table; its why stays for the interval that put it back (a pinned
        # key's for as long as the pin).
        why = {
            key: text
            for key, text in why.items()
            if key in result.homes or key in settled or key in pins or key in result.unplanned
        }
        unplanned = frozenset(result.unplanned)
        table = PoolTable(result.homes, warming, warming_since, why, result.below_since, unplanned, result.cooled_at)
        return table, len(result.changes)

    async def read_operator(self) -> bool:
        """Take the freeze and pins as stored now, so that an operator sees a change at once rather than at the
        next interval (the admin API's read; the plan takes them with its poll anyway). False, and kept as they
        were, while the store does not answer."""
        try:
            self.operator = await self.store.operator()
        except StoreUnavailable:
            return False
        return True

    def frozen(self, settings: PlacementConfig) -> bool:
        return settings.freeze or self.operator.frozen

    def pins(self, settings: PlacementConfig, pool: str) -> dict[str, str]:
        """The config's pins, then the operator's for ``pool`` (which win)."""
        return {**settings.pins, **self.operator.pins.get(pool, {})}

    def _warm(self, pool: Pool, table: PoolTable, adapters: Mapping[str, list[AdapterRef]]) -> None:
        """Load and warm each warming key's adapters at its new members (in the background, once at a time)."""
        for key, old in table.warming.items():
            for replica_id in table.homes.get(key, ()):
                if replica_id in old or replica_id not in pool.replicas or not pool.is_healthy(replica_id):
                    continue
                for adapter in adapters.get(key, ()):
                    slot = (pool.name, replica_id, adapter.engine_name)
                    if slot in self._warming or pool.residency.is_resident(replica_id, adapter.engine_name):
                        continue
                    task = asyncio.create_task(self._warm_one(pool, replica_id, adapter), name=f"warm {slot}")
                    self._warming[slot] = task
                    task.add_done_callback(lambda _, slot=slot: self._warming.pop(slot, None))  # type: ignore[misc]

    async def _warm_one(self, pool: Pool, replica_id: str, adapter: AdapterRef) -> None:
        try:
            await pool.residency.warm(replica_id, adapter, pinned=False)
        except (BackendError, GatewayError) as exc:  # tried again next interval, given up after warm_timeout_s
            log.warning("placement: warming %s on %s/%s failed: %s", adapter.engine_name, pool.name, replica_id, exc)
            return
        if self._switch is None or self._switch.done():
            self._switch = asyncio.create_task(self._switch_warm(), name="placement switch")

    async def close(self) -> None:
        tasks = [*self._warming.values(), *([self._switch] if self._switch is not None else [])]
        await cancel_and_wait(tasks)
        await self.store.close()


def _adapters_by_key(entries: Iterable[FillEntry]) -> dict[str, list[AdapterRef]]:
    """Each key's adapters in a pool (config and run-time tenants alike), each once."""
    found: dict[str, list[AdapterRef]] = {}
    for entry in entries:
        refs = found.setdefault(entry.key, [])
        if entry.adapter not in refs:
            refs.append(entry.adapter)
    return found


def _union(first: Homes, second: Homes) -> Homes:
    return first + tuple(r for r in second if r not in first)
