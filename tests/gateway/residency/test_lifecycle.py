"""The adapter lifecycle against a fake engine (fakes.py), over both stores (in-process and a real redis-server)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection

import pytest

from backends.base import AdapterRef, Endpoint
from backends.errors import AdapterCacheFull
from gateway.config import ResidencyConfig
from gateway.failures import classify
from gateway.observe.metrics import GatewayMetrics
from gateway.residency.lifecycle import PoolResidency
from gateway.residency.memory import MemoryStore
from gateway.residency.signal import NO_SIGNAL, Signal
from gateway.residency.store import ReplicaRecord, ResidencyStore, StoreUnavailable, Uses
from tests.clock import Clock
from tests.gateway.residency.fakes import FakeDriver, FakeEngine, ref

REPLICAS = [Endpoint("r0", "http://r0"), Endpoint("r1", "http://r1")]
START = 1_000.0  # the fake wall clock's first reading, unix seconds


def in_service(replica_id: str) -> bool:
    """Every replica is healthy."""
    return True


def lifecycle(
    store: ResidencyStore,
    engine: FakeEngine,
    clock: Callable[[], float],
    *,
    max_adapters: int = 2,
    shared: bool = False,
    config: ResidencyConfig | None = None,
    overcommit: bool = False,
    signal: Signal = NO_SIGNAL,
    metrics: GatewayMetrics | None = None,
) -> PoolResidency:
    """A gateway's lifecycle; ``overcommit``: the engine queues requests for a full working set (vLLM), else it
    refuses them (TensorRT-LLM), as the lifecycle's older tests assume."""
    return PoolResidency(
        "llama",
        REPLICAS,
        FakeDriver(engine),
        store,
        config or ResidencyConfig(),
        max_adapters=max_adapters,
        load_timeout_s=30.0,
        shared=shared,
        overcommit=overcommit,
        wall_clock=clock,
        signal=signal,
        metrics=metrics,
    )


async def fill_with_adapters_in_use(life: PoolResidency, *names: str) -> None:
    """Load each adapter on r0 and mark it in use, as requests in flight do: r0's working set is full and busy."""
    for name in names:
        await life.ensure("r0", ref(name))
    for name in names:
        life.begin_use("r0", name)


async def until_a_load_waits(life: PoolResidency, replica: str = "r0") -> None:
    for _ in range(5_000):  # a bounded poll
        if life.slot_waiters[replica]:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"no load waits for a slot on {replica}")


async def test_a_full_working_set_evicts_the_least_recently_used_idle_adapter(store: ResidencyStore) -> None:
    engine, clock = FakeEngine(), Clock(START)
    life = lifecycle(store, engine, clock)
    await life.ensure("r0", ref("a"))
    clock.advance(1)
    await life.ensure("r0", ref("b"))
    clock.advance(1)
    life.begin_use("r0", "a")
    life.end_use("r0", "a")  # a was used after b: b is the least recently used
    clock.advance(1)
    await life.ensure("r0", ref("c"))
    assert engine.unloads == [("r0", "b")]
    assert engine.loaded["r0"] == {"a", "c"}
    assert set((await store.record("llama", "r0")).resident) == {"a", "c"}
    assert life.counters.evictions_on_request_path == 1


async def test_pinned_and_in_use_adapters_are_never_evicted(store: ResidencyStore) -> None:
    engine, clock = FakeEngine(), Clock(START)
    life = lifecycle(store, engine, clock)
    await life.ensure("r0", ref("pinned"), pinned=True)
    await life.ensure("r0", ref("busy"))
    life.begin_use("r0", "busy")
    newcomer = asyncio.create_task(life.ensure("r0", ref("newcomer")))  # waits for room, as an engine queues
    clock.advance(10_000)
    await life.evict_idle(lambda _: True)  # the timer evicts neither
    assert not newcomer.done()
    assert engine.unloads == [] and engine.loaded["r0"] == {"pinned", "busy"}
    life.end_use("r0", "busy")
    await asyncio.wait_for(newcomer, 5)  # once busy is idle it may go; the pinned one stays
    assert engine.unloads == [("r0", "busy")]
    assert engine.loaded["r0"] == {"pinned", "newcomer"}


async def test_a_working_set_of_pinned_adapters_refuses_another_at_once(store: ResidencyStore) -> None:
    engine, clock = FakeEngine(), Clock(START)
    life = lifecycle(store, engine, clock)
    await life.ensure("r0", ref("p1"), pinned=True)
    await life.ensure("r0", ref("p2"), pinned=True)
    with pytest.raises(AdapterCacheFull):
        await life.ensure("r0", ref("newcomer"))
    assert engine.unloads == []


async def test_the_timer_evicts_idle_adapters_and_keeps_headroom(store: ResidencyStore) -> None:
    engine, clock = FakeEngine(), Clock(START)
    life = lifecycle(store, engine, clock, max_adapters=4, config=ResidencyConfig(idle_evict_s=60, headroom=1))
    for name in ("old", "p", "x", "y"):
        await life.ensure("r0", ref(name), pinned=name == "p")
        clock.advance(10)
    clock.advance(35)  # old: idle 75 s; p (pinned) 65 s; x 55 s; y 45 s
    await life.evict_idle(lambda _: True)
    # old is past the idle limit; that leaves 3 = max_adapters - headroom, so x and y stay
    assert engine.unloads == [("r0", "old")]
    assert set((await store.record("llama", "r0")).resident) == {"p", "x", "y"}
    assert life.counters.evictions_scheduled == 1


async def test_headroom_brings_a_full_replica_down_by_lru_once_a_slot_is_wanted(store: ResidencyStore) -> None:
    engine, clock = FakeEngine(), Clock(START)
    life = lifecycle(store, engine, clock, max_adapters=3, config=ResidencyConfig(idle_evict_s=600, headroom=1))
    for name in ("a", "b", "c"):
        await life.ensure("r0", ref(name))
        clock.advance(1)
    await life.evict_idle(lambda _: True)
    assert engine.unloads == []  # full, but no other adapter wants a slot: a freed one would serve nobody
    await life.ensure("r0", ref("d"))  # one does: a (the LRU) goes on the request path
    clock.advance(1)
    await life.evict_idle(lambda _: True)
    assert engine.unloads == [("r0", "a"), ("r0", "b")]  # and now the timer keeps a slot free


async def test_without_fill_the_timer_keeps_headroom_whether_or_not_a_slot_is_wanted(store: ResidencyStore) -> None:
    engine, clock = FakeEngine(), Clock(START)
    config = ResidencyConfig(idle_evict_s=600, headroom=1, fill_free_slots=False)
    life = lifecycle(store, engine, clock, max_adapters=3, config=config)
    for name in ("a", "b", "c"):
        await life.ensure("r0", ref(name))
        clock.advance(1)
    await life.evict_idle(lambda _: True)
    assert engine.unloads == [("r0", "a")]


async def test_concurrent_requests_share_one_load(store: ResidencyStore) -> None:
    engine, clock = FakeEngine(), Clock(START)
    life = lifecycle(store, engine, clock)
    await asyncio.gather(*(life.ensure("r0", ref("a")) for _ in range(20)))
    assert engine.loads == {("r0", "a"): 1}
    assert life.resident_on("a") == frozenset({"r0"})


async def test_two_gateways_sharing_a_store_never_load_twice_nor_overfill(store: ResidencyStore) -> None:
    """Two lifecycles (two gateways) on one store and one engine, racing for the same replica. Real time: a
    freshly used adapter may be in use at the other gateway, so a load waits for it to leave the in-use window."""
    engine = FakeEngine()
    gateways = [lifecycle(store, engine, time.time, shared=True), lifecycle(store, engine, time.time, shared=True)]
    await asyncio.gather(*(gw.ensure("r0", ref("a")) for gw in gateways for _ in range(5)))
    assert engine.loads == {("r0", "a"): 1}
    await asyncio.gather(*(gw.ensure("r0", ref(name)) for gw in gateways for name in ("b", "c", "d")))
    assert engine.peak["r0"] <= 2
    assert engine.duplicate_loads == 0


async def test_reconcile_takes_the_engines_truth(store: ResidencyStore) -> None:
    engine, clock = FakeEngine(), Clock(START)
    life = lifecycle(store, engine, clock)
    await life.ensure("r0", ref("a"))
    await life.ensure("r0", ref("b"))
    engine.loaded["r0"] = {"a", "by-hand"}  # b was unloaded behind our back, by-hand loaded
    await life.reconcile()
    assert set((await store.record("llama", "r0")).resident) == {"a", "by-hand"}
    assert set(life.views["r0"].resident) == {"a", "by-hand"}
    assert life.counters.reconcile_fixes == 2


async def test_warm_loads_pins_and_sends_one_token(store: ResidencyStore) -> None:
    engine, clock = FakeEngine(), Clock(START)
    life = lifecycle(store, engine, clock)
    await life.warm("r1", ref("a"), pinned=True)
    assert engine.loaded["r1"] == {"a"}
    assert (await store.record("llama", "r1")).pinned == frozenset({"a"})
    [(replica, body)] = engine.warm_requests
    assert replica == "r1" and b'"max_tokens": 1' in body


async def test_unload_everywhere(store: ResidencyStore) -> None:
    engine, clock = FakeEngine(), Clock(START)
    life = lifecycle(store, engine, clock)
    await life.ensure("r0", ref("a"), pinned=True)
    await life.ensure("r1", ref("a"))
    assert await life.unload_everywhere("a") == ["r0", "r1"]
    assert engine.loaded == {"r0": set(), "r1": set()}
    assert (await store.record("llama", "r0")) == ReplicaRecord()


async def test_a_record_read_before_the_engine_lost_an_adapter_does_not_bring_it_back(store: ResidencyStore) -> None:
    """bench-overhead, `--workers 2`: worker A unloaded x from r0 (its trim) while worker B sent a request for it. B
    had begun reading r0's record (another change's news) before A's removal reached the store, and that answer
    came in after the engine's 404: B forgot x, the answer put it back, B's reload found x "resident" and loaded
    nothing, and the request's second try got the 404 again (502). A read that began before a forget must not undo
    it: B loads x again."""
    engine, clock = FakeEngine(), Clock(START)
    a, b = lifecycle(store, engine, clock, shared=True), lifecycle(store, engine, clock, shared=True)
    await a.ensure("r0", ref("x"))
    await b.sync()
    real_record = b.store.record
    answered, let_go = asyncio.Event(), asyncio.Event()

    async def answer_held(pool: str, replica: str) -> ReplicaRecord:
        """The store answers at once; the gateway reads the answer later (its event loop is busy)."""
        record = await real_record(pool, replica)
        answered.set()
        await let_go.wait()
        return record

    b.store.record = answer_held  # type: ignore[method-assign]
    b.remote_set_changed("r0")  # another gateway's news: B reads r0's record again
    reread = b._rereads["r0"]
    await answered.wait()
    b.store.record = real_record  # type: ignore[method-assign]
    await a.unload_everywhere("x")  # A's eviction: the engine, then the store, drop x
    await b.lost("r0", "x")  # B's request for x: the engine answered 404
    let_go.set()
    await reread
    assert not b.is_resident("r0", "x")
    await b.ensure("r0", ref("x"))  # the request's reload
    assert "x" in engine.loaded["r0"] and engine.loads[("r0", "x")] == 2


async def test_a_load_longer_than_the_lock_ttl_keeps_the_replicas_lock(store: ResidencyStore) -> None:
    """The ttl bounds what a killed holder costs (tests/gateway/test_gateway_restart.py), so a live holder renews it:
    a load that takes several ttls keeps the lock to the end, then gives it back."""
    engine = FakeEngine()
    life = lifecycle(store, engine, time.time, shared=True, config=ResidencyConfig(lock_ttl_s=1.2))
    loading, let_go = asyncio.Event(), asyncio.Event()

    async def hold(replica: Endpoint, adapter: AdapterRef) -> None:
        loading.set()
        await let_go.wait()

    driver = life.driver
    assert isinstance(driver, FakeDriver)
    driver.before_load = hold
    load = asyncio.create_task(life.ensure("r0", ref("a")))
    await asyncio.wait_for(loading.wait(), 10)
    holders = set()
    for _ in range(40):  # 4 s: over three ttls
        holders.add((await store.record("llama", "r0")).lock_holder)
        await asyncio.sleep(0.1)
    let_go.set()
    await load
    assert len(holders) == 1 and None not in holders, holders
    # The load's own task gives the lock back after the request awaiting it has its answer: a read right after
    # ``await load`` raced that release (failed 1 run in 3 at load 10-14). Bounded poll: the release comes.
    for _ in range(200):
        if (await store.record("llama", "r0")).lock_holder is None:
            break
        await asyncio.sleep(0.01)
    assert (await store.record("llama", "r0")).lock_holder is None


class FlakyStore:
    """A store that can be switched off, as Redis going away: every call then raises ``StoreUnavailable``."""

    def __init__(self, inner: ResidencyStore) -> None:
        self.inner = inner
        self.down = False
        self.calls_while_down = 0

    def _up(self) -> ResidencyStore:
        if self.down:
            self.calls_while_down += 1
            raise StoreUnavailable("switched off")
        return self.inner

    async def record(self, pool: str, replica: str) -> ReplicaRecord:
        return await self._up().record(pool, replica)

    async def acquire(self, pool: str, replica: str, holder: str, ttl_s: float) -> bool:
        return await self._up().acquire(pool, replica, holder, ttl_s)

    async def renew(self, pool: str, replica: str, holder: str, ttl_s: float) -> bool:
        return await self._up().renew(pool, replica, holder, ttl_s)

    async def release(self, pool: str, replica: str, holder: str) -> None:
        await self._up().release(pool, replica, holder)

    async def break_lock(self, pool: str, replica: str, owned_by: str, unless: str) -> bool:
        return await self._up().break_lock(pool, replica, owned_by, unless)

    async def add(self, pool: str, replica: str, adapter: str, used_at: float, *, pinned: bool = False) -> None:
        await self._up().add(pool, replica, adapter, used_at, pinned=pinned)

    async def remove(self, pool: str, replica: str, adapters: Collection[str]) -> None:
        await self._up().remove(pool, replica, adapters)

    async def touch(self, uses: Uses) -> None:
        await self._up().touch(uses)

    async def reconcile(self, pool: str, replica: str, on_engine: Collection[str], now: float) -> ReplicaRecord:
        return await self._up().reconcile(pool, replica, on_engine, now)

    async def clock(self) -> float | None:
        return await self._up().clock()

    async def ping(self) -> None:
        await self._up().ping()

    async def close(self) -> None:
        await self._up().close()


async def test_a_store_outage_loses_nothing_and_resyncs_from_the_engines(store: ResidencyStore) -> None:
    engine, clock = FakeEngine(), Clock(START)
    flaky = FlakyStore(store)
    life = lifecycle(flaky, engine, clock)
    await life.ensure("r0", ref("a"))
    flaky.down = True
    await life.ensure("r0", ref("b"))  # loads go on from the local view
    life.begin_use("r0", "a")
    life.end_use("r0", "a")
    await life.flush_uses()
    await life.sync()
    assert not life.store_up
    assert set(life.views["r0"].resident) == {"a", "b"}
    await store.reconcile("llama", "r0", [], now=0)  # as if Redis came back empty
    flaky.down = False
    await life.sync()
    assert life.store_up
    assert set((await store.record("llama", "r0")).resident) == {"a", "b"}


async def test_loads_ask_no_lock_of_a_store_known_to_be_down(store: ResidencyStore) -> None:
    """A Redis that accepts connections and never answers costs every call ``state.operation_timeout_s`` (0.5 s):
    while the store is known down (the sync, every ``residency.sync_interval_s``, asks again), loads and evictions
    take only this gateway's lock. Each asked the store's lock first, under the replica's own lock: loads onto one
    replica during such an outage paid 0.5 s each, one after another."""
    engine = FakeEngine()
    flaky = FlakyStore(store)
    life = lifecycle(flaky, engine, Clock(START), shared=True, max_adapters=8)
    await life.ensure("r0", ref("a"))
    flaky.down = True
    await life.sync()
    assert not life.store_up and flaky.calls_while_down == 1
    await asyncio.gather(*(life.ensure("r0", ref(name)) for name in ("b", "c", "d")))
    assert set(life.views["r0"].resident) == {"a", "b", "c", "d"}
    assert flaky.calls_while_down == 1  # the loads did not ask the store
    flaky.down = False
    await life.sync()
    assert life.store_up


async def test_preparing_an_adapter_does_not_hold_the_replicas_lock(store: ResidencyStore) -> None:
    """A slow preparation (reading a large adapter's weights) must not stall another adapter's load there."""
    engine = FakeEngine()
    life = lifecycle(store, engine, Clock(START))
    driver = life.driver
    assert isinstance(driver, FakeDriver)
    entered, release = asyncio.Event(), asyncio.Event()

    async def slow_prepare(adapter: AdapterRef) -> None:
        entered.set()
        await release.wait()

    driver.before_prepare = slow_prepare
    slow = asyncio.create_task(life.ensure("r0", ref("big")))
    await asyncio.wait_for(entered.wait(), timeout=5)  # the slow load waits in its preparation
    driver.before_prepare = None
    await asyncio.wait_for(life.ensure("r0", ref("small")), timeout=5)
    assert life.is_resident("r0", "small") and not slow.done()
    release.set()
    await slow
    assert life.is_resident("r0", "big")


@pytest.mark.parametrize("overcommit", [False, True], ids=["engine-refuses-when-full", "engine-queues-when-full"])
async def test_a_load_waiting_for_a_slot_does_not_hold_the_lock_the_slot_holders_need(
    store: ResidencyStore, overcommit: bool
) -> None:
    """Gateway A fills r0's two slots and waits to load a third; gateway B, which has not yet heard of A's loads,
    has a request in flight for one of them and must take the replica's lock to find it resident. While it waits,
    B's flushes keep marking that adapter in use, so a waiter holding the lock waits for itself (it used to, until
    the load timeout, then failed both). Real time: the in-use window is real seconds."""
    engine = FakeEngine()
    config = ResidencyConfig(use_flush_interval_s=0.05, slot_wait_timeout_s=10.0)
    a, b = (lifecycle(store, engine, time.time, shared=True, config=config, overcommit=overcommit) for _ in "ab")
    await a.ensure("r0", ref("t0"))
    await a.ensure("r0", ref("t1"))
    a.begin_use("r0", "t0")
    a.begin_use("r0", "t1")
    third = asyncio.create_task(a.ensure("r0", ref("t2")))
    await asyncio.sleep(0.1)  # let it find the set full and start waiting (a yield point, not a timing assertion)
    b.begin_use("r0", "t0")  # B's request for t0: B does not know t0 is resident yet
    stop = asyncio.Event()

    async def b_flushes() -> None:
        while not stop.is_set():
            await b.flush_uses()
            await asyncio.sleep(config.use_flush_interval_s)

    flusher = asyncio.create_task(b_flushes())
    try:
        await asyncio.wait_for(b.ensure("r0", ref("t0")), 5)  # found resident, not loaded again
        a.end_use("r0", "t0")
        a.end_use("r0", "t1")
        b.end_use("r0", "t0")  # B's request done: its mark ages out of the window
        await asyncio.wait_for(third, 8)
    finally:
        stop.set()
        await flusher
    assert engine.duplicate_loads == 0 and engine.loads[("r0", "t0")] == 1
    assert "t2" in engine.loaded["r0"]
    assert engine.peak["r0"] <= 2 or overcommit


async def test_an_engine_that_queues_for_slots_gets_its_adapter_over_a_full_pinned_set(
    store: ResidencyStore,
) -> None:
    engine, clock = FakeEngine(), Clock(START)
    life = lifecycle(store, engine, clock, overcommit=True)
    await life.ensure("r0", ref("p1"), pinned=True)
    await life.ensure("r0", ref("p2"), pinned=True)
    await life.ensure("r0", ref("newcomer"))  # vLLM would queue it for a slot, not refuse it: neither does the gateway
    assert engine.loaded["r0"] == {"p1", "p2", "newcomer"} and engine.unloads == []


async def test_a_slot_wait_ends_at_its_timeout_with_retry_after_when_the_engine_refuses(
    store: ResidencyStore,
) -> None:
    engine, clock = FakeEngine(), Clock(START)
    life = lifecycle(store, engine, clock, config=ResidencyConfig(slot_wait_timeout_s=0.2))
    await fill_with_adapters_in_use(life, "a", "b")
    with pytest.raises(AdapterCacheFull) as refused:
        await asyncio.wait_for(life.ensure("r0", ref("c")), 5)
    verdict = classify(refused.value)  # what dispatch makes of it: try another replica, else 503 Retry-After
    assert verdict.retryable and verdict.blame == "none" and verdict.error.headers == {"Retry-After": "1"}
    assert life.slot_waiters["r0"] == 0 and engine.loaded["r0"] == {"a", "b"}


async def test_a_full_slot_wait_queue_refuses_a_newcomer_at_once(store: ResidencyStore) -> None:
    engine, clock = FakeEngine(), Clock(START)
    life = lifecycle(store, engine, clock, config=ResidencyConfig(slot_wait_queue=1, slot_wait_timeout_s=30))
    await fill_with_adapters_in_use(life, "a", "b")
    waiting = asyncio.create_task(life.ensure("r0", ref("c")))
    await until_a_load_waits(life)
    assert life.slot_waiters["r0"] == 1
    with pytest.raises(AdapterCacheFull):
        await asyncio.wait_for(life.ensure("r0", ref("d")), 5)
    life.end_use("r0", "a")
    await asyncio.wait_for(waiting, 5)  # the one in the queue gets the slot a left
    assert engine.loaded["r0"] == {"b", "c"}


async def test_a_newcomer_does_not_overtake_a_load_waiting_for_a_slot(store: ResidencyStore) -> None:
    """Loads waiting for a slot on a replica are served in arrival order (one per adapter: a tenant's burst is one
    load), so a later load, however lucky its timing, never takes the slot an earlier one waits for."""
    engine, clock = FakeEngine(), Clock(START)
    life = lifecycle(store, engine, clock, config=ResidencyConfig(slot_wait_timeout_s=30))
    await fill_with_adapters_in_use(life, "a", "b")
    life.begin_use("r0", "first")  # as a lease does: marked in use when placed, before its load
    first = asyncio.create_task(life.ensure("r0", ref("first")))
    await until_a_load_waits(life)
    assert life.slot_waiters["r0"] == 1
    life.end_use("r0", "a")  # a slot frees, and in the same instant another load arrives
    life.begin_use("r0", "newcomer")
    newcomer = asyncio.create_task(life.ensure("r0", ref("newcomer")))
    await asyncio.wait_for(first, 5)
    assert engine.loaded["r0"] == {"b", "first"}
    assert not newcomer.done()  # it waits its turn: b and first are in use
    life.end_use("r0", "b")
    await asyncio.wait_for(newcomer, 5)
    assert engine.loaded["r0"] == {"first", "newcomer"}


async def test_a_load_brings_a_set_run_over_its_bound_back_under_it(store: ResidencyStore) -> None:
    """README, Working set: a set run over max_adapters (vLLM queues for slots, so loads went over while every slot
    was in use) comes back under it at the next load, least recently used first, as the engine's host cache does:
    a record holding more than the engine would name adapters the engine has dropped."""
    engine, clock = FakeEngine(), Clock(START)
    life = lifecycle(store, engine, clock, overcommit=True)
    for name in ("a", "b", "c", "d"):  # each in use from its load on: c and d load over max_adapters (2)
        await life.ensure("r0", ref(name))
        life.begin_use("r0", name)
    assert engine.unloads == [] and len(engine.loaded["r0"]) == 4
    for name in ("a", "b", "c", "d"):
        life.end_use("r0", name)
    life.begin_use("r0", "d")  # still in use: never a victim
    clock.advance(1)
    await life.ensure("r0", ref("e"))
    assert engine.unloads == [("r0", "a"), ("r0", "b"), ("r0", "c")] and life.counters.evictions_on_request_path == 3
    assert engine.loaded["r0"] == {"d", "e"}
    assert set((await store.record("llama", "r0")).resident) == {"d", "e"}


async def test_a_set_run_over_its_bound_comes_back_once_an_adapter_is_idle_without_waiting_for_a_load(
    store: ResidencyStore,
) -> None:
    """README, Working set: the engine's host cache dropped an adapter when the load went over max_adapters; the
    record forgets one (the least recently used idle adapter, as the engine's cache would drop) at the next
    ``trim_over_bound`` (every use flush) once one is idle, rather than at the next load there, which may not come
    while every adapter the record holds gets requests (each of them then a cold load the engine pays)."""
    engine, clock = FakeEngine(), Clock(START)
    life = lifecycle(store, engine, clock, overcommit=True)
    for name in ("a", "b", "c"):  # each in use from its load on: c loads over max_adapters (2)
        await life.ensure("r0", ref(name))
        life.begin_use("r0", name)
    await life.trim_over_bound(in_service)
    assert engine.unloads == [] and len(engine.loaded["r0"]) == 3  # every one in flight: none to drop yet
    clock.advance(1)
    life.end_use("r0", "b")
    clock.advance(1)
    life.end_use("r0", "a")
    await life.trim_over_bound(lambda replica: replica != "r0")  # out of service: its unload would only fail
    assert engine.unloads == []
    await life.trim_over_bound(in_service)
    assert engine.unloads == [("r0", "b")] and engine.loaded["r0"] == {"a", "c"}
    assert set((await store.record("llama", "r0")).resident) == {"a", "c"}
    trigger = {"pool": "llama", "replica": "r0", "trigger": "over_bound"}
    assert life.metrics.registry.get_sample_value("tenantgate_adapter_evictions_total", trigger) == 1
    await life.trim_over_bound(in_service)  # within the bound: nothing more goes
    assert engine.unloads == [("r0", "b")]


async def test_a_set_within_its_bound_or_on_an_engine_that_refuses_is_never_trimmed(store: ResidencyStore) -> None:
    engine, clock = FakeEngine(), Clock(START)
    vllm, trt = lifecycle(store, engine, clock, overcommit=True), lifecycle(store, engine, clock)
    await vllm.ensure("r0", ref("a"))
    await vllm.ensure("r0", ref("b"))
    clock.advance(100)
    for life in (vllm, trt):
        await life.trim_over_bound(in_service)
    assert engine.unloads == [] and engine.loaded["r0"] == {"a", "b"}


async def test_a_load_polls_another_gateways_lock_from_10_ms_doubling_to_200_ms() -> None:
    """docs/architecture.md (Slot waits across gateways): a load waiting for the replica's lock that another gateway
    holds polls the store 10 ms after its first try, then twice as far apart, up to 0.2 s between polls."""
    store = MemoryStore()
    life = lifecycle(store, FakeEngine(), Clock(START), shared=True)
    assert await store.acquire("llama", "r0", "other-gateway a", 30.0)
    pauses: list[float] = []

    async def pause(replica_id: str, seconds: float, wanted: str | None) -> None:
        pauses.append(seconds)
        if len(pauses) == 8:  # the other gateway lets go
            await store.release("llama", "r0", "other-gateway a")

    life._poll_pause = pause  # type: ignore[method-assign,assignment]
    try:
        await life.ensure("r0", ref("b"))
    finally:
        await store.close()
    assert pauses == pytest.approx([0.01, 0.02, 0.04, 0.08, 0.16, 0.2, 0.2, 0.2])
    assert life.is_resident("r0", "b")
