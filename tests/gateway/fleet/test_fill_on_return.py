"""The fill's timing with a fake engine: a replica back from down (it has lost its adapters) is filled before it
takes traffic again, and readiness at start-up waits for the fill at most ``residency.fill_wait_s``. The
simulator's end-to-end test is tests/gateway/residency/test_no_empty_slot.py."""

from __future__ import annotations

import asyncio

from backends.base import AdapterRef, Endpoint
from gateway.config import GatewayConfig, PoolConfig, ResidencyConfig, RoutingConfig
from gateway.fleet.fleet import Fleet
from gateway.fleet.pool import Pool
from gateway.residency.lifecycle import PoolResidency
from gateway.residency.memory import MemoryStore
from gateway.tenants.identity import hash_key
from tests.gateway.residency.fakes import FakeDriver, FakeEngine, ref


def pool_of_two(engine: FakeEngine, fill_wait_s: float = 30.0) -> tuple[Pool, FakeDriver]:
    replicas = [{"id": f"r{i}", "url": f"http://127.0.0.1:{1000 + i}"} for i in range(2)]
    config = PoolConfig.model_validate(
        {
            "name": "llama",
            "backend": "vllm",
            "base_model": "m",
            "replicas": replicas,
            "health": {"unhealthy_after": 1, "healthy_after": 1},
        }
    )
    driver = FakeDriver(engine)
    residency = PoolResidency(
        "llama",
        [Endpoint(r["id"], r["url"]) for r in replicas],
        driver,
        MemoryStore(),
        ResidencyConfig(fill_wait_s=fill_wait_s),
        max_adapters=2,
        load_timeout_s=5,
        shared=False,
    )
    pool = Pool(config, RoutingConfig(), driver, residency)
    pool.fill = {"r0": [ref("a"), ref("b"), ref("c")], "r1": []}
    return pool, driver


async def until_healthy(pool: Pool, replica_id: str) -> None:
    for _ in range(5_000):  # bounded poll: the welcome runs as a task
        if pool.replicas[replica_id].healthy:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"{replica_id} never came back into service")


async def test_a_returning_replica_is_filled_before_it_takes_traffic() -> None:
    engine = FakeEngine()
    pool, driver = pool_of_two(engine)
    await pool.probe()
    assert pool.replicas["r0"].healthy
    engine.down.add("r0")
    await pool.probe()
    assert not pool.replicas["r0"].healthy
    engine.loaded["r0"].clear()  # it restarted: its adapters are gone
    in_service_during_loads: list[bool] = []

    async def note(replica: Endpoint, adapter: AdapterRef) -> None:
        in_service_during_loads.append(pool.replicas[replica.id].healthy)

    driver.before_load = note
    engine.down.clear()
    await pool.probe()  # up again: reconciled, filled, then back in service
    await until_healthy(pool, "r0")
    assert engine.loaded["r0"] == {"a", "b"}  # two slots: the plan's first two, nothing evicted for c
    assert in_service_during_loads == [False, False]
    assert pool.residency.counters.fill_loads == 2


async def test_a_fill_longer_than_the_wait_goes_on_with_the_replica_in_service() -> None:
    engine = FakeEngine()
    pool, driver = pool_of_two(engine, fill_wait_s=0.0)
    await pool.probe()
    engine.down.add("r0")
    await pool.probe()
    release = asyncio.Event()

    async def held(replica: Endpoint, adapter: AdapterRef) -> None:
        await release.wait()

    driver.before_load = held
    engine.down.clear()
    await pool.probe()
    await until_healthy(pool, "r0")  # in service although its fill has not loaded anything yet
    assert engine.loaded["r0"] == set()
    release.set()
    for _ in range(5_000):
        if engine.loaded["r0"] == {"a", "b"}:
            break
        await asyncio.sleep(0.001)
    assert engine.loaded["r0"] == {"a", "b"}


async def test_readiness_waits_for_the_fill_at_most_fill_wait_s_and_the_fill_goes_on() -> None:
    """At start-up the gateway turns ready once the fill is done or ``fill_wait_s`` has passed; then the fill goes
    on in the background."""
    replicas = [{"id": "r0", "url": "http://127.0.0.1:1000"}]
    config = GatewayConfig.model_validate(
        {
            "residency": {"fill_wait_s": 0},
            "pools": [{"name": "llama", "backend": "vllm", "base_model": "m", "replicas": replicas}],
            "adapters": [{"name": n, "pool": "llama", "source": f"/loras/{n}"} for n in ("a", "b")],
            "tenants": [{"id": "acme", "api_keys": [hash_key("acme")], "adapters": ["a", "b"]}],
        }
    )
    fleet = Fleet(config)
    engine = FakeEngine()
    driver = FakeDriver(engine)
    pool = fleet.pools["llama"]
    pool.driver = pool.residency.driver = driver
    release = asyncio.Event()

    async def held(replica: Endpoint, adapter: AdapterRef) -> None:
        await release.wait()

    driver.before_load = held
    try:
        await fleet.start()
        await asyncio.wait_for(fleet.started_up(), 5)
        assert fleet.warmed and engine.loaded["r0"] == set()  # ready before its fill loaded anything
        release.set()
        for _ in range(5_000):
            if engine.loaded["r0"] == {"a", "b"}:
                break
            await asyncio.sleep(0.001)
        assert engine.loaded["r0"] == {"a", "b"}
    finally:
        await fleet.close()
