"""A pool's adapter lifecycle: load on demand within the working set, record uses, evict on a timer, pre-warm,
and keep the record true to the engines.

The request path touches only the local view (a dict per replica): a resident adapter costs a dict lookup and a
use mark; the store is written behind in batches. Only a cold load talks to the store, under the replica's lock,
so two gateways never load on one replica at once, nor push it past ``max_adapters`` but as said below; a load of an
adapter another gateway loads there meanwhile stops waiting for the lock once it is resident (``_poll_pause``). A load
that requests waited for keeps the lock until they have had their first byte (``_settle``), then says it let it go
(the slot signal's ``unlocked``): the next load neither stalls them before their first step nor waits for a poll.

An adapter counts as in use, and is never evicted, while this gateway has requests in flight for it or, when
gateways share the store, any gateway marked a use within ``in_use_window_s`` (gateways re-mark adapters with
requests in flight at every flush). On an engine that queues for slots (vLLM), while the slot signal listens,
another gateway's use counts only while it has the adapter in flight (its ``flying`` messages, every 50 ms) or
within ``FLYING_GRACE_S`` of the last use this gateway knows of (``_victim``). A load that finds every resident
adapter in use: on an engine that queues requests for a full set (vLLM), it loads at once, over the bound, until a
later load or the timer brings the set back; on one that
refuses them (TensorRT-LLM), it waits with the lock released until one is free, up to ``slot_wait_timeout_s``, then
answers 503: this gateway's requests for an adapter end (woken at once), another gateway frees a slot (woken at once
by its release through the slot signal, gateway/residency/signal.py, which also says which adapters the other
gateways hold; without it, once the adapter's mark leaves the window). If the store is unreachable the lifecycle
goes on from its local view alone, says so in ``store_up``, and resynchronises from the engines when the store
answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from backends.base import AdapterRef, Endpoint, EngineDriver, EngineRequest
from backends.errors import AdapterCacheFull, BackendError, EngineTimeout, EngineUnavailable
from gateway.config import ResidencyConfig
from gateway.errors import GatewayError
from gateway.observe.metrics import GatewayMetrics, adder
from gateway.residency import owner
from gateway.residency.signal import FLYING_GRACE_S, NO_SIGNAL, Loading, Signal
from gateway.residency.store import FUTURE_MARK_S, ReplicaRecord, ResidencyStore, StoreUnavailable

log = logging.getLogger(__name__)


class WarmUpTimedOut(EngineTimeout):
    """A warm-up given up after ``residency.warm_up_timeout_s`` (``PoolResidency.warm``)."""


# A wait for the store's lock polls it this soon, then twice as long each time up to the last: a fallback, as another
# gateway's load says when it lets the lock go (``unlocked``: the wait polls again at once).
_POLL_FIRST_S = 0.01
_POLL_LAST_S = 0.2
# How much each load's measured time weighs in the expected time of a load (``PoolResidency.load_ms``).
_LOAD_MS_RATE = 0.1


class _LoadedMeanwhile(Exception):
    """A load waiting for the replica's lock found its adapter resident: another gateway's load brought it."""


@dataclass
class ReplicaView:
    """This gateway's view of one replica's record."""

    resident: dict[str, float] = field(default_factory=dict)
    pinned: set[str] = field(default_factory=set)
    in_flight: dict[str, int] = field(default_factory=dict)


def among_newest(resident: dict[str, float], used: float, slots: int) -> bool:
    """Whether an adapter last used at ``used`` is among the ``slots`` most recently used of ``resident`` (adapter ->
    last use): fewer than ``slots`` others were used after it. (``PoolResidency.likely_on_gpu``, and the one pass
    that reads it inline: gateway/fleet/one_pass.py.)"""
    if len(resident) <= slots:  # the whole set fits the GPU's slots: no count needed
        return True
    newer = 0  # adapters used after it: once ``slots`` of them, it has been swapped out
    for other in resident.values():
        if other > used:
            newer += 1
            if newer >= slots:
                return False
    return True


@dataclass
class ResidencyCounters:
    cold_loads: int = 0
    evictions_on_request_path: int = 0
    evictions_scheduled: int = 0
    reconcile_fixes: int = 0
    fill_loads: int = 0  # loads into free slots by the fill (start-up, a replica's return), not by a request


class PoolResidency:
    def __init__(
        self,
        pool: str,
        replicas: Iterable[Endpoint],
        driver: EngineDriver,
        store: ResidencyStore,
        config: ResidencyConfig,
        *,
        max_adapters: int,
        load_timeout_s: float,
        shared: bool,
        overcommit: bool = False,
        settle_loads: bool = True,
        metrics: GatewayMetrics | None = None,
        wall_clock: Callable[[], float] = time.time,
        signal: Signal = NO_SIGNAL,
    ) -> None:
        self.pool = pool
        self.endpoints = {endpoint.id: endpoint for endpoint in replicas}
        self.driver = driver
        self.store = store
        self.config = config
        self.max_adapters = max_adapters
        self.load_timeout_s = load_timeout_s
        # Alone, this gateway knows exactly what is in flight; sharing the store, another gateway's requests show
        # only as use marks, renewed at every flush while they run.
        self.in_use_window_s = config.shared_in_use_window_s if shared else 0.0
        self.views = {replica_id: ReplicaView() for replica_id in self.endpoints}
        # The engine queues a request whose adapter has no slot (vLLM) rather than refusing it: a load past the
        # slot wait then runs the working set over max_adapters instead of failing the request.
        self.overcommit = overcommit
        # The engine runs a load between its steps (vLLM): a load that requests waited for holds the replica until
        # they have started (``_settle``). An engine that runs it as a request among the others (TensorRT-LLM) has
        # nothing to protect: the hold would only delay the next load.
        self.settle_loads = settle_loads
        # Loads waiting for a slot now, per replica (a gauge at scrape time).
        self.slot_waiters = dict.fromkeys(self.endpoints, 0)
        self._resident_on: dict[str, frozenset[str]] = {}  # adapter -> replicas holding it (resident_on's memo)
        # Per replica, the adapters of the keys homed there (the fill's plan, set by the fleet): the timer does not
        # evict them for idleness while no other adapter wants a slot there.
        self.plan: dict[str, frozenset[str]] = {}
        # Per replica, when (wall clock) a load last found its working set full: another adapter wanted a slot.
        self._slot_wanted_at: dict[str, float] = {}
        self.counters = ResidencyCounters()
        self.store_up = True
        # Replicas whose record the store found a key of another type in, and repaired: rebuilt from their engines
        # at the next sync (``_read_record``).
        self._repaired: set[str] = set()
        self.metrics = metrics or GatewayMetrics()
        self._hits = adder(self.metrics.residency_lookups.labels(pool, "hit"))  # once per request: no checks
        self._misses = self.metrics.residency_lookups.labels(pool, "miss")
        self._wall_clock = wall_clock
        # The store's clock minus this gateway's (``_learn_clock``): use times are stamped on the store's clock.
        self._clock_offset = 0.0
        # Lock holders: this process's owner (stable across its restarts with state.identity_dir), then this pool's
        # own part (a reload's new fleet and the old one it replaces exclude each other).
        self._process_owner = owner.current()
        self._owner = f"{self._process_owner.live}{uuid.uuid4().hex[:6]}"
        self._pending_uses: dict[tuple[str, str], float] = {}
        # Loads under way, per (replica, adapter): what their requests wait for (resolved once the adapter is
        # resident, before the load's hold ends: ``_settle``), and the tasks themselves.
        self._loads: dict[tuple[str, str], asyncio.Future[None]] = {}
        self._load_tasks: set[asyncio.Task[None]] = set()
        # Each load's task by (replica, adapter), and how many ``ensure`` calls wait for it now: a warm-up given up
        # cancels a load that no one else waits for (``warm``).
        self._load_task_of: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._load_waiters: dict[tuple[str, str], int] = {}
        # Per (replica, adapter): the requests that waited for its load and have not had their first byte yet
        # (``started``), and what a load holding the replica's lock for them waits on (``_settle``).
        self._starting: dict[tuple[str, str], int] = {}
        self._all_started: dict[tuple[str, str], asyncio.Event] = {}
        self._replica_locks = {replica_id: asyncio.Lock() for replica_id in self.endpoints}
        # Set when an adapter's last request in flight here ends: a load waiting for room looks again.
        self._adapter_idle = {replica_id: asyncio.Event() for replica_id in self.endpoints}
        # Per replica, the adapters whose loads wait for a slot, in arrival order (one load per adapter).
        self._slot_line: dict[str, deque[str]] = {replica_id: deque() for replica_id in self.endpoints}
        # Slots other gateways freed (their releases) or news that their held sets are complete, counted per
        # replica: a waiter that sees the count move looks again under the lock.
        self._remote_news = dict.fromkeys(self.endpoints, 0)
        self.signal = signal
        # Replicas whose record is being read again after another gateway's news (``remote_set_changed``).
        self._rereads: dict[str, asyncio.Task[None]] = {}
        # Per replica, set (and replaced) once this gateway's view has read another gateway's change to its set: a
        # load waiting for the replica's lock looks whether its adapter came (``_poll_pause``). A waiter takes the
        # event before it looks, so news between its look and its wait is not missed, and never clears one.
        self._news = {replica_id: asyncio.Event() for replica_id in self.endpoints}
        # Per replica, the other gateways' loads heard letting its lock go (``remote_unlocked``), counted: a wait for
        # the lock that sees the count move polls again at once (``_poll_pause``; the event above wakes it).
        self._unlocks = dict.fromkeys(self.endpoints, 0)
        # This gateway's forgets of an adapter on a replica (the engine lost it, or this gateway unloaded it),
        # numbered: per replica, each adapter's last. A record read that began before a forget may still list the
        # adapter (the store's removal lands after the forget) and must not bring it back into the view: the next
        # request would find it "resident", skip the load, and get the engine's 404 again (``_adopt``).
        self._forgets = 0
        self._forgotten: dict[str, dict[str, int]] = {replica_id: {} for replica_id in self.endpoints}
        # Per replica, this gateway's adapter loads under way there (what routing's load_ahead term reads, with the
        # other gateways' as the slot signal shares them: routing/costs.py, ``Loading``): the adapters whose loads
        # are begun and not yet at the engine, and when the engine's load there began.
        self._load_queued: dict[str, set[str]] = {replica_id: set() for replica_id in self.endpoints}
        self._load_running: dict[str, float] = {}
        self.loading_here: dict[str, Loading] = {}
        # The expected time of one adapter load, in milliseconds: a moving average of this gateway's loads, from a
        # prior the pool sets (its cold regime's prior less its kv_cold one).
        self.load_ms = 400.0
        self._detach_signal = signal.attach(pool, self)

    # --- the request path -------------------------------------------------------------------------------------

    def _now(self) -> float:
        """Unix seconds on the store's clock (this gateway's own clock when the store keeps none)."""
        return self._wall_clock() + self._clock_offset

    async def _learn_clock(self) -> None:
        """Learn how far the store's clock is from this gateway's. Use marks in a shared record are compared by every
        gateway with its own now: a gateway whose clock ran 5 minutes ahead wrote marks the others took for uses
        still to come, so its adapters were never idle to them (never evicted, a full working set refused loads the
        engine would take: 503) until the real time caught up, and last uses only move forward, so the marks stayed
        after its clock was fixed (tests/gateway/residency/test_clock_skew.py). Raises ``StoreUnavailable``."""
        before = self._wall_clock()
        store_now = await self.store.clock()
        if store_now is not None:
            self._clock_offset = store_now - (before + self._wall_clock()) / 2

    def is_resident(self, replica_id: str, engine_name: str) -> bool:
        return engine_name in self.views[replica_id].resident

    def count_hit(self) -> None:
        """A request found its adapter resident (the caller checked ``is_resident`` itself)."""
        self._hits(1)

    def resident_on(self, engine_name: str) -> frozenset[str]:
        """The replicas whose record holds the adapter: a scan of the pool once per change of any replica's set,
        then a dict lookup per request."""
        replicas = self._resident_on.get(engine_name)
        if replicas is None:
            replicas = frozenset(r for r, view in self.views.items() if engine_name in view.resident)
            self._resident_on[engine_name] = replicas
        return replicas

    def _sets_changed(self) -> None:
        """Some replica's resident set changed (not only a use time): the per-adapter answers are stale."""
        self._resident_on.clear()

    def _heard_news(self, replica_id: str) -> None:
        """Wake whatever waits for another gateway's news about the replica (``_news``)."""
        event = self._news[replica_id]
        self._news[replica_id] = asyncio.Event()
        event.set()

    def likely_on_gpu(self, replica_id: str, engine_name: str, gpu_slots: int) -> bool:
        """Whether the adapter is likely in one of the replica's ``gpu_slots`` GPU slots: a gateway has requests in
        flight with it there (this one, or another as the slot signal last shared: so a load another gateway has
        under way is seen), or it is among the replica's ``gpu_slots`` most recently used adapters (engines replace
        the least recently used slot; the use times are every gateway's when they share a store)."""
        view = self.views[replica_id]
        if engine_name in view.in_flight:
            return True
        used = view.resident.get(engine_name)
        if used is not None and among_newest(view.resident, used, gpu_slots):
            return True
        # Last, as it costs a call: another gateway's requests in flight there (the slot signal's last news).
        return self.signal.flying_elsewhere(self.pool, replica_id, engine_name)

    def next_victim(self, replica_id: str) -> str | None:
        """The adapter a load on the replica would push out now: None while its set has a free slot, else the least
        recently used one that is neither pinned nor in flight here (what the engine's LRU drops too). For routing:
        a look at this gateway's view only, without the slot signal's or the in-use window's holds."""
        view = self.views[replica_id]
        resident = view.resident
        if len(resident) < self.max_adapters:
            return None
        busy, pinned = view.in_flight, view.pinned
        victim, oldest = None, float("inf")
        for name, used in resident.items():
            if used < oldest and name not in busy and name not in pinned:
                victim, oldest = name, used
        return victim

    def room_to_spare(self, replica_id: str, idle_s: float) -> bool:
        """Whether a load on the replica now would take a free slot, or push out only an adapter (``next_victim``)
        that no request has used for ``idle_s`` (use times are every gateway's when they share a store). For loads
        no request waits for (warming ahead of a hot key's spills): one that pushes out an adapter still in use costs
        its tenant a cold load on the request path, and where the adapters fill every slot exactly that tenant then
        pushes out another."""
        resident = self.views[replica_id].resident
        if len(resident) < self.max_adapters:
            return True
        victim = self.next_victim(replica_id)
        return victim is not None and resident[victim] <= self._now() - idle_s

    def room_for(self, replica_id: str, idle_s: float) -> bool:
        """Whether a load on the replica now would push out no adapter planned there that a request used within
        ``idle_s``: a free slot, or the adapter it would push out (``next_victim``) is not in the replica's plan or
        is idle that long. For a spill off its key's planned replicas (gateway/fleet/plan_bound.py): it must not
        take the slot of another key's planned adapter while that key has traffic."""
        resident = self.views[replica_id].resident
        if len(resident) < self.max_adapters:
            return True
        victim = self.next_victim(replica_id)
        if victim is None:
            return False
        return victim not in self.plan.get(replica_id, ()) or resident[victim] <= self._now() - idle_s

    def begin_use(self, replica_id: str, engine_name: str) -> None:
        in_flight = self.views[replica_id].in_flight
        in_use = in_flight.get(engine_name, 0)
        in_flight[engine_name] = in_use + 1
        if not in_use:  # another gateway waiting for a slot there hears that this one now holds the adapter
            self.signal.changed(self.pool, replica_id, freed=False)

    def end_use(self, replica_id: str, engine_name: str) -> None:
        view = self.views[replica_id]
        view.in_flight[engine_name] -= 1
        if not view.in_flight[engine_name]:
            del view.in_flight[engine_name]
            self._adapter_idle[replica_id].set()
            self.signal.changed(self.pool, replica_id, freed=True)  # a release, if another gateway waits there
        now = self._now()
        self._pending_uses[(replica_id, engine_name)] = now
        if engine_name in view.resident:
            view.resident[engine_name] = now

    async def ensure(
        self, replica_id: str, adapter: AdapterRef, *, pinned: bool = False, first_byte: bool = False
    ) -> bool:
        """Return once ``adapter`` is resident on the replica; one load per replica and adapter at a time. Returns
        whether it waited for a load. ``first_byte``: the caller sends a request through the adapter next and, if
        this waited for a load, calls ``started`` once that request's first byte came (or it gave up): the load
        holds the replica's lock until then (``_settle``)."""
        view = self.views[replica_id]
        if adapter.engine_name in view.resident and (not pinned or adapter.engine_name in view.pinned):
            self._hits(1)
            return False
        self._misses.inc()
        if len(view.resident) >= self.max_adapters:
            self._slot_wanted_at[replica_id] = self._now()
        key = (replica_id, adapter.engine_name)
        ready = self._loads.get(key)
        if ready is None:
            ready = self._loads[key] = asyncio.get_running_loop().create_future()
            # Read by a done callback too: a load whose waiters all gave up does not log an unread exception.
            ready.add_done_callback(lambda done: done.cancelled() or done.exception())
            self._load_queued[replica_id].add(adapter.engine_name)
            self._note_loading(replica_id)
            task = asyncio.create_task(self._load(replica_id, adapter, pinned, ready), name=f"load {key}")
            self._load_tasks.add(task)
            task.add_done_callback(self._load_tasks.discard)
            self._load_task_of[key] = task
            task.add_done_callback(
                lambda done: self._load_task_of.pop(key) if self._load_task_of.get(key) is done else None
            )
        if first_byte:
            self._starting[key] = self._starting.get(key, 0) + 1
        self._load_waiters[key] = self._load_waiters.get(key, 0) + 1
        try:
            # shield: one caller giving up (client gone) must not cancel the load the others wait for.
            await asyncio.shield(ready)
        except BaseException:
            if first_byte:
                self.started(replica_id, adapter.engine_name)
            raise
        finally:
            left = self._load_waiters[key] - 1
            if left:
                self._load_waiters[key] = left
            else:
                del self._load_waiters[key]
        return True

    def started(self, replica_id: str, engine_name: str) -> None:
        """A request that waited for the adapter's load (``ensure(first_byte=True)``) had its first byte, or gave
        up: once all of them have, the load that holds the replica's lock for them lets it go."""
        key = (replica_id, engine_name)
        left = self._starting.get(key, 0) - 1
        if left > 0:
            self._starting[key] = left
            return
        self._starting.pop(key, None)
        event = self._all_started.pop(key, None)
        if event is not None:
            event.set()

    def load_under_way(self, replica_id: str, engine_name: str) -> bool:
        """Whether this gateway is loading the adapter on the replica now (a request's load, or a warm-up's)."""
        return (replica_id, engine_name) in self._loads

    @property
    def loading(self) -> list[tuple[str, str]]:
        """(replica, adapter) loads in progress in this gateway."""
        return list(self._loads)

    async def lost(self, replica_id: str, engine_name: str) -> None:
        """The engine answered that it does not know the adapter: forget it, so the next ``ensure`` loads it."""
        self._forget(replica_id, engine_name)
        await self._store_call(self.store.remove(self.pool, replica_id, [engine_name]))
        self.signal.set_changed(self.pool, replica_id)

    # --- loads and evictions, under the replica's lock ---------------------------------------------------------

    async def _load(self, replica_id: str, adapter: AdapterRef, pinned: bool, ready: asyncio.Future[None]) -> None:
        """Load the adapter for ``ensure``'s waiters, who wait on ``ready``: resolved once it is resident (or with
        the load's error), while the load may still hold the replica's lock for them (``_settle``)."""
        key = (replica_id, adapter.engine_name)
        try:
            await self._load_for(replica_id, adapter, pinned, ready)
        except Exception as exc:
            if not ready.done():
                ready.set_exception(exc)
        finally:
            if self._loads.get(key) is ready:
                del self._loads[key]
            if not ready.done():  # cancelled (the pool closing): so are its waiters
                ready.cancel()
            self._load_queued[replica_id].discard(adapter.engine_name)  # it never reached the engine
            self._note_loading(replica_id)

    def _note_loading(self, replica_id: str) -> None:
        """This gateway's loads on the replica changed: what routing reads (``loading_here``) and the slot signal
        shares with the other gateways."""
        queued, running = len(self._load_queued[replica_id]), self._load_running.get(replica_id)
        entry = (queued, running) if queued or running is not None else None
        if entry == self.loading_here.get(replica_id):
            return
        if entry is None:
            del self.loading_here[replica_id]
        else:
            self.loading_here[replica_id] = entry
        self.signal.loading(self.pool, replica_id, entry)

    async def _load_for(self, replica_id: str, adapter: AdapterRef, pinned: bool, ready: asyncio.Future[None]) -> None:
        await self.driver.prepare_adapter(adapter)  # outside the lock: other loads on the replica need not wait
        give_up_at = time.monotonic() + self.config.slot_wait_timeout_s
        name, in_line = adapter.engine_name, self._slot_line[replica_id]
        key = (replica_id, name)
        try:
            while True:
                # Counted before looking: a release heard while this load looks under the lock is not missed.
                news = self._remote_news[replica_id]
                try:
                    async with self._locked(replica_id, name, None if pinned else name, announce=True) as record:
                        if name in record.resident:
                            await self._load_locked(replica_id, adapter, pinned, record)
                            self._ready(key, ready)
                            return
                        # Loads waiting for a slot take one in arrival order: a newcomer finding room while others
                        # wait does not take it (the first in line is woken for it) and queues behind them.
                        first = not in_line or in_line[0] == name
                        if first and await self._made_room(replica_id, record):
                            await self._load_locked(replica_id, adapter, pinned, record)
                            self._ready(key, ready)
                            await self._settle(key)
                            return
                except _LoadedMeanwhile:
                    self._ready(key, ready)
                    return
                if name not in in_line:
                    in_line.append(name)
                if not first:
                    self._adapter_idle[replica_id].set()
                # Wait with the lock released: the holders of the slots may need it to finish (another gateway's
                # request for an adapter this one loaded, say), and other adapters' loads may find room meanwhile.
                await self._wait_for_room(replica_id, record, give_up_at, news)
        finally:
            if name in in_line:
                in_line.remove(name)
                self._adapter_idle[replica_id].set()  # the next in line looks again

    def _ready(self, key: tuple[str, str], ready: asyncio.Future[None]) -> None:
        """The adapter is resident: its waiters go on (a later ``ensure`` finds it in the view)."""
        if self._loads.get(key) is ready:
            del self._loads[key]
        if not ready.done():
            ready.set_result(None)

    async def _settle(self, key: tuple[str, str]) -> None:
        """Keep the replica's lock (the caller holds it) until the requests that waited for this load have had their
        first byte (``started``), at most ``load_settle_s``. vLLM runs a load between engine steps: a load begun at
        once, by any gateway, would run before those requests' first step, and they would pay for two loads
        (churn trace: a request's wait after its own load ended was another load's in a quarter of the slowest).
        The next load's requests wait no longer than the hold."""
        if not self.settle_loads or not self._starting.get(key) or self.config.load_settle_s <= 0:
            return
        event = self._all_started.setdefault(key, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.config.load_settle_s):
                await event.wait()

    async def _load_locked(self, replica_id: str, adapter: AdapterRef, pinned: bool, record: ReplicaRecord) -> None:
        if adapter.engine_name not in record.resident:
            self._load_queued[replica_id].discard(adapter.engine_name)
            started = self._load_running[replica_id] = time.monotonic()
            self._note_loading(replica_id)
            try:
                await self.driver.load_adapter(self.endpoints[replica_id], adapter)
            finally:
                del self._load_running[replica_id]
                self._note_loading(replica_id)
            took_s = time.monotonic() - started
            self.load_ms += _LOAD_MS_RATE * (1000.0 * took_s - self.load_ms)
            self.metrics.adapter_load_seconds.labels(self.pool).observe(took_s)
            self.metrics.adapter_loads.labels(self.pool, replica_id, adapter.engine_name).inc()
            self.metrics.activity.cold_load(adapter.engine_name)
            self.counters.cold_loads += 1
            log.info("loaded adapter %s on %s/%s", adapter.engine_name, self.pool, replica_id)
        now = self._now()
        await self._store_call(self.store.add(self.pool, replica_id, adapter.engine_name, now, pinned=pinned))
        view = self.views[replica_id]
        news = adapter.engine_name not in view.resident or (pinned and adapter.engine_name not in view.pinned)
        view.resident[adapter.engine_name] = now
        self._sets_changed()
        if pinned:
            view.pinned.add(adapter.engine_name)
        if news:
            self.signal.set_changed(self.pool, replica_id)

    async def _made_room(self, replica_id: str, record: ReplicaRecord) -> bool:
        """Whether one more adapter fits now: there is a free slot, or evicting the least recently used idle
        adapters makes one. A set that ran over its bound (below) comes back under it at the next load, as the
        engine's own cache does: vLLM's host cache drops least recently used adapters until the new one fits, and a
        record left holding more than the engine would name adapters the engine has dropped (their next request
        loads from disk where routing predicted a swap-in). When none is idle, an engine that queues requests for a
        full set (vLLM) takes it at once, over max_adapters: it never waits."""
        if len(record.resident) < self.max_adapters:
            return True
        resident = dict(record.resident)
        while len(resident) >= self.max_adapters:
            victim = self._victim(replica_id, resident, record.pinned)
            if victim is None:
                break
            await self._unload(replica_id, victim)
            del resident[victim]
            self.counters.evictions_on_request_path += 1
            self.metrics.evictions.labels(self.pool, replica_id, "request_path").inc()
        if len(resident) < self.max_adapters:
            return True
        if self.overcommit:
            log.warning(
                "%s/%s: every slot in use; loading over max_adapters (%d), as the engine queues for slots",
                self.pool, replica_id, self.max_adapters,
            )  # fmt: skip
            self.metrics.slot_waits.labels(self.pool, replica_id, "over").inc()
            return True
        return False

    async def _unload(self, replica_id: str, engine_name: str) -> None:
        """Forget it locally first (so new requests stop choosing it), then in the engine, then in the store."""
        self._forget(replica_id, engine_name)
        await self.driver.unload_adapter(self.endpoints[replica_id], engine_name)
        await self._store_call(self.store.remove(self.pool, replica_id, [engine_name]))
        self.signal.changed(self.pool, replica_id, freed=True)
        self.signal.set_changed(self.pool, replica_id)
        log.info("unloaded adapter %s from %s/%s", engine_name, self.pool, replica_id)

    def _victim(self, replica_id: str, resident: dict[str, float], pinned: Iterable[str]) -> str | None:
        """The least recently used resident adapter that is neither pinned nor in use: in flight here, or held by
        another gateway as the slot signal says while this one waits there, or else used within the in-use window.
        On an engine that queues for slots (vLLM), in flight at another gateway as its last ``flying`` message
        said, or used within ``FLYING_GRACE_S`` (begun there since): the in-use window (a second) called every
        adapter of a busy replica in use, loads then ran the set over ``max_adapters``, and the engine's own host
        cache dropped adapters the record still held (their next request paid a cold load routing had not
        priced)."""
        busy = set(pinned) | set(self.views[replica_id].in_flight)
        now = self._now()
        in_use_since = now - self.in_use_window_s
        held_elsewhere = self.signal.remote_holds(self.pool, replica_id) if self.in_use_window_s else None
        flying = self.signal.flying_at(self.pool, replica_id) if self.in_use_window_s and self.overcommit else None
        if held_elsewhere is not None:
            busy |= held_elsewhere
            in_use_since = float("inf")
        elif flying is not None:
            busy |= flying
            in_use_since = now - FLYING_GRACE_S
        idle = [(used, name) for name, used in resident.items() if name not in busy and used <= in_use_since]
        return min(idle)[1] if idle else None

    # --- what the slot signal asks (gateway/residency/signal.py) ----------------------------------------------------

    def held_here(self, replica_id: str) -> frozenset[str]:
        view = self.views.get(replica_id)
        return frozenset(view.in_flight) if view is not None else frozenset()

    def flying(self) -> Iterator[tuple[str, frozenset[str], int]]:
        for replica_id, view in self.views.items():
            if view.in_flight:
                yield replica_id, frozenset(view.in_flight), sum(view.in_flight.values())

    def remote_used(self, replica_id: str, adapters: Collection[str]) -> None:
        view = self.views.get(replica_id)
        if view is None:
            return
        resident, now = view.resident, self._now()
        for name in adapters:
            if resident.get(name, now) < now:
                resident[name] = now

    def remote_release(self, replica_id: str) -> None:
        if replica_id in self._remote_news:
            self._remote_news[replica_id] += 1
            self._adapter_idle[replica_id].set()

    def detach(self) -> None:
        """Stop hearing the other gateways (a retired or closed fleet's lifecycle)."""
        self._detach_signal()
        for task in self._rereads.values():
            task.cancel()
        self._rereads.clear()

    def remote_set_changed(self, replica_id: str) -> None:
        """Read the replica's record again now (one read however many changes arrive while it runs)."""
        if replica_id not in self.views or replica_id in self._rereads:
            return
        task = asyncio.get_running_loop().create_task(self._reread(replica_id), name=f"reread {self.pool}/{replica_id}")
        self._rereads[replica_id] = task

    def remote_unlocked(self, replica_id: str) -> None:
        """Another gateway's load let the replica's lock go: a wait for it polls again now."""
        if replica_id in self._unlocks:
            self._unlocks[replica_id] += 1
            self._heard_news(replica_id)

    async def _reread(self, replica_id: str) -> None:
        try:
            await asyncio.sleep(0)  # news that arrive in the same turn share this read
            self._rereads.pop(replica_id, None)  # news from here on start another read: this one may miss them
            if self.store_up:
                await self._read_record(replica_id)
                self._store_answered()
                self._heard_news(replica_id)  # the view holds the change now
        except StoreUnavailable as exc:
            self._store_failed(exc)

    def _may_wait(self, replica_id: str, record: ReplicaRecord, give_up_at: float) -> bool:
        """Whether a load may still wait for a slot: the engine refuses requests for a full set (one that queues
        them gains nothing from a wait: unloading a name frees none of its memory, and the request would only be
        late), some resident adapter can become idle, the wait is not over, and the replica's wait queue has room."""
        if self.overcommit:
            return False
        evictable = any(name not in record.pinned for name in record.resident)
        queue = self.slot_waiters[replica_id] < self.config.slot_wait_queue
        return evictable and queue and time.monotonic() < give_up_at

    async def _wait_for_room(self, replica_id: str, record: ReplicaRecord, give_up_at: float, news: int) -> None:
        """Wait, without the replica's lock, until an adapter may be evicted: one of ours finishes its requests
        (woken at once), another gateway frees a slot (woken at once by the slot signal), or another gateway's use
        mark ages out of the in-use window (woken then), or the wait is over. Only for an engine that refuses a full
        cache (one that queues loads over the bound in ``_made_room`` instead). When the wait is over or hopeless
        raise ``AdapterCacheFull``: the engine's own answer to a full cache, which dispatch tries on another replica
        and otherwise answers 503 with Retry-After. ``news``: the count of other gateways' releases when the load
        last looked; if it moved since, look again at once."""
        if not self._may_wait(replica_id, record, give_up_at):
            self.metrics.slot_waits.labels(self.pool, replica_id, "refused").inc()
            log.warning("%s/%s: working set full, all pinned or in use", self.pool, replica_id)
            raise AdapterCacheFull(503, f"{self.pool}/{replica_id} has no room for another adapter now")
        self.metrics.slot_waits.labels(self.pool, replica_id, "waited").inc()
        view, idle = self.views[replica_id], self._adapter_idle[replica_id]
        self.slot_waiters[replica_id] += 1
        try:
            with self.signal.waiting(self.pool, replica_id):
                while (timeout := self._slot_wait_timeout(replica_id, record, give_up_at)) > 0:
                    if self._remote_news[replica_id] != news:
                        return  # another gateway freed a slot (the record says which), or said what it holds
                    idle.clear()
                    try:
                        await asyncio.wait_for(idle.wait(), timeout)
                    except TimeoutError:
                        return  # a mark may have aged out, or the wait is over: look again under the lock
                    # One of ours went idle: look again under the lock only if that made an adapter evictable here
                    # (every waiter wakes; most find nothing and wait on without touching the store).
                    if self._victim(replica_id, dict(view.resident), view.pinned) is not None:
                        return
        finally:
            self.slot_waiters[replica_id] -= 1

    def _slot_wait_timeout(self, replica_id: str, record: ReplicaRecord, give_up_at: float) -> float:
        """How long to wait before looking again: until the oldest other-gateway mark ages out, or the wait ends."""
        in_flight = self.views[replica_id].in_flight
        marked = [used for name, used in record.resident.items() if name not in record.pinned and name not in in_flight]
        timeout = give_up_at - time.monotonic()
        if marked:
            timeout = min(timeout, max(0.01, min(marked) + self.in_use_window_s - self._now()))
        return timeout

    @contextlib.asynccontextmanager
    async def _locked(
        self, replica_id: str, purpose: str, wanted: str | None = None, *, announce: bool = False
    ) -> AsyncIterator[ReplicaRecord]:
        """Hold the replica's lock (this gateway's, and the store's across gateways) and yield its fresh record.
        ``wanted``: the adapter a load takes the lock for; if another gateway's load brings it while this one waits
        for the store's lock, raise ``_LoadedMeanwhile`` instead (``_poll_pause``). ``announce``: once the store's
        lock is let go, tell the other gateways (a request's load: one message per load; their waits poll again)."""
        holder = f"{self._owner} {purpose}"
        async with self._replica_locks[replica_id]:
            shared = await self._acquire_shared(replica_id, holder, wanted)
            keeping = asyncio.create_task(self._keep_lock(replica_id, holder), name="lock renewal") if shared else None
            try:
                record = await self._fresh_record(replica_id)
                yield record
            finally:
                if keeping is not None:
                    keeping.cancel()
                if shared:
                    with contextlib.suppress(StoreUnavailable):
                        await self.store.release(self.pool, replica_id, holder)
                    if announce:
                        self.signal.unlocked(self.pool, replica_id)

    async def _keep_lock(self, replica_id: str, holder: str) -> None:
        """Renew the store's lock every third of ``residency.lock_ttl_s`` while this gateway holds it. The ttl is
        what a gateway killed mid-load costs the others (and itself, restarted): every load, eviction and
        reconciliation on the replica waits for the lock to lapse. Unrenewed, the ttl had to outlast the longest
        load (``adapter_load_timeout_s``, 60 s): it was 120 s, and a survivor's load there waited 60 s, then gave up;
        a restarted gateway's start-up reconciliation waited 60 s per such replica before it turned ready."""
        ttl_s = self.config.lock_ttl_s
        while True:
            await asyncio.sleep(ttl_s / 3)
            try:
                kept = await self.store.renew(self.pool, replica_id, holder, ttl_s)
            except StoreUnavailable:
                continue  # the store is down: its lock lapses, and this gateway goes on from its local view
            if not kept:
                log.warning("%s/%s: the replica's lock lapsed under this gateway's %s", self.pool, replica_id, holder)
                return

    async def _acquire_shared(self, replica_id: str, holder: str, wanted: str | None = None) -> bool:
        """Take the store's lock, waiting for another gateway's load to end; False when the store is down. Raises
        ``_LoadedMeanwhile`` once ``wanted`` is resident (``_poll_pause``). A store known to be down is not asked
        (the sync asks again every ``residency.sync_interval_s``): a Redis that accepts connections and never answers
        costs each call ``state.operation_timeout_s``, and this is asked under the replica's own lock, so loads onto
        one replica paid it one after another."""
        if not self.store_up:
            return False
        deadline = time.monotonic() + self.load_timeout_s
        pause = _POLL_FIRST_S
        while True:
            unlocks = self._unlocks[replica_id]  # counted before trying: news during the try is not missed
            try:
                if await self.store.acquire(self.pool, replica_id, holder, self.config.lock_ttl_s):
                    self._store_answered()
                    return True
            except StoreUnavailable as exc:
                self._store_failed(exc)
                return False
            if time.monotonic() >= deadline:
                log.warning("%s/%s: another gateway's load did not end in time", self.pool, replica_id)
                raise AdapterCacheFull(503, f"{self.pool}/{replica_id} is busy loading adapters")
            if self._unlocks[replica_id] == unlocks:
                await self._poll_pause(replica_id, pause, wanted)
                pause = min(pause * 2, _POLL_LAST_S)

    async def _poll_pause(self, replica_id: str, pause: float, wanted: str | None) -> None:
        """Wait ``pause`` before polling the store's lock again; return at once when another gateway's load said it
        let the lock go (its ``unlocked`` news); for a load (``wanted``: its adapter), raise ``_LoadedMeanwhile`` as
        soon as this gateway's view holds the adapter: another gateway's load brought it (its ``set`` news makes the
        view read the record, gateway/residency/signal.py). A second request of one gateway for an adapter joins the
        load its first began (``ensure``); across gateways, a request routed to where another gateway was loading its
        adapter queued for the lock behind every load there and found the adapter loaded once it got in (churn
        trace, 3 gateways: 12-17 requests a run, up to 1.26 s each). Polls alone took the lock 77-94 ms after its
        release on average; woken by the release, the next load begins once the last one's requests have started
        (``_settle``), not before their first step (docs/benchmarks.md, "Three gateways: the churn tail")."""
        view, wake_at, unlocks = self.views[replica_id], time.monotonic() + pause, self._unlocks[replica_id]
        while wanted is None or wanted not in view.resident:
            left = wake_at - time.monotonic()
            if left <= 0 or self._unlocks[replica_id] != unlocks:
                return
            news = self._news[replica_id]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(news.wait(), left)
        raise _LoadedMeanwhile

    async def _fresh_record(self, replica_id: str) -> ReplicaRecord:
        """The store's record merged into the local view (whose use times may be newer than the last flush)."""
        view = self.views[replica_id]
        if self.store_up:
            try:
                await self._read_record(replica_id)
            except StoreUnavailable as exc:
                self._store_failed(exc)
        return ReplicaRecord(dict(view.resident), frozenset(view.pinned))

    def _forget(self, replica_id: str, engine_name: str) -> None:
        """Drop the adapter from this gateway's view of the replica, and remember when (``_forgotten``)."""
        view = self.views[replica_id]
        view.resident.pop(engine_name, None)
        view.pinned.discard(engine_name)
        self._sets_changed()
        self._forgets += 1
        self._forgotten[replica_id][engine_name] = self._forgets

    async def _read_record(self, replica_id: str) -> ReplicaRecord:
        """Read the replica's record from the store, take it as this gateway's view (``_adopt``) and return it as
        the store answered."""
        before = self._forgets  # counted before the read: a forget while it is under way is not undone
        record = await self.store.record(self.pool, replica_id)
        if record.repaired:
            # A key of the record held another type (someone else's write) and the store deleted it: what it held
            # is lost, not gone from the engine. The view is kept; the next sync rebuilds the record from the
            # engine's listing. (The whole pool's store counted as down over such a key before.)
            self._repaired.add(replica_id)
            return record
        self._adopt(replica_id, record, before)
        return record

    def _adopt(self, replica_id: str, record: ReplicaRecord, read_after: int) -> None:
        """Take the store's record, read after this gateway's ``read_after``-th forget, as its view, keeping newer
        local use times, and leaving out adapters this gateway forgot since the read began: the store may have
        answered before their removal reached it (measured: bench-overhead's two workers, a request's reload after
        the engine's 404 skipped as the adapter was back in the view, and its second try answered 502)."""
        view, forgotten = self.views[replica_id], self._forgotten[replica_id]
        resident = {
            name: max(used, view.resident.get(name, 0.0))
            for name, used in record.resident.items()
            if forgotten.get(name, 0) <= read_after
        }
        latest = self._now() + FUTURE_MARK_S
        for name, used in resident.items():
            if used > latest:  # a mark from a clock that jumped (store.FUTURE_MARK_S): the record's, if sane, or now
                stored = record.resident[name]
                resident[name] = stored if stored <= latest else latest - FUTURE_MARK_S
        if view.resident.keys() != resident.keys():
            self._sets_changed()
        view.resident = resident
        view.pinned = {name for name in record.pinned if name in resident}

    # --- background work -----------------------------------------------------------------------------------------

    async def flush_uses(self) -> None:
        """Write use times behind in one batch; adapters with requests in flight are marked as used now."""
        now = self._now()
        uses = {(self.pool, r, name): used for (r, name), used in self._pending_uses.items()}
        for replica_id, view in self.views.items():
            uses.update({(self.pool, replica_id, name): now for name in view.in_flight})
        if not uses or not self.store_up:
            return
        self._pending_uses = {}
        await self._store_call(self.store.touch(uses))

    async def sync(self) -> None:
        """Refresh the local view from the store (other gateways' loads and evictions)."""
        was_up = self.store_up
        try:
            await self._learn_clock()
        except StoreUnavailable as exc:
            self._store_failed(exc)
            return
        for replica_id in self.endpoints:
            try:
                await self._read_record(replica_id)
                self._store_answered()
            except StoreUnavailable as exc:
                self._store_failed(exc)
                return
        if not was_up:
            await self.reconcile()  # the store may have restarted empty: rebuild it from the engines
        elif self._repaired:
            repaired, self._repaired = sorted(self._repaired), set()
            pins = {replica_id: set(self.views[replica_id].pinned) for replica_id in repaired}
            await self.reconcile(repaired)
            for replica_id in repaired:  # a repaired pinned set lost its pins: this view's put back
                view = self.views[replica_id]
                for name in sorted(pins[replica_id] & view.resident.keys()):
                    view.pinned.add(name)
                    await self._store_call(
                        self.store.add(self.pool, replica_id, name, view.resident[name], pinned=True)
                    )

    async def break_dead_locks(self) -> None:
        """At start-up: give back the replicas' store locks that this process's dead predecessor held (the same
        ``state.identity_dir`` identity, another incarnation: gateway/residency/owner.py says why no live gateway
        holds those). Its start-up reconciliation, and every gateway's loads there, waited ``residency.lock_ttl_s``
        for them (10 s by default; tests/gateway/test_gateway_restart.py)."""
        who = self._process_owner
        if not who.claimed or not self.store_up:
            return  # a random identity: no earlier process had it
        for replica_id in self.endpoints:
            try:
                if await self.store.break_lock(self.pool, replica_id, who.any_run, who.live):
                    log.warning("%s/%s: let go of the lock this gateway held before its restart", self.pool, replica_id)
            except StoreUnavailable as exc:
                self._store_failed(exc)
                return

    async def reconcile(self, replica_ids: Iterable[str] | None = None) -> None:
        """Make the record say what each engine lists; log every difference with its likely reason. Each replica
        under its lock, so a load or an eviction in progress is not undone by a listing taken before it ended."""
        for replica_id in replica_ids if replica_ids is not None else self.endpoints:
            try:
                async with self._locked(replica_id, "reconcile"):
                    await self._reconcile_one(replica_id)
            except (BackendError, GatewayError) as exc:
                log.debug("cannot reconcile %s/%s: %s", self.pool, replica_id, exc)

    async def _reconcile_one(self, replica_id: str) -> None:
        on_engine = await self.driver.list_adapters(self.endpoints[replica_id])
        if on_engine is None:
            return  # the engine does not say (TensorRT-LLM): the record is kept from what was sent and answered
        now = self._now()
        view = self.views[replica_id]
        before = ReplicaRecord(dict(view.resident), frozenset(view.pinned))
        if self.store_up:
            try:
                before = await self.store.reconcile(self.pool, replica_id, on_engine, now)
                self._store_answered()
            except StoreUnavailable as exc:
                self._store_failed(exc)
        gone = set(before.resident) - on_engine
        appeared = on_engine - set(before.resident)
        if gone:
            log.warning("%s/%s lost adapters %s (engine restarted?)", self.pool, replica_id, sorted(gone))
        if appeared:
            log.warning("%s/%s has adapters the record lacked %s", self.pool, replica_id, sorted(appeared))
        self.counters.reconcile_fixes += len(gone) + len(appeared)
        view.resident = {name: view.resident.get(name, before.resident.get(name, now)) for name in on_engine}
        self._sets_changed()
        view.pinned &= on_engine
        if gone or appeared:
            self.signal.set_changed(self.pool, replica_id)

    async def trim_over_bound(self, healthy: Callable[[str], bool]) -> None:
        """Bring a set that ran over ``max_adapters`` (vLLM: a load found every adapter in use) back under it as soon
        as an adapter no gateway has in flight is there to drop; a replica's lock only where its set is over. The
        engine's host cache dropped its least recently used idle adapter when the load went over: until the record
        forgets one, a request sent to the one the engine dropped pays a cold load that routing priced as a swap-in,
        and while every adapter the record holds gets requests, no load comes to bring the set back (measured, 3
        gateways on the hot trace: one such load, then 6 cold loads on the request path in 4.6 s on that replica)."""
        if not self.overcommit:
            return  # an engine that refuses loads into a full cache never has its set run over
        for replica_id, view in self.views.items():
            over = len(view.resident) > self.max_adapters
            # A replica out of service is left alone: its unload would fail at every flush (the timer's rule too).
            if (
                not over
                or not healthy(replica_id)
                or self._engine_victim(replica_id, view.resident, view.pinned) is None
            ):
                continue
            try:
                async with self._locked(replica_id, "trim") as record:
                    resident = dict(record.resident)
                    while len(resident) > self.max_adapters:
                        victim = self._engine_victim(replica_id, resident, record.pinned)
                        if victim is None:
                            break
                        await self._unload(replica_id, victim)
                        del resident[victim]
                        self.metrics.evictions.labels(self.pool, replica_id, "over_bound").inc()
            except (BackendError, GatewayError) as exc:
                log.warning("bringing %s/%s back within max_adapters failed: %s", self.pool, replica_id, exc)

    def _engine_victim(self, replica_id: str, resident: dict[str, float], pinned: Iterable[str]) -> str | None:
        """The adapter the engine's host cache drops first: the least recently used one no request has in flight
        (this gateway's, or another's as the slot signal last said; not listening, judged by the in-use window)."""
        flying = self.signal.flying_at(self.pool, replica_id) if self.in_use_window_s else frozenset()
        if flying is None:
            return self._victim(replica_id, resident, pinned)
        busy = set(pinned) | set(self.views[replica_id].in_flight) | flying
        idle = [(used, name) for name, used in resident.items() if name not in busy]
        return min(idle)[1] if idle else None

    async def evict_idle(self, healthy: Callable[[str], bool]) -> None:
        """The eviction timer. Where a slot is wanted (``slot_wanted``), or with ``fill_free_slots`` off: unload
        adapters idle past ``idle_evict_s``, then bring the replica down to max_adapters - headroom, so a newcomer
        seldom evicts on the request path. Elsewhere a freed slot would serve nobody and cost the adapter it held a
        cold load later: only adapters over max_adapters go, and idle ones that are not in the replica's plan."""
        for replica_id in self.endpoints:
            if not healthy(replica_id):
                continue
            wanted = not self.config.fill_free_slots or self.slot_wanted(replica_id)
            keep_at_most = max(0, self.max_adapters - (self.config.headroom if wanted else 0))
            try:
                async with self._locked(replica_id, "evict") as record:
                    resident = dict(record.resident)
                    kept = record.pinned if wanted else record.pinned | self.plan.get(replica_id, frozenset())
                    stale_before = self._now() - self.config.idle_evict_s
                    while True:
                        victim = self._victim(replica_id, resident, kept)
                        if victim is None and len(resident) > self.max_adapters:
                            victim = self._victim(replica_id, resident, record.pinned)  # over the bound: any idle
                        if victim is None or (resident[victim] >= stale_before and len(resident) <= keep_at_most):
                            break
                        await self._unload(replica_id, victim)
                        resident.pop(victim)
                        self.counters.evictions_scheduled += 1
                        self.metrics.evictions.labels(self.pool, replica_id, "scheduled").inc()
            except (BackendError, GatewayError) as exc:
                log.warning("eviction on %s/%s failed: %s", self.pool, replica_id, exc)

    def slot_wanted(self, replica_id: str) -> bool:
        """Whether another adapter wants a slot on the replica: loads wait for one now, or a load found its working
        set full within ``idle_evict_s`` (the horizon that calls an adapter idle calls a replica calm)."""
        if self.slot_waiters[replica_id]:
            return True
        wanted_at = self._slot_wanted_at.get(replica_id)
        return wanted_at is not None and self._now() - wanted_at <= self.config.idle_evict_s

    async def fill(self, replica_id: str, adapters: Sequence[AdapterRef]) -> list[str]:
        """Load ``adapters`` (most important first) into the replica's free slots, never evicting one: stop at the
        first that finds the working set full, or a load waiting for a slot (a request's load goes first). One
        lock per adapter, so a request's load on the replica waits for one fill load at most. A load that fails is
        logged and the next tried. With ``fill_warm_up``, each adapter loaded then gets a one-token request, the most
        important last: the engine's GPU slots (fewer than its host cache, and LRU) end up holding the most important
        ones, so a first request does not wait for its adapter's copy to the GPU. Returns the names loaded."""
        loaded: list[str] = []
        refs: list[AdapterRef] = []
        view = self.views[replica_id]
        for adapter in adapters:
            name = adapter.engine_name
            if name in view.resident:
                continue
            if len(view.resident) >= self.max_adapters or self.slot_waiters[replica_id]:
                break
            try:
                await self.driver.prepare_adapter(adapter)
                # A load that hangs is given up after warm_up_timeout_s (its lock let go): it held the rest of the
                # replica's fill, every other tenant's adapter behind it, up to adapter_load_timeout_s.
                async with asyncio.timeout(self.config.warm_up_timeout_s):
                    async with self._locked(replica_id, f"fill {name}") as record:
                        if name in record.resident:
                            continue
                        if len(record.resident) >= self.max_adapters or self.slot_waiters[replica_id]:
                            break
                        await self._load_locked(replica_id, adapter, False, record)
            except (BackendError, GatewayError, TimeoutError) as exc:
                log.error("filling %s/%s with %s failed: %r", self.pool, replica_id, name, exc)
                continue
            loaded.append(name)
            refs.append(adapter)
            self.counters.fill_loads += 1
            self.metrics.fill_loads.labels(self.pool).inc()
        for adapter in reversed(refs) if self.config.fill_warm_up else ():
            try:
                async with asyncio.timeout(self.config.warm_up_timeout_s):  # not the pool's request_timeout_s
                    await self._one_token(replica_id, adapter)
            except (BackendError, GatewayError, TimeoutError) as exc:  # loaded all the same: its first request pays
                log.warning("warming %s on %s/%s failed: %r", adapter.engine_name, self.pool, replica_id, exc)
        return loaded

    async def warm(self, replica_id: str, adapter: AdapterRef, *, pinned: bool, bounded: bool = True) -> None:
        """Load the adapter and run a one-token request through it, so its first real request finds it hot. Waited
        for at most ``warm_up_timeout_s`` (then ``EngineTimeout``): one adapter whose load hung held the pool's one
        warm-up ahead (Pool.warm_ahead), and the pre-warm of the replica's other adapters, for every other tenant up
        to ``adapter_load_timeout_s``. Its load is then cancelled (the replica's lock let go) unless a request waits
        for it too (``ensure``'s load is shared): that one goes on within ``adapter_load_timeout_s``. Not
        ``bounded``: an operator's warm-up (the admin API's, a rollout's), which someone waits for and a rollout
        judges its new version by, as a request's load: within ``adapter_load_timeout_s``."""
        bound = asyncio.timeout(self.config.warm_up_timeout_s if bounded else None)
        try:
            async with bound:
                await self.ensure(replica_id, adapter, pinned=pinned)
                await self._one_token(replica_id, adapter)
        except TimeoutError as exc:
            if not bound.expired():
                raise  # a TimeoutError of the driver's own, not this bound's: not named the warm-up's
            key = (replica_id, adapter.engine_name)
            task = self._load_task_of.get(key)
            if task is not None and key in self._loads and not self._load_waiters.get(key):
                # No request waits for it: the hung load lets the replica's lock go, or every other adapter's load
                # there (the pre-warm's next, another tenant's) waited for it up to adapter_load_timeout_s.
                task.cancel()
            raise WarmUpTimedOut(
                f"{self.pool}/{replica_id}: warming {adapter.engine_name} took over {self.config.warm_up_timeout_s:g} s"
            ) from exc

    async def _one_token(self, replica_id: str, adapter: AdapterRef) -> None:
        """A one-token request through the adapter: the engine moves it into a GPU slot (vLLM's --max-loras)."""
        body = json.dumps({"model": adapter.engine_name, "prompt": "warm-up", "max_tokens": 1}).encode()
        request = EngineRequest("/v1/completions", body, False, adapter=adapter)
        response = await self.driver.send(self.endpoints[replica_id], request)
        try:
            await response.read()
        except (OSError, ValueError) as exc:  # the answer broken off or garbled (the relay maps these for requests)
            raise EngineUnavailable(f"{replica_id}: the warm-up's answer could not be read: {exc!r}") from exc
        finally:
            response.release()

    async def unload_everywhere(self, engine_name: str) -> list[str]:
        """Unload an adapter from every replica that holds it (pins included); returns those replicas."""
        unloaded = []
        for replica_id in self.endpoints:
            async with self._locked(replica_id, f"unload {engine_name}") as record:
                if engine_name in record.resident or engine_name in self.views[replica_id].resident:
                    await self._unload(replica_id, engine_name)
                    unloaded.append(replica_id)
        return unloaded

    # --- the store's health -------------------------------------------------------------------------------------

    async def _store_call(self, call: Awaitable[object]) -> None:
        """A record write that may fail: the local view stays right, reconciliation repairs the store later."""
        if not self.store_up:
            if asyncio.iscoroutine(call):
                call.close()
            return
        try:
            await call
            self._store_answered()
        except StoreUnavailable as exc:
            self._store_failed(exc)

    def _store_failed(self, exc: StoreUnavailable) -> None:
        if self.store_up:
            log.error("residency store unreachable, routing from the local view: %s", exc)
        self.store_up = False

    def _store_answered(self) -> None:
        if not self.store_up:
            log.warning("residency store reachable again")
        self.store_up = True


async def every(interval_s: float, work: Callable[[], Awaitable[None]], what: str) -> None:
    """Run ``work`` every ``interval_s`` until cancelled; one failure is logged and does not end the loop."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await work()
        except Exception:
            log.exception("%s failed", what)
