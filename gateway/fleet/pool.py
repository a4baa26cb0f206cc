"""One pool of replicas: its ring, the requests in flight on each replica, their health, and its driver."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Collection, Mapping
from functools import partial
from operator import itemgetter

from backends.base import AdapterRef, Endpoint, EngineDriver, EngineLoad
from backends.errors import BackendError
from gateway.config import PoolConfig, RoutingConfig
from gateway.errors import GatewayError
from gateway.fleet import rings
from gateway.fleet.health import ReplicaHealth
from gateway.fleet.keys import Entry, KeyEntry, new_entry
from gateway.fleet.one_pass import decide_plain
from gateway.fleet.outlier import Failure
from gateway.fleet.plan_bound import Confined, PlanBound, split
from gateway.fleet.replica import Replica
from gateway.fleet.retry_budget import RetryBudget
from gateway.residency.lifecycle import PoolResidency, WarmUpTimedOut
from gateway.residency.signal import NO_SIGNAL
from gateway.routing.costs import Line, Regime, TtftModel, gpu_slot_waits, loads_ahead_ms
from gateway.routing.decision import ReplicaLoad, RoutingDecision
from gateway.routing.pipeline import Router
from gateway.routing.reservations import HomeReservations
from gateway.routing.ring import Ring
from gateway.routing.scorers import ScorerSettings, Scoring, build_scoring

log = logging.getLogger(__name__)

# The most seats an engine's report may raise pools[].seats to: the config's own bound.
_MOST_SEATS = 1_000_000
# A learned seats figure (above pools[].seats) follows the engines down, with hysteresis: once a whole window of
# SEATS_FOLLOW_S has passed in which no replica reported running more than SEATS_LOWER_BELOW of it, it is lowered to
# the most any replica ran in that window (never below the stated figure). A busy minute does not lower it, nor a
# dip of a few requests; an engine restarted with a smaller --max-num-seqs, or the replica that ran the most gone,
# does within a window or two.
SEATS_FOLLOW_S = 300.0
SEATS_LOWER_BELOW = 0.75

# Policies that spread requests over the whole pool by design: they weigh every replica.
_SPREADING = frozenset({"round_robin", "least_loaded"})
# Policies that keep a slot at an active key's home (routing/reservations.py).
_RESERVING = frozenset({"bounded_consistent_hash", "predicted_ttft"})
# Keys the pool keeps an entry for (their candidates; under predicted_ttft their recent replicas too), the least
# recently routed going first: session keys are unbounded in number.
_RECENT_KEYS = 65_536
# The resident set of a request without an adapter (or a policy that does not read residency): one object, so a
# key's kept candidates (_candidates) are seen to hold.
_NOWHERE: frozenset[str] = frozenset()
_make = object.__new__  # a KeyEntry with no fields set (gateway/fleet/keys.py)
# Resident sets whose sorted order is kept (one per adapter with a distinct set; cleared when full).
_RESIDENT_ORDERS = 4_096
# After a warm-up ahead of an adapter on a replica fails, none is tried there again for this long: a confined key is
# refused its cold replica at each request (_decide_confined), and without it each refused request started one more
# load of an adapter that replica would not load (an engine call and a warning per request, nothing backing off).
WARM_AHEAD_RETRY_S = 10.0


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
        # Read per decision: plain attributes, not the config's (a pydantic model's, each read through its hook).
        self.policy: str = config.policy
        self.driver = driver
        self.residency = residency
        self.balance_factor = routing.balance_factor
        self.capacity_floor = routing.capacity_floor
        self.max_in_flight_per_replica = max_in_flight_per_replica
        self.prefer_resident = routing.prefer_resident
        self.candidate_count = routing.candidates
        self._spreading = config.policy in _SPREADING
        # The engine's view of load, when routing.load_view is "engine": how stale a scrape may be before the
        # gateway routes on its own count again.
        self.engine_view_max_age_s = 3 * routing.load_scrape_interval_s if routing.load_view == "engine" else None
        # "shared": this gateway's requests in flight plus the other gateways' as they share them every 50 ms
        # (gateway/residency/signal.py). Without Redis there is no other gateway to hear: its own count, no lookup.
        self.shared_load_view = routing.load_view == "shared" and residency.signal is not NO_SIGNAL
        self.scrape_interval_s = routing.load_scrape_interval_s
        # A scrape this recent still says which adapters are running on the GPU.
        self.scrape_fresh_s = 3 * routing.load_scrape_interval_s
        self.replicas = {
            replica_id: Replica(endpoint, ReplicaHealth(config.health, config.outlier, config.slow_start_s))
            for replica_id, endpoint in residency.endpoints.items()
        }
        # What the one pass reads of each replica (one_pass.Entry).
        self.records: dict[str, Entry] = {
            replica_id: (replica_id, replica, replica.health, residency.views[replica_id])
            for replica_id, replica in self.replicas.items()
        }
        # Each replica as a set of one: a key's replica set where it is its home alone (_candidates).
        self._alone = {replica_id: frozenset((replica_id,)) for replica_id in self.replicas}
        self.retry_budget = RetryBudget(config.retry.budget_ratio, config.retry.min_per_s)
        # Placed in advance where a rebuild prepared it on a worker thread (gateway/fleet/rings.py).
        self.ring = Ring(list(self.replicas), routing.vnodes, rings.geometry(list(self.replicas), routing.vnodes))
        reserve = config.policy in _RESERVING
        self.reservations = HomeReservations(routing.home_reservation_s if reserve else 0.0)
        # Per replica, what to load and warm when it comes (back) up: (adapter, pinned).
        self.prewarm: dict[str, list[tuple[AdapterRef, bool]]] = {replica_id: [] for replica_id in self.replicas}
        # Per replica, what fills its free slots after that, most important first (gateway/fleet/fill.py).
        self.fill: dict[str, list[AdapterRef]] = {replica_id: [] for replica_id in self.replicas}
        self._ticks = 0
        # predicted_ttft: the pool's learned TTFT lines and scorers.
        self.scoring: Scoring | None = None
        if config.policy == "predicted_ttft":
            priors = routing.ttft_priors
            lines: dict[Regime, Line] = {
                "warm": Line(priors.warm_ms, priors.per_request_ms),
                "kv_cold": Line(priors.kv_cold_ms, priors.per_request_ms),
                "host": Line(priors.host_ms, priors.per_request_ms),
                "cold": Line(priors.cold_ms, priors.per_request_ms),
            }
            model = TtftModel(lines, routing.ttft_learning_rate, priors.gpu_slot_ms)
            # The expected time of one adapter load before any is measured: what a cold load costs beyond a
            # request whose adapter is on the GPU (the load_ahead scorer's unit).
            residency.load_ms = max(priors.cold_ms - priors.kv_cold_ms, 0.0)
            settings = ScorerSettings(
                routing.affinity_margin_ms, routing.eviction_cost, routing.cold_margin_ms, routing.hold_copies
            )
            self.scoring = build_scoring(routing.scorers, settings, model)
        # The eviction scorer's evidence: each adapter's requests as a moving average over reuse_window_s (count,
        # when last counted), and how far ahead a victim's loss is counted.
        self._evicting = self.scoring is not None and bool(routing.scorers.get("eviction"))
        # The gpu_slot scorer's evidence (costs.gpu_slot_waits) is looked up only with it on; an engine scrape
        # lists its running adapters for it only while no older than one scrape interval (an adapter listed
        # earlier may have finished since, and a false wait moves a request off a replica with a slot free).
        self.gpu_slot_on = self.scoring is not None and bool(routing.scorers.get("gpu_slot"))
        self.running_fresh_s = routing.load_scrape_interval_s
        self._uses: dict[str, tuple[float, float]] = {}
        self.reuse_window_s = routing.reuse_window_s
        self.eviction_horizon_s = routing.eviction_horizon_s
        self.prefix_warm_s = routing.prefix_warm_s
        self.router = Router(self.name, config.policy, self.balance_factor, self.capacity_floor, self.scoring)
        # Per key placed, its entry (gateway/fleet/keys.py): its candidates as last built (_candidates) and, under
        # predicted_ttft, the replicas that served it last (what "its prefix is warm there" reads), least recently
        # routed key first (a policy that does not predict keeps them in the order first placed), at most
        # _RECENT_KEYS. An OrderedDict, not a dict: a dict whose oldest key is dropped at each new one
        # (del d[next(iter(d))]) is read from its front past every slot deleted since it last compacted, 4.6 us per
        # new key once full.
        self.keys: OrderedDict[str, KeyEntry] = OrderedDict()
        # The entry the last _decide read or built, and the one it built for a key without one (None where it found
        # it): place keeps and updates it without a second lookup.
        self._entry: KeyEntry | None = None
        self._fresh: KeyEntry | None = None
        self._resident_order: dict[frozenset[str], tuple[str, ...]] = {}
        # The plain case is decided in one pass over the records (one_pass.py); False: the general pipeline only
        # (tests compare the two).
        self.one_pass = config.policy in _RESERVING
        self._welcomes: set[asyncio.Task[None]] = set()
        # The adapter being warmed ahead of a key's spills (warm_ahead), by (replica, adapter), and how many were.
        self._warming_ahead: dict[tuple[str, str], asyncio.Task[None]] = {}
        # When a warm-up ahead last failed, by (replica, adapter): not tried there again for WARM_AHEAD_RETRY_S.
        self._warm_failed: dict[tuple[str, str], float] = {}
        # Per replica, its engine scrape under way: a round starts no second one there, and does not wait for it.
        self._scraping: dict[str, asyncio.Task[EngineLoad | None]] = {}
        # The readings taken since the last round returned, a slow replica's among them: the next round returns
        # them (serve --workers shares what a round returns with the other workers).
        self._taken: dict[str, EngineLoad | None] = {}
        self.spill_warm_replicas = routing.spill_warm_replicas
        self.spill_warm_idle_s = routing.spill_warm_idle_s
        self.warm_aheads = 0
        self._unscraped: set[str] = set()  # replicas whose last scrape raised in the driver (logged once)
        self.in_flight = 0
        # Spills kept on each key's planned replicas (routing.home_placement: traffic; plan_bound.py); None: off.
        self.plan_bound: PlanBound | None = None
        # Keys the placement table left without a planned slot (placement's Plan.unplanned; plan_bound.py).
        self.unplanned: frozenset[str] = frozenset()
        # The requests one replica runs at once: pools[].seats, raised to what an engine reports running at once
        # where that is more (``took_scrape``): the config's figure proven wrong, placement and the spill bound read
        # this one.
        self.seats = config.seats
        # The current window of the learned figure's way down (``_follow_seats``): when it began (None: no reading
        # yet) and the most any replica ran in it (-1: no reading in it).
        self._seats_window_at: float | None = None
        self._seats_window_most = -1
        self._seats_said = False  # the stated figure's being proven low is logged once per pool
        # Set once no request is in flight, made only while someone waits for that (wait_idle): a retired pool
        # waits before it closes. Not an Event kept set and cleared: that cost two calls per request.
        self._idle: asyncio.Event | None = None

    def routed_load(self, replica_id: str, now: float) -> int:
        """The load routing counts on the replica now (``routing.load_view``), for the status page and metrics."""
        replica = self.replicas[replica_id]
        if self.shared_load_view:
            return replica.in_flight + self.residency.signal.load_elsewhere(self.name).get(replica_id, 0)
        return replica.load_view(now, self.engine_view_max_age_s)

    def explain(self, key: str, engine_model: str | None) -> RoutingDecision:
        """The decision ``place`` would take for ``key`` now, without taking it, with every scorer's term per
        candidate (for /admin/route and the status page)."""
        return self._decide(key, engine_model, explain=True)

    def lease(self, key: str, adapter: AdapterRef | None, avoid: Collection[str] = ()) -> Lease:
        """Place ``key``'s request now and hold its place until the lease's ``with`` block ends: see ``Lease``.
        ``avoid``: replicas this request already failed on (a retry goes elsewhere)."""
        decision = self.place(key, adapter.engine_name if adapter is not None else None, avoid)
        if decision.chosen is not None and not avoid:  # a request placed: what the retry budget's share counts
            self.retry_budget.request()
        lease = Lease(self, decision, adapter)
        if decision.warm_ahead is not None and adapter is not None:
            self.warm_ahead(decision.warm_ahead, adapter, due=decision.warm_ahead_due)
        return lease

    def warm_ahead(self, replica_id: str, adapter: AdapterRef, *, due: bool = False) -> None:
        """predicted_ttft found ``replica_id``, where the adapter is cold, within the cold margin of a hot key's warm
        replicas (pickers.warm_or_cold), or a request confined to its key's planned replicas would have left them for
        it (``_decide_confined``): load and warm the adapter there in the background (a load and a one-token
        request), so the key's next requests spill there warm rather than one of them paying the load (issue 19: a
        hot adapter is warmed on a replica before requests spill there). One warm-up ahead at a time in the pool
        (each is a cold load that stalls its replica and may evict an adapter; on the collide trace two heavy keys
        warmed at once both spread where one moving was enough), none once the adapter is resident on
        ``routing.spill_warm_replicas`` replicas, and none that would push out an adapter a request used within
        ``routing.spill_warm_idle_s`` (a free slot, or an idle adapter's: ``PoolResidency.room_to_spare``) until
        it is ``due``: the cold replica predicted faster outright, where the key would take it without the margin
        and its load push out the same adapter. Where the adapters fill every slot exactly, a copy pushing out a
        tenant still in use costs that tenant a cold load, and its load pushes out another (collide: warm-ups
        ahead of spills that never came raised its cold loads by half, in some runs).
        The copies go as any adapter does, by the engine's LRU and the eviction timer, once the key's demand falls.
        One that failed is not tried on that replica again for ``WARM_AHEAD_RETRY_S`` (one that timed out, on no
        replica); one whose load is under way
        there already is not started (it would only wait for that load): a warm-up given up after
        ``residency.warm_up_timeout_s`` leaves its hung load running, and a warm-up asking again joined it and held
        the pool's one warm-up ahead again for every other tenant's."""
        name = adapter.engine_name
        slot = (replica_id, name)
        if self._warming_ahead or self.residency.is_resident(replica_id, name):
            return
        if self.residency.load_under_way(replica_id, name):
            return
        failed_at = max(self._warm_failed.get(slot, -math.inf), self._warm_failed.get(("", name), -math.inf))
        if time.monotonic() - failed_at < WARM_AHEAD_RETRY_S:
            return
        if len(self.residency.resident_on(name)) >= self.spill_warm_replicas:
            return
        if not due and not self.residency.room_to_spare(replica_id, self.spill_warm_idle_s):
            return  # it would push out an adapter still in use, for a spill that may never come
        task = asyncio.create_task(self._warm_ahead(replica_id, adapter), name=f"warm ahead {self.name}/{slot}")
        self._warming_ahead[slot] = task
        task.add_done_callback(lambda _: self._warming_ahead.pop(slot, None))

    async def _warm_ahead(self, replica_id: str, adapter: AdapterRef) -> None:
        try:
            await self.residency.warm(replica_id, adapter, pinned=False)
        except (BackendError, GatewayError) as exc:  # a later decision may ask again, WARM_AHEAD_RETRY_S on
            log.warning("warming %s ahead on %s/%s failed: %s", adapter.engine_name, self.name, replica_id, exc)
            now = time.monotonic()
            # Failures are one at a time (one warm-up ahead in the pool): the past ones are dropped here, so the
            # table holds only those within the retry window.
            failed = {slot: at for slot, at in self._warm_failed.items() if now - at < WARM_AHEAD_RETRY_S}
            # One that timed out is not tried on any replica within the window: an adapter whose loads hang everywhere
            # took the pool's one warm-up ahead replica after replica, warm_up_timeout_s each.
            hung = isinstance(exc, WarmUpTimedOut)
            failed[("" if hung else replica_id, adapter.engine_name)] = now
            self._warm_failed = failed
            return
        self.warm_aheads += 1
        self.residency.metrics.warm_aheads.labels(self.name).inc()

    def place(self, key: str, engine_model: str | None, avoid: Collection[str] = ()) -> RoutingDecision:
        """Decide where ``key``'s request goes and count it there; every placed decision must be released.
        ``avoid``: replicas this request already failed on (a retry goes elsewhere)."""
        self._ticks += 1
        decision = self._decide(key, engine_model, avoid)
        chosen = decision.chosen
        if chosen is not None:
            self.replicas[chosen].in_flight += 1
            self.in_flight += 1
            # The key's entry keeps its reservation state where it has none (a first sight: one object, not two).
            self.reservations.arrived(key, decision.home, chosen, self._entry)
            fresh = self._fresh
            if fresh is not None:  # the key's first placement (or its first since it was forgotten): keep its entry
                self._fresh = None
                keys = self.keys
                if len(keys) >= _RECENT_KEYS:
                    keys.popitem(last=False)
                keys[key] = fresh
                if self.scoring is not None:
                    fresh.served_by, fresh.served_at = chosen, time.monotonic()  # KeyEntry.served, inline
            if self.scoring is not None:
                if fresh is None:
                    self.keys.move_to_end(key)  # in the keys' recency: the least recently routed go first
                    entry = self._entry
                    assert entry is not None
                    if entry.served_by == chosen:  # served by the same replica again: KeyEntry.served, inline
                        entry.served_at = time.monotonic()
                    else:
                        entry.served(chosen, time.monotonic())
                if self._evicting and engine_model is not None:
                    self._used(engine_model)
        return decision

    def _used(self, engine_model: str) -> None:
        now = time.monotonic()
        count, at = self._uses.get(engine_model, (0.0, now))
        self._uses[engine_model] = (count * math.exp((at - now) / self.reuse_window_s) + 1.0, now)

    def _evict_loss(self, replica_id: str, now: float) -> float:
        """The chance that the adapter a cold load on the replica would push out is wanted there again within
        ``eviction_horizon_s``: its request rate, shared by the replicas that hold it, as a Poisson process."""
        victim = self.residency.next_victim(replica_id)
        if victim is None:
            return 0.0
        count, at = self._uses.get(victim, (0.0, now))
        holders = len(self.residency.resident_on(victim)) or 1
        rate = count * math.exp((at - now) / self.reuse_window_s) / self.reuse_window_s / holders
        return 1.0 - math.exp(-rate * self.eviction_horizon_s)

    async def wait_idle(self) -> None:
        """Return once no request is in flight in the pool."""
        while self.in_flight:
            if self._idle is None:
                self._idle = asyncio.Event()
            await self._idle.wait()

    def release(self, decision: RoutingDecision) -> None:
        chosen = decision.chosen
        assert chosen is not None
        self.replicas[chosen].in_flight -= 1
        self.in_flight -= 1
        if not self.in_flight and self._idle is not None:
            self._idle.set()
            self._idle = None
        self.reservations.finished(decision.key, chosen)

    def _decide(
        self, key: str, engine_model: str | None, avoid: Collection[str] = (), explain: bool = False
    ) -> RoutingDecision:
        reservations = self.reservations
        if reservations.clock() >= reservations.quiet_until:  # some key may lapse now: HomeReservations.expire
            reservations.expire()
        # Where the adapter is resident: where a spill looks first, and (predicted_ttft) the host regime's evidence,
        # whatever prefer_resident says.
        wants_resident = self.prefer_resident or self.scoring is not None
        resident = self.residency.resident_on(engine_model) if engine_model and wants_resident else _NOWHERE
        # The key's candidates as last built, while the ring and the resident set are the ones they were built from
        # (_candidates, inline: one lookup for a key seen before).
        entry = self.keys.get(key)
        self._fresh = None
        if entry is None or entry.resident is not resident or entry.version != self.ring.version:
            entry = self._candidates(key, resident, entry)
        self._entry = entry
        order, also_home = entry.order, entry.also_home
        if self.plan_bound is not None and engine_model is not None:
            confined = split(self, self.plan_bound, key, engine_model, order, resident, avoid)
            if confined is not None:
                decision = self._decide_confined(key, engine_model, confined, entry, resident, avoid, explain)
                if decision.warm_ahead is not None:
                    self._cap_warm_ahead(decision, engine_model)
                return decision
        if self.one_pass and not explain and not avoid:
            plain = decide_plain(self, key, engine_model, order, entry.records, entry.homes, resident, entry)
            if plain is not None:
                if plain.warm_ahead is not None:
                    self._cap_warm_ahead(plain, engine_model)
                return plain
        loads = self.snapshot(key, engine_model, order, resident)
        decision = self.router.decide(
            order,
            key,
            loads,
            self._ticks,
            reservations.standing(key),
            resident,
            avoid,
            explain,
            also_home,
        )
        if decision.warm_ahead is not None:
            self._cap_warm_ahead(decision, engine_model)
        return decision

    def _decide_confined(
        self,
        key: str,
        engine_model: str,
        confined: Confined,
        entry: KeyEntry,
        resident: frozenset[str],
        avoid: Collection[str],
        explain: bool,
    ) -> RoutingDecision:
        """The decision among the key's planned replicas, and, where plan_bound.split let some off the set compete
        (the queue bound passed), among those too: the off-set pick is taken only when predicted faster than the
        planned one by the bound's margin, and where its load pushes out a planned adapter in use by one adapter
        load more (what that adapter's key pays at its next request); a policy that does not predict takes a pick
        that pushes out nothing in use as its own rule says, and no other.

        A key whose adapter already has a second home (planned, or warm where an earlier spill loaded it) takes no
        off-set replica where its adapter is cold: the request would wait for that load off the plan, and so would
        every request of the key that follows it there while the load runs (the hot trace: the hot tenant's third
        copy, loaded on the request path a second after its surge and seconds before the plan's first look at it,
        6-7 of its streams waiting in each seed). The adapter is warmed there in the background instead (due: the
        key would take it now) and the request takes the best of the rest, so the key's next requests leave warm
        (issue 19: a hot adapter warm on a replica before requests spill there). A key with one copy leaves as
        before: its first spill loads its second home."""
        inside, outside, displace = confined
        planned = self._decide_among(key, engine_model, inside, entry, resident, avoid, explain)
        if not outside or planned.chosen is None:
            return planned
        decision = self._leave(key, engine_model, planned, inside, outside, displace, entry, resident, avoid, explain)
        chosen = decision.chosen
        if chosen is None or chosen in inside or self.residency.is_resident(chosen, engine_model):
            return decision
        residency = self.residency
        resident_on = residency.resident_on(engine_model)
        # Two copies resident settle it without the plan's scan (every replica's planned set, past the queue bound).
        if len(resident_on) < 2:
            copies = resident_on.union(r for r, names in residency.plan.items() if engine_model in names)
            if len(copies) <= 1:
                return decision
        warm = tuple(r for r in outside if residency.is_resident(r, engine_model))
        decision = self._leave(key, engine_model, planned, inside, warm, displace, entry, resident, avoid, explain)
        # Resident on spill_warm_replicas replicas already, no warm-up ahead starts (warm_ahead's cap): the key's
        # spills make no copy more, neither warmed nor on the request path, and the decision names none (/admin/route
        # showed one that never came). It stays on its copies (the hot trace: refused a fourth, its cold streams
        # after its second home was warm 0 in seed 19, 6 where it took the fourth cold).
        if len(resident_on) < self.spill_warm_replicas:
            decision.warm_ahead, decision.warm_ahead_due = chosen, True
        return decision

    def _leave(
        self,
        key: str,
        engine_model: str,
        planned: RoutingDecision,
        inside: tuple[str, ...],
        outside: tuple[str, ...],
        displace: frozenset[str],
        entry: KeyEntry,
        resident: frozenset[str],
        avoid: Collection[str],
        explain: bool,
    ) -> RoutingDecision:
        """``planned`` (the decision among ``inside``), or the decision among ``inside`` and ``outside`` where it
        picks a replica off the set by the margin (``_decide_confined``)."""
        if not outside:
            return planned
        either = self._decide_among(key, engine_model, inside + outside, entry, resident, avoid, explain)
        chosen = either.chosen
        if chosen is not None and chosen not in inside:
            assert self.plan_bound is not None
            pushes_out = chosen in displace
            margin = self.plan_bound.margin_ms + (self.residency.load_ms if pushes_out else 0.0)
            off, on = either.predictions.get(chosen), planned.predictions.get(planned.chosen or "")
            if off is None or on is None:
                if not pushes_out:
                    return either
            elif off.total_ms + margin < on.total_ms:
                return either
        if either.warm_ahead is not None and planned.warm_ahead is None:
            # routing.hold_copies kept a key with two copies off a cold replica predicted faster: the copy it names
            # is warmed ahead whichever replica the request stays on, as _decide_confined warms the one the key would
            # have taken (capped in _decide, as every path's).
            planned.warm_ahead, planned.warm_ahead_due = either.warm_ahead, either.warm_ahead_due
        return planned

    def _cap_warm_ahead(self, decision: RoutingDecision, engine_model: str | None) -> None:
        """No warm-up ahead named once the adapter is resident on ``spill_warm_replicas`` replicas: Pool.warm_ahead
        would start none, and /admin/route showed one that never came."""
        if engine_model is not None and len(self.residency.resident_on(engine_model)) >= self.spill_warm_replicas:
            decision.warm_ahead, decision.warm_ahead_due = None, False

    def _decide_among(
        self,
        key: str,
        engine_model: str,
        order: tuple[str, ...],
        entry: KeyEntry,
        resident: frozenset[str],
        avoid: Collection[str],
        explain: bool,
    ) -> RoutingDecision:
        """``_decide``'s last steps over ``order`` (candidates the key's preference has put first)."""
        homes = entry.homes
        if self.one_pass and not explain and not avoid:
            entries = tuple(self.records[r] for r in order)
            plain = decide_plain(self, key, engine_model, order, entries, homes, resident, entry)
            if plain is not None:
                return plain
        loads = self.snapshot(key, engine_model, order, resident)
        also_home = homes.difference(order[:1])
        standing = self.reservations.standing(key)
        return self.router.decide(order, key, loads, self._ticks, standing, resident, avoid, explain, also_home)

    def snapshot(
        self, key: str, engine_model: str | None, order: tuple[str, ...], resident: frozenset[str]
    ) -> list[ReplicaLoad]:
        """Each of ``order`` as the router sees it now, for the general pipeline (routing/pipeline.py)."""
        replicas, max_age, scoring = self.replicas, self.engine_view_max_age_s, self.scoring
        # One clock read for the whole snapshot: health's clock and the scrapes' are both time.monotonic here.
        now = time.monotonic()
        cap = self.max_in_flight_per_replica
        predicting = scoring is not None
        warm_since = now - self.prefix_warm_s
        # Where the key was served within prefix_warm_s (its prefix likely still in the KV cache there): one or two
        # replicas, found once per decision rather than looked up per candidate.
        entry = self.keys.get(key) if predicting else None
        warm_here = entry.served_since(warm_since) if entry is not None else ()
        # Where other gateways have requests in flight with the adapter (their loads under way included).
        flying = self.residency.signal.flying_on(self.name, engine_model) if predicting and engine_model else ()
        elsewhere = self.residency.signal.load_elsewhere(self.name) if self.shared_load_view else None
        reserved = self.reservations.by_replica
        likely_on_gpu = self.residency.likely_on_gpu
        listed_after = now - self.scrape_fresh_s  # a scrape since then still lists the adapters running
        evicting = self._evicting and engine_model is not None
        # The adapter loads under way per replica (this gateway's, the others'): what a cold load there waits for.
        loading_here, load_ms = self.residency.loading_here, self.residency.load_ms
        loading_there = self.residency.signal.loading_elsewhere(self.name)
        slot_waits = predicting and self.gpu_slot_on and engine_model is not None
        running_after = now - self.running_fresh_s
        # The named tuple's own __new__ without its Python-level argument handling: 0.10 us against 0.23 per
        # candidate per decision (every field is passed, in order).
        new_load = tuple.__new__
        loads: list[ReplicaLoad] = []
        for replica_id in order:
            replica = replicas[replica_id]
            health = replica.health
            # In service at full weight: one comparison (health.full_weight_at says why it holds).
            if now >= health.full_weight_at:
                healthy, weight = True, 1.0
            else:
                healthy, weight = health.routing_state(now)
            in_flight = replica.in_flight
            # predicted_ttft weighs two more signals; other policies skip them.
            on_gpu = key_recent = False
            if predicting and healthy:
                if engine_model is None:  # the base model is on every GPU
                    on_gpu = True
                elif (
                    (scraped := replica.engine_load) is not None
                    and engine_model in scraped.running_adapters
                    and replica.scraped_at >= listed_after
                ):
                    on_gpu = True  # the engine's last fresh scrape lists it running (any gateway's request)
                elif in_flight or replica_id in resident or replica_id in flying:
                    # The record: in use there, or among the replica's most recently used adapters (as many as the
                    # engine has GPU slots, 1 until a scrape says). Asked only where this gateway has requests in
                    # flight (the lease marks the adapter in use), the adapter is resident, or another gateway has
                    # it in flight: elsewhere the record cannot say yes.
                    on_gpu = likely_on_gpu(replica_id, engine_model, 1 if scraped is None else scraped.gpu_slots or 1)
                key_recent = replica_id in warm_here
            loads.append(
                new_load(
                    ReplicaLoad,
                    (
                        replica_id,
                        healthy,
                        (in_flight if max_age is None else replica.load_view(now, max_age))
                        if elsewhere is None
                        else in_flight + elsewhere.get(replica_id, 0),
                        reserved[replica_id],
                        weight,
                        in_flight >= cap,
                        on_gpu,
                        key_recent,
                        self._evict_loss(replica_id, now) if evicting and replica_id not in resident else 0.0,
                        loads_ahead_ms(loading_here.get(replica_id), loading_there.get(replica_id), now, load_ms)
                        if predicting and not on_gpu and replica_id not in resident
                        else 0.0,
                        self._gpu_slot_ms(replica_id, replica, engine_model, running_after)
                        if slot_waits and healthy and engine_model is not None
                        else 0.0,
                    ),
                )
            )
        return loads

    def _gpu_slot_ms(self, replica_id: str, replica: Replica, engine_model: str, running_after: float) -> float:
        """The gpu_slot scorer's figure for the replica: the expected wait for a GPU adapter slot where the request's
        adapter would wait for one (costs.gpu_slot_waits), else 0. (fleet/one_pass.py reads it the same way.)"""
        scraped = replica.engine_load
        if scraped is None or not scraped.gpu_slots:
            return 0.0
        running = scraped.running_adapters if replica.scraped_at >= running_after else _NOWHERE
        there = self.residency.signal.adapters_elsewhere(self.name, replica_id)
        here = self.residency.views[replica_id].in_flight
        if gpu_slot_waits(engine_model, here, there, running, scraped.gpu_slots):
            assert self.scoring is not None
            return self.scoring.model.gpu_slot_ms
        return 0.0

    def _candidates(self, key: str, resident: frozenset[str], entry: KeyEntry | None) -> KeyEntry:
        """The replicas a decision weighs, in the key's preference order, ``routing.candidates`` (K) of them at
        most, so a decision costs the same at any fleet size: the first K of the key's ring order, of which the
        last up to K/2 give way to replicas where the adapter is resident outside them (by name: a spill finds a
        warm one). The baselines that spread load (round robin, least loaded) weigh every replica. Returned with the
        rest of the key's placement replica set (``Ring.also_home``) and the one pass's entries for the candidates
        (one_pass.Entry), in ``entry`` (the key's, whose candidates are stale) or a new one that ``place`` keeps
        (``_fresh``)."""
        ring = self.ring
        if self._spreading:  # built at every decision, not kept
            order = ring.preference(key)
            return new_entry(resident, ring.version, order, ring.also_home(key), (), _NOWHERE)
        # Built here when the key's last answer is missing or stale (_decide looks it up: it holds while the ring and
        # the resident set, the same object until it changes, are the ones it was built from).
        count = self.candidate_count
        order = ring.head_unremembered(key, count)
        room = count // 2
        if resident and room:
            # The first K/2 resident replicas by name outside the head. With none inside it, the first K/2 by name
            # (a slice of the names kept per resident set); else a walk of the names that stops at K/2.
            by_name = self._resident_order.get(resident) or self._by_name(resident)
            if resident.isdisjoint(order):
                warm = by_name[:room]
            else:
                inside = resident.intersection(order)
                found: list[str] = []
                for replica_id in by_name:
                    if replica_id not in inside:
                        found.append(replica_id)
                        if len(found) == room:
                            break
                warm = tuple(found)
            if warm:
                order = order[: count - len(warm)] + warm
        # The rest of the key's replica set (Ring.also_home, inline): none without a placement table.
        also_home = ring.also_homes.get(key, _NOWHERE) if ring.also_homes else _NOWHERE
        # The candidates' entries by one itemgetter (one C call: half a list comprehension's cost at 8 candidates).
        records = itemgetter(*order)(self.records) if len(order) > 1 else tuple(self.records[r] for r in order)
        # The key's whole replica set: its home alone (one frozenset per replica, made once) unless the placement
        # table gives it more.
        homes = also_home.union(order[:1]) if also_home or not order else self._alone[order[0]]
        if entry is None:  # new_entry, inline: one call fewer at a first sight
            entry = self._fresh = _make(KeyEntry)
            entry.served_by, entry.served_at, entry.served_more = None, 0.0, None
        entry.resident, entry.version, entry.order = resident, ring.version, order
        entry.also_home, entry.records, entry.homes = also_home, records, homes
        return entry

    def _by_name(self, resident: frozenset[str]) -> tuple[str, ...]:
        """``resident`` sorted, once per distinct set (residency hands out the same set until it changes)."""
        ordered = self._resident_order.get(resident)
        if ordered is None:
            if len(self._resident_order) >= _RESIDENT_ORDERS:
                self._resident_order.clear()
            ordered = self._resident_order[resident] = tuple(sorted(resident))
        return ordered

    def is_healthy(self, replica_id: str) -> bool:
        return self.replicas[replica_id].healthy

    @property
    def any_healthy(self) -> bool:
        return any(replica.healthy for replica in self.replicas.values())

    async def probe(self, only: Collection[str] | None = None) -> dict[str, bool]:
        """Probe the replicas (those of the ids in ``only``, else every one) and take the results; returns them by
        the URL probed (answered healthy), which is what a sibling worker's round names: its replica of the same id
        may be another, its config or discovery differing from this worker's for a while."""
        replicas = [r for r in self.replicas.values() if only is None or r.endpoint.id in only]
        results = await asyncio.gather(*(self.driver.healthy(r.endpoint) for r in replicas))
        healthy = {replica.endpoint.url: ok for replica, ok in zip(replicas, results, strict=True)}
        self.took_probes(healthy)
        return healthy

    def took_probes(self, healthy: Mapping[str, bool]) -> None:
        """Take a probe round, by the URL probed: this gateway's own, or under serve --workers the one its host's
        probing worker shared (gateway/fleet/host_scrape.py). A replica the round does not name is left as it is."""
        for replica in self.replicas.values():
            ok = healthy.get(replica.endpoint.url)
            if ok is None:  # not probed in this round (a sibling's round for another config or discovery)
                continue
            replica_id = replica.endpoint.id
            health = replica.health
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

    def report(self, replica_id: str, failure: Failure | None, started_at: float = math.inf) -> None:
        """A request's outcome on a replica (passive outlier detection): None for a success; failures that point at
        the replica (outlier.py), in a row, eject it. ``started_at``: when the request was placed there (health's
        clock), so a success clears only the failures counted before it started."""
        health = self.replicas[replica_id].health
        if failure is None:
            health.request_succeeded(started_at)
            return
        ejected_now = sum(r.health.ejected for r in self.replicas.values())
        may_eject = ejected_now + 1 <= len(self.replicas) * self.config.outlier.max_ejected_percent // 100
        reason = health.attempt_failed(failure, may_eject)
        if reason is not None:
            until = health.ejected_until - health.clock()
            log.warning("replica %s/%s ejected for %.0f s (%s)", self.name, replica_id, until, reason)

    def cancel_welcomes(self) -> None:
        """Stop the pool's background work: replicas' welcomes back, warm-ups ahead of spills and engine scrapes."""
        for task in [*self._welcomes, *self._warming_ahead.values(), *self._scraping.values()]:
            task.cancel()

    async def scrape_engines(self) -> tuple[float, dict[str, EngineLoad | None]]:
        """Read every replica's own load signals, each taken as soon as it answers; returns when
        (``time.monotonic``) and what answered since the last round returned. A replica slower than that (up to the
        probe timeout, 2 s by default) is read on in the background, no second read started there meanwhile, and
        holds back neither the others' readings nor the next round. The rounds waited for it: with one replica
        answering at 2 s, every other replica's reading was older than the engine view's 1.5 s (3 intervals) 40%
        of the time, and routing read a replica whose engine had 60 requests queued as idle (its own count)."""
        scraping = self._scraping
        for replica_id, replica in self.replicas.items():
            if replica_id not in scraping:
                task = scraping[replica_id] = asyncio.create_task(self._scrape(replica.endpoint))
                task.add_done_callback(partial(self._scraped, replica_id))
        await asyncio.wait(list(scraping.values()), timeout=self.scrape_interval_s)
        taken, self._taken = self._taken, {}
        return time.monotonic(), taken

    def _scraped(self, replica_id: str, _: asyncio.Task[EngineLoad | None]) -> None:
        self._scraping.pop(replica_id, None)

    async def _scrape(self, endpoint: Endpoint) -> EngineLoad | None:
        """One replica's signals, taken as they come."""
        load = await self._load_signals(endpoint)
        self.took_scrape(time.monotonic(), {endpoint.id: load})
        self._taken[endpoint.id] = load
        return load

    async def _load_signals(self, endpoint: Endpoint) -> EngineLoad | None:
        """One replica's signals; a driver that raises on its page (what it did not expect) gives no reading for
        that replica alone, said once until it reads again: the pool's other replicas are still read."""
        try:
            load = await self.driver.load_signals(endpoint)
        except Exception:
            if endpoint.id not in self._unscraped:
                self._unscraped.add(endpoint.id)
                log.exception("reading the load signals of %s/%s failed", self.name, endpoint.id)
            return None
        self._unscraped.discard(endpoint.id)
        return load

    def took_scrape(self, at: float, loads: dict[str, EngineLoad | None]) -> None:
        """Take a scrape that answered at ``at`` (``time.monotonic``): this gateway's own, or under serve --workers
        the one its host's scraping worker shared (gateway/fleet/host_scrape.py). This gateway's requests in flight
        now are what its load view counts its change from. A replica the scrape does not name keeps its last one
        (it goes stale)."""
        for replica_id, load in loads.items():
            replica = self.replicas.get(replica_id)
            if replica is None:  # a sibling worker serving another config for a moment (a reload under way)
                continue
            if load is not None and not math.isfinite(load.running + load.waiting + load.kv_cache_usage):
                load = None  # NaN or inf on the engine's page is no reading (routing rounds the queue: it raised)
            if load is not None and self.config.seats > 0 and load.running <= _MOST_SEATS:
                self._follow_seats(replica_id, at, math.ceil(load.running))
            replica.engine_load = load
            replica.health.progress.scraped(load, replica.health.clock())
            replica.scraped_at = at
            replica.in_flight_at_scrape = replica.in_flight

    def _follow_seats(self, replica_id: str, at: float, running: int) -> None:
        """A replica's engine ran ``running`` requests at once (read at ``at``): the seats figure follows it up at
        once, and down with hysteresis (``SEATS_FOLLOW_S``, ``SEATS_LOWER_BELOW``), never below the stated one.
        Raised only, a figure learned from one busy engine held until restart: after that engine was replaced by one
        with a smaller --max-num-seqs, each key sized by seats counted too few requests as queued, and its spills
        stayed on planned replicas that already ran all they could."""
        if running > self.seats:
            self._more_seats(replica_id, running)
            self._seats_window_at, self._seats_window_most = at, running
            return
        if self._seats_window_at is None:
            self._seats_window_at = at
        self._seats_window_most = max(self._seats_window_most, running)
        if at - self._seats_window_at < SEATS_FOLLOW_S:
            return
        most = self._seats_window_most
        if self.seats > self.config.seats and 0 <= most < SEATS_LOWER_BELOW * self.seats:
            lowered = max(self.config.seats, most)
            log.info(
                "pool %s: no replica ran more than %d requests at once in %g s: seats %d -> %d (stated: %d)",
                self.name, most, SEATS_FOLLOW_S, self.seats, lowered, self.config.seats,
            )  # fmt: skip
            self.seats = lowered
        self._seats_window_at, self._seats_window_most = at, running

    def _more_seats(self, replica_id: str, running: int) -> None:
        """An engine ran more requests at once than ``seats`` says one runs: the figure is below its --max-num-seqs.
        Stated far below it (4 where engines run 64), every key with more than 2 requests in flight per replica
        counted as queued: homes from traffic sized it by seats and grew its set, where every slot was planned
        paying with a quiet key's planned slot (its adapter then loaded on the request path), and spills left their
        planned replicas once each ran 4. The larger figure holds until the engines show less for a whole window
        (``_follow_seats``); said once per pool, with the config's figure."""
        if not self._seats_said:
            self._seats_said = True
            log.warning(
                "pool %s: %s runs more requests at once than pools[].seats (%d seen, %d stated): the seats figure is "
                "below the engine's --max-num-seqs; routing and placement use what the engines show",
                self.name, replica_id, running, self.config.seats,
            )  # fmt: skip
        self.seats = running

    async def _welcome_back(self, replica: Replica) -> None:
        """A replica back from down has lost its adapters: reset its record from the engine, warm, fill its free
        slots (waiting ``residency.fill_wait_s`` at most: the rest goes on in the background), then serve."""
        replica_id = replica.endpoint.id
        try:
            await self.residency.reconcile([replica_id])
            await self.warm_replica(replica_id)
            if self.fill[replica_id]:
                fill = asyncio.create_task(self.fill_replica(replica_id), name=f"fill {self.name}/{replica_id}")
                self._welcomes.add(fill)
                fill.add_done_callback(self._welcomes.discard)
                await asyncio.wait({fill}, timeout=self.residency.config.fill_wait_s)
        finally:
            replica.health.back_in_service()

    async def fill_replica(self, replica_id: str) -> None:
        """Load the replica's planned adapters into its free slots (``PoolResidency.fill``: never evicting)."""
        loaded = await self.residency.fill(replica_id, self.fill[replica_id])
        if loaded:
            log.info("filled %d free slots of %s/%s: %s", len(loaded), self.name, replica_id, ", ".join(loaded))

    async def warm_replica(self, replica_id: str) -> None:
        for adapter, pinned in self.prewarm[replica_id]:
            try:
                await self.residency.warm(replica_id, adapter, pinned=pinned)
            except (BackendError, GatewayError) as exc:  # a full working set included: log it, warm the others
                log.error("pre-warming %s on %s/%s failed: %s", adapter.engine_name, self.name, replica_id, exc)


class Lease:
    """One request's hold on a replica, from ``Pool.lease`` to the end of its ``with`` block: counted in flight
    there (the bound and reservations see it) and its adapter marked in use (eviction leaves it alone). Leaving the
    block releases both, whatever happened. When nothing was placed (``replica`` is None, ``decision.unavailable``
    says why) there is nothing to release. The lease keeps the pool it placed on: a reload that swaps fleets
    meanwhile retires that pool only after every lease on it has ended."""

    __slots__ = (
        "adapter",
        "decision",
        "loaded",
        "placed_at",
        "pool",
        "replica",
        "replica_id",
        "started_at",
        "starting",
    )

    def __init__(self, pool: Pool, decision: RoutingDecision, adapter: AdapterRef | None) -> None:
        self.pool = pool
        self.decision = decision
        self.adapter = adapter
        self.replica: Replica | None = None
        self.replica_id = ""  # "" when nothing was placed
        self.started_at = math.inf
        # When it was placed (perf_counter, the request record's clock) and whether this attempt loaded the
        # adapter: what the TTFT it measures is learned as (predicted_ttft).
        self.placed_at = time.perf_counter()
        self.loaded = False
        # This attempt waited for its adapter's load and has not had its first byte: the load holds the replica's
        # lock until it has (``first_byte``, or the lease's end).
        self.starting = False
        if decision.chosen is not None:
            self.replica = pool.replicas[decision.chosen]
            self.replica_id = decision.chosen
            self.started_at = self.replica.health.clock()
            if adapter is not None:
                pool.residency.begin_use(decision.chosen, adapter.engine_name)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc_info: object) -> None:
        chosen = self.decision.chosen
        if chosen is None:
            return
        self.pool.release(self.decision)
        if self.adapter is not None:
            if self.starting:
                self.first_byte()
            self.pool.residency.end_use(chosen, self.adapter.engine_name)

    def adapter_resident(self) -> bool:
        """Whether the record holds the request's adapter resident on the leased replica (counted as a hit)."""
        assert self.adapter is not None
        residency = self.pool.residency
        if residency.is_resident(self.replica_id, self.adapter.engine_name):
            residency.count_hit()
            return True
        return False

    async def load_adapter(self) -> None:
        """Make sure the request's adapter is loaded on the leased replica (single-flight across requests)."""
        assert self.adapter is not None
        self.loaded = True
        self.starting = await self.pool.residency.ensure(self.replica_id, self.adapter, first_byte=True)

    def first_byte(self) -> None:
        """The request's first byte came (or it ended): a load it waited for may let the replica's lock go."""
        if self.starting:
            self.starting = False
            assert self.adapter is not None
            self.pool.residency.started(self.replica_id, self.adapter.engine_name)

    async def adapter_lost(self) -> None:
        """The engine says it does not hold the adapter: stop routing by it being there."""
        assert self.adapter is not None
        await self.pool.residency.lost(self.replica_id, self.adapter.engine_name)

    def report(self, failure: Failure | None) -> None:
        """The outcome of the request on the leased replica (None: it succeeded), for passive outlier detection."""
        self.pool.report(self.replica_id, failure, self.started_at)

    def learn_ttft(self, first_byte_at: float) -> tuple[Regime, float, float] | None:
        """A stream's first byte came at ``first_byte_at`` (perf_counter): teach the pool's TTFT model what this
        attempt's regime cost at the load it was placed under. Returns the regime, the model's TTFT for it before
        it learned, and the measured TTFT, in milliseconds (None when the pool does not predict). An attempt that
        loaded the adapter was cold, whatever was predicted."""
        scoring = self.pool.scoring
        predicted = self.decision.predictions.get(self.replica_id)
        if scoring is None or predicted is None:
            return None
        regime: Regime = "cold" if self.loaded else predicted.regime
        model = scoring.model
        expected_ms = model.line(regime).at(predicted.load)
        measured_ms = 1000 * (first_byte_at - self.placed_at)
        if predicted.waits_gpu_slot:  # its wait for a GPU slot is learned apart from its regime's line
            expected_ms += model.gpu_slot_ms
            model.observe_gpu_slot(regime, predicted.load, measured_ms)
        else:
            model.observe(regime, predicted.load, measured_ms)
        return regime, expected_ms, measured_ms
