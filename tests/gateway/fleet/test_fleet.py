"""A pool's health transitions: a replica back from down is reset and re-warmed before it takes traffic."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from backends.base import AdapterRef, Endpoint
from gateway.config import GatewayConfig, PoolConfig, ResidencyConfig, RoutingConfig
from gateway.fleet.fleet import Fleet
from gateway.fleet.pool import Pool
from gateway.residency.lifecycle import PoolResidency
from gateway.residency.memory import MemoryStore
from gateway.tenants.identity import hash_key
from tests.gateway.residency.fakes import FakeDriver, FakeEngine, ref


def make_pool(engine: FakeEngine) -> Pool:
    config = PoolConfig.model_validate(
        {
            "name": "llama",
            "backend": "vllm",
            "base_model": "tiny-llama",
            "replicas": [{"id": "r0", "url": "http://127.0.0.1:1"}, {"id": "r1", "url": "http://127.0.0.1:2"}],
        }
    )
    endpoints = [Endpoint("r0", "http://127.0.0.1:1"), Endpoint("r1", "http://127.0.0.1:2")]
    driver = FakeDriver(engine)
    residency = PoolResidency(
        "llama", endpoints, driver, MemoryStore(), ResidencyConfig(), max_adapters=2, load_timeout_s=5, shared=False
    )
    return Pool(config, RoutingConfig(), driver, residency)


async def test_a_replica_back_from_down_is_rewarmed_before_it_takes_traffic() -> None:
    engine = FakeEngine()
    pool = make_pool(engine)
    await pool.probe()  # the start-up probe
    pool.prewarm["r0"].append((ref("pinned"), True))
    await pool.warm_replica("r0")
    await pool.residency.ensure("r0", ref("other"))

    engine.down.add("r0")
    await pool.probe()
    assert pool.replicas["r0"].healthy  # one failed probe is not enough (unhealthy_after: 2)
    await pool.probe()
    assert not pool.replicas["r0"].healthy
    assert pool.place("anyone", None).chosen == "r1"

    engine.loaded["r0"].clear()  # it restarted: its adapters are gone
    engine.down.discard("r0")
    gate = asyncio.Event()

    async def held_load(replica: Endpoint, adapter: AdapterRef) -> None:
        await gate.wait()

    assert isinstance(pool.driver, FakeDriver)
    pool.driver.before_load = held_load
    await pool.probe()
    await pool.probe()  # healthy_after: 2
    assert pool.replicas["r0"].health.returning
    assert not pool.replicas["r0"].healthy  # up, but not taking traffic while it is re-warmed
    gate.set()
    for _ in range(200):  # bounded wait for the re-warm task
        if pool.replicas["r0"].healthy:
            break
        await asyncio.sleep(0.01)
    assert pool.replicas["r0"].healthy
    assert engine.loaded["r0"] == {"pinned"}
    view = pool.residency.views["r0"]
    assert set(view.resident) == {"pinned"} and view.pinned == {"pinned"}  # the record was reset, then re-warmed
    assert [replica for replica, _ in engine.warm_requests] == ["r0", "r0"]


async def test_a_lease_holds_its_place_until_it_ends_whatever_happens() -> None:
    pool = make_pool(FakeEngine())
    await pool.probe()
    adapter = ref("a")
    with pool.lease("acme", adapter) as lease:
        replica = lease.replica_id
        assert (pool.in_flight, pool.replicas[replica].in_flight) == (1, 1)
        assert pool.residency.views[replica].in_flight == {"a": 1}  # eviction leaves it alone
        idle = asyncio.ensure_future(pool.wait_idle())
        await asyncio.sleep(0)
        assert not idle.done()  # a retired pool waits for this lease before it closes
    assert (pool.in_flight, pool.replicas[replica].in_flight, pool.residency.views[replica].in_flight) == (0, 0, {})
    await asyncio.wait_for(idle, 1)
    await asyncio.wait_for(pool.wait_idle(), 1)  # idle already: returns at once

    try:
        with pool.lease("acme", adapter):
            raise RuntimeError("the request failed")
    except RuntimeError:
        pass
    assert (pool.in_flight, pool.residency.views[replica].in_flight) == (0, {})


async def test_a_lease_with_nowhere_to_go_holds_nothing_and_says_why() -> None:
    pool = make_pool(FakeEngine())
    await pool.probe()
    with pool.lease("acme", None, avoid=("r0", "r1")) as lease:
        assert (lease.replica, lease.decision.unavailable, lease.decision.reasons) == (
            None,
            "down",
            ["no_healthy_replica"],
        )
    assert pool.in_flight == 0


async def test_the_use_flush_and_the_over_bound_trim_share_one_timer_and_a_failed_flush_skips_no_trim() -> None:
    """Both run every ``residency.use_flush_interval_s``: one timer wakes for the two (in every worker under serve
    --workers), the flush first; a flush that fails is logged and the trim still runs."""
    replicas = [{"id": "r0", "url": "http://127.0.0.1:1000"}]
    config = GatewayConfig.model_validate(
        {
            "pools": [{"name": "llama", "backend": "vllm", "base_model": "m", "replicas": replicas}],
            "adapters": [{"name": "a", "pool": "llama", "source": "/loras/a"}],
            "tenants": [{"id": "acme", "api_keys": [hash_key("acme")], "adapters": ["a"]}],
        }
    )
    fleet = Fleet(config)
    pool = fleet.pools["llama"]
    pool.driver = pool.residency.driver = FakeDriver(FakeEngine())
    ran: list[str] = []

    async def flush() -> None:
        ran.append("flush")
        raise RuntimeError("store away")

    async def trim(healthy: Callable[[str], bool]) -> None:
        ran.append("trim")

    pool.residency.flush_uses = flush  # type: ignore[method-assign]
    pool.residency.trim_over_bound = trim  # type: ignore[method-assign]
    try:
        await fleet.start()
        names = [task.get_name() for task in fleet._tasks]
        assert "use flush and over-bound trim llama" in names
        assert not any(name.startswith(("use flush llama", "over-bound trim")) for name in names)
        await Fleet._flush_and_trim(pool)
        assert ran[-2:] == ["flush", "trim"]
    finally:
        pool.residency.flush_uses = lambda: asyncio.sleep(0)  # type: ignore[method-assign]
        await fleet.close()
