"""No empty slot, in the lifecycle: the fill loads planned adapters into free slots and never evicts; the timer
keeps a replica full while no other adapter wants a slot there (fake engine, both stores)."""

from __future__ import annotations

import asyncio
import json

import pytest

from backends.base import AdapterRef, Endpoint
from backends.errors import AdapterLoadFailed, EngineTimeout
from gateway.config import ResidencyConfig
from gateway.residency.lifecycle import PoolResidency, WarmUpTimedOut
from gateway.residency.store import ResidencyStore
from tests.clock import Clock
from tests.gateway.residency.fakes import FakeDriver, FakeEngine, ref

REPLICAS = [Endpoint("r0", "http://r0"), Endpoint("r1", "http://r1")]
START = 1_000.0


def lifecycle(store: ResidencyStore, engine: FakeEngine, clock: Clock, config: ResidencyConfig) -> PoolResidency:
    return PoolResidency(
        "llama", REPLICAS, FakeDriver(engine), store, config, max_adapters=3, load_timeout_s=30.0, shared=False,
        wall_clock=clock,
    )  # fmt: skip


async def test_the_fill_takes_free_slots_in_plan_order_and_never_evicts(store: ResidencyStore) -> None:
    engine, clock = FakeEngine(), Clock(START)
    life = lifecycle(store, engine, clock, ResidencyConfig())
    await life.ensure("r0", ref("x"))  # a request's adapter holds one of the three slots
    loaded = await life.fill("r0", [ref("a"), ref("x"), ref("b"), ref("c")])
    assert loaded == ["a", "b"]  # x was there; c finds the set full
    # fill_warm_up is on by default: the adapters the fill loaded (not x) get one token, the most important last.
    assert [json.loads(body)["model"] for _, body in engine.warm_requests] == ["b", "a"]
    assert engine.loaded["r0"] == {"x", "a", "b"} and engine.unloads == []
    assert set((await store.record("llama", "r0")).resident) == {"x", "a", "b"}
    assert life.counters.fill_loads == 2 and life.resident_on("a") == frozenset({"r0"})
    assert await life.fill("r0", [ref("c")]) == []  # full: nothing more, nothing evicted
    assert engine.unloads == []


async def test_with_warm_up_each_loaded_adapter_gets_one_token_the_most_important_last(store: ResidencyStore) -> None:
    engine, clock = FakeEngine(), Clock(START)
    life = lifecycle(store, engine, clock, ResidencyConfig(fill_warm_up=True))
    assert await life.fill("r0", [ref("a"), ref("b"), ref("c"), ref("d")]) == ["a", "b", "c"]
    # The engine's GPU slots are LRU: the last warmed (a, the most important) is the last to leave them.
    assert [json.loads(body)["model"] for _, body in engine.warm_requests] == ["c", "b", "a"]


async def test_a_warm_up_whose_answer_breaks_off_leaves_the_others_warmed(store: ResidencyStore) -> None:
    engine, clock = FakeEngine(), Clock(START)
    life = lifecycle(store, engine, clock, ResidencyConfig())
    driver = life.driver
    assert isinstance(driver, FakeDriver)
    driver.answer_errors = {"b": ConnectionResetError("the engine closed mid-answer"), "c": ValueError("garbled")}
    assert await life.fill("r0", [ref("a"), ref("b"), ref("c")]) == ["a", "b", "c"]  # loaded all the same
    assert [json.loads(body)["model"] for _, body in engine.warm_requests] == ["c", "b", "a"]


async def test_without_warm_up_the_fill_only_loads(store: ResidencyStore) -> None:
    engine, clock = FakeEngine(), Clock(START)
    life = lifecycle(store, engine, clock, ResidencyConfig(fill_warm_up=False))
    assert await life.fill("r0", [ref("a"), ref("b")]) == ["a", "b"]
    assert engine.warm_requests == []


async def test_a_failing_fill_load_is_skipped_and_the_next_loaded(store: ResidencyStore) -> None:
    engine, clock = FakeEngine(), Clock(START)
    life = lifecycle(store, engine, clock, ResidencyConfig())
    driver = life.driver
    assert isinstance(driver, FakeDriver)

    async def refuse_broken(replica: Endpoint, adapter: AdapterRef) -> None:
        if adapter.engine_name == "broken":
            raise AdapterLoadFailed("broken", 404, "no adapter found")

    driver.before_load = refuse_broken
    assert await life.fill("r0", [ref("broken"), ref("a")]) == ["a"]
    assert engine.loaded["r0"] == {"a"}


async def test_a_fill_or_pre_warm_load_that_hangs_is_given_up_and_the_next_tenant_s_adapter_loaded(
    store: ResidencyStore,
) -> None:
    """A replica hangs tenant a's load (its engine never answers; the driver's own bound is adapter_load_timeout_s,
    60 s). The fill, one adapter after another under the replica's lock, and the pre-warm (PoolResidency.warm) held
    every other tenant's adapter there behind it for that long; now each gives a up after
    residency.warm_up_timeout_s (the load cancelled, the lock let go) and loads b. No timing assertion: the hung
    load never ends on its own, so before, the fill and the warm-up never returned (the outer bound failed)."""
    engine, clock = FakeEngine(), Clock(START)
    life = lifecycle(store, engine, clock, ResidencyConfig(warm_up_timeout_s=0.5))
    driver = life.driver
    assert isinstance(driver, FakeDriver)
    hang = asyncio.Event()

    async def hangs_a(replica: Endpoint, adapter: AdapterRef) -> None:
        if adapter.engine_name == "a":
            await hang.wait()

    driver.before_load = hangs_a
    try:
        assert await asyncio.wait_for(life.fill("r0", [ref("a"), ref("b")]), 10) == ["b"]
        with pytest.raises(EngineTimeout):
            await asyncio.wait_for(life.warm("r1", ref("a"), pinned=False), 10)
        await asyncio.wait_for(life.warm("r1", ref("c"), pinned=False), 10)
    finally:
        hang.set()
    assert engine.loaded == {"r0": {"b"}, "r1": {"c"}} and life.loading == []


async def test_the_timer_keeps_planned_idle_adapters_until_another_wants_the_slot(store: ResidencyStore) -> None:
    engine, clock = FakeEngine(), Clock(START)
    life = lifecycle(store, engine, clock, ResidencyConfig(idle_evict_s=60, headroom=1))
    life.plan = {"r0": frozenset({"a", "b"})}
    await life.fill("r0", [ref("a"), ref("b")])
    await life.ensure("r0", ref("spilled"))  # a spill's adapter: not in r0's plan
    clock.advance(120)  # every adapter idle past idle_evict_s
    await life.evict_idle(lambda _: True)
    # Nothing wants a slot: the planned adapters stay (no headroom either); the spill's idle adapter goes.
    assert engine.unloads == [("r0", "spilled")]
    assert engine.loaded["r0"] == {"a", "b"}
    await life.ensure("r0", ref("c"))
    await life.ensure("r0", ref("d"))  # the set is full: d wants a slot, and takes a's (the LRU) on its path
    assert engine.unloads[-1] == ("r0", "a")
    clock.advance(30)
    await life.evict_idle(lambda _: True)  # a slot is wanted now: idle adapters go, planned or not, and headroom
    assert engine.unloads[-1] == ("r0", "b") and engine.loaded["r0"] == {"c", "d"}


async def test_the_timer_brings_an_overfull_replica_down_to_max_adapters_even_through_its_plan(
    store: ResidencyStore,
) -> None:
    engine, clock = FakeEngine(), Clock(START)
    life = lifecycle(store, engine, clock, ResidencyConfig(idle_evict_s=600, headroom=1))
    life.plan = {"r0": frozenset({"a", "b", "c", "d"})}
    for name in ("a", "b", "c", "d"):  # four on three slots, as a load over the bound leaves it (vLLM)
        await store.add("llama", "r0", name, START)
        engine.loaded["r0"].add(name)
    await life.sync()
    await life.evict_idle(lambda _: True)
    assert len(engine.loaded["r0"]) == 3 and len(engine.unloads) == 1


async def test_the_fill_yields_to_a_load_waiting_for_a_slot(store: ResidencyStore) -> None:
    engine, clock = FakeEngine(), Clock(START)
    life = lifecycle(store, engine, clock, ResidencyConfig())
    life.slot_waiters["r0"] = 1  # a request's load waits for a slot there: it goes first
    assert await life.fill("r0", [ref("a")]) == []
    assert engine.loaded["r0"] == set()
    life.slot_waiters["r0"] = 0
    assert await life.fill("r0", [ref("a")]) == ["a"]


async def test_a_drivers_own_timeout_error_is_not_named_the_warm_ups_bound(store: ResidencyStore) -> None:
    """Only the warm-up's own bound running out is WarmUpTimedOut ("took over warm_up_timeout_s"); a TimeoutError a
    driver lets through while the bound has time left goes on as it is, not relabelled (review of 6e11744)."""
    engine, clock = FakeEngine(), Clock(START)
    life = lifecycle(store, engine, clock, ResidencyConfig(warm_up_timeout_s=60))
    driver = life.driver
    assert isinstance(driver, FakeDriver)

    async def times_out(replica: Endpoint, adapter: AdapterRef) -> None:
        raise TimeoutError("the driver's own")

    driver.before_load = times_out
    with pytest.raises(TimeoutError) as raised:
        await asyncio.wait_for(life.warm("r0", ref("a"), pinned=False), 10)
    assert not isinstance(raised.value, WarmUpTimedOut), raised.value
