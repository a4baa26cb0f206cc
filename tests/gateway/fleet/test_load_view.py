"""The fleet-wide load view (routing.load_view: engine): the engine's own queue, which counts every gateway's
requests, plus this gateway's change since the scrape; this gateway's own count when the scrape is stale."""

from __future__ import annotations

import asyncio
import math
from typing import Literal

import pytest

import gateway.fleet.pool as pool_module
from backends.base import Endpoint, EngineLoad
from gateway.config import HealthConfig, OutlierConfig, PoolConfig, ResidencyConfig, RoutingConfig
from gateway.fleet.health import ReplicaHealth
from gateway.fleet.pool import Pool
from gateway.fleet.replica import Replica
from gateway.residency.lifecycle import PoolResidency
from gateway.residency.memory import MemoryStore
from tests.gateway.residency.fakes import FakeDriver, FakeEngine


def replica(in_flight: int, running: float, waiting: float, scraped_at: float, at_scrape: int) -> Replica:
    health = ReplicaHealth(HealthConfig(), OutlierConfig(), slow_start_s=0)
    return Replica(
        Endpoint("r0", "http://r0"), health, in_flight, EngineLoad(running, waiting, 0.0), scraped_at, at_scrape
    )


@pytest.mark.parametrize(
    ("in_flight", "running", "waiting", "age_s", "at_scrape", "view"),
    [
        # 12 at the engine when scraped, 2 of them ours; we sent one more since: 13
        pytest.param(3, 8, 4, 0.1, 2, 13, id="engine-queue-plus-our-change"),
        # two of ours finished since the scrape: the engine's count drops by two
        pytest.param(0, 8, 4, 0.1, 2, 10, id="our-finished-requests-leave-it"),
        # four of ours had not reached the engine when it answered
        pytest.param(5, 1, 0, 0.1, 4, 5, id="never-below-our-own-count"),
        pytest.param(3, 8, 4, 9.0, 2, 3, id="stale-scrape-own-count"),
    ],
)
def test_the_load_view(in_flight: int, running: float, waiting: float, age_s: float, at_scrape: int, view: int) -> None:
    assert replica(in_flight, running, waiting, 100.0 - age_s, at_scrape).load_view(100.0, max_age_s=1.5) == view


def test_no_scrape_yet_is_our_own_count() -> None:
    lone = Replica(Endpoint("r0", "http://r0"), ReplicaHealth(HealthConfig(), OutlierConfig(), 0), in_flight=4)
    assert lone.engine_load is None and lone.scraped_at == -math.inf
    assert lone.load_view(100.0, max_age_s=1.5) == 4


async def pool_seeing(load_view: Literal["gateway", "engine"], engine_load: EngineLoad) -> Pool:
    replicas = [{"id": f"r{i}", "url": f"http://127.0.0.1:{1000 + i}"} for i in range(3)]
    config = PoolConfig.model_validate({"name": "llama", "backend": "vllm", "base_model": "m", "replicas": replicas})
    endpoints = [Endpoint(r["id"], r["url"]) for r in replicas]
    driver = FakeDriver(FakeEngine(), load=engine_load)
    residency = PoolResidency(
        "llama", endpoints, driver, MemoryStore(), ResidencyConfig(), max_adapters=2, load_timeout_s=5, shared=False
    )
    routing = RoutingConfig(load_view=load_view, capacity_floor=2, home_reservation_s=0)
    pool = Pool(config, routing, driver, residency)
    await pool.probe()
    await pool.scrape_engines()
    return pool


async def test_other_gateways_queue_at_the_home_pushes_a_request_off_it_only_with_the_engine_view() -> None:
    """Every replica's engine reports 6 requests (other gateways' traffic); this gateway has none in flight. With
    its own view the home looks idle; with the engine's, the home carries 6 and the bound (floor 2, mean 6.3 x 1.25
    -> 8) still takes it, until the home alone is loaded: then the request leaves it."""
    busy = EngineLoad(running=4, waiting=2, kv_cache_usage=0.5)
    own_view = await pool_seeing("gateway", busy)
    engine_view = await pool_seeing("engine", busy)
    # The loads each candidate was weighed at (explain: a request's own plain decision keeps only its pick's).
    assert own_view.explain("acme", None).loads == dict.fromkeys(own_view.ring.head("acme", 3), 0)
    assert engine_view.explain("acme", None).loads == dict.fromkeys(engine_view.ring.head("acme", 3), 6)
    with engine_view.lease("acme", None) as lease:
        assert lease.decision.chosen == engine_view.ring.home("acme")
    home = engine_view.ring.home("acme")
    engine_view.replicas[home].engine_load = EngineLoad(running=20, waiting=10, kv_cache_usage=0.9)
    with engine_view.lease("acme", None) as lease:
        assert lease.decision.chosen != home and lease.decision.excluded[home] == "over_capacity"
    with own_view.lease("acme", None) as lease:  # blind to the other gateways: it piles onto the busy home
        assert lease.decision.chosen == home


@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=["nan", "inf"])
async def test_a_load_that_is_no_number_is_no_reading(bad: float) -> None:
    """An engine's metrics page may say NaN or +Inf (a broken engine, or anything else on its port): that scrape is
    no reading (the replica counts this gateway's own requests), not carried into routing, where rounding it raised
    for every request that weighed the replica."""
    pool = await pool_seeing("engine", EngineLoad(running=bad, waiting=0, kv_cache_usage=0.0))
    with pool.lease("acme", None) as lease:
        assert lease.decision.chosen == pool.ring.home("acme")
    assert all(replica.engine_load is None for replica in pool.replicas.values())


def three_replica_pool(driver: FakeDriver, routing: RoutingConfig) -> Pool:
    """A vLLM pool of three replicas, r0-r2, on the driver, one gateway on the in-process store."""
    replicas = [{"id": f"r{i}", "url": f"http://127.0.0.1:{1000 + i}"} for i in range(3)]
    config = PoolConfig.model_validate({"name": "llama", "backend": "vllm", "base_model": "m", "replicas": replicas})
    endpoints = [Endpoint(r["id"], r["url"]) for r in replicas]
    residency = PoolResidency(
        "llama", endpoints, driver, MemoryStore(), ResidencyConfig(), max_adapters=2, load_timeout_s=5, shared=False
    )
    return Pool(config, routing, driver, residency)


class OneBrokenPage(FakeDriver):
    """r1's metrics page makes the driver raise what it does not expect (a bug of the driver's, on that page)."""

    async def load_signals(self, replica: Endpoint) -> EngineLoad | None:
        if replica.id == "r1":
            raise RuntimeError("a page the driver did not expect")
        return await super().load_signals(replica)


async def test_one_replica_whose_scrape_raises_leaves_the_others_read(caplog: pytest.LogCaptureFixture) -> None:
    """A driver that raises on one engine's page: that replica has no reading (logged once, not at every scrape),
    the others' readings are taken. The pool's scrape was one gather: one replica's page blinded the whole pool's
    load view and running adapters at every interval."""
    driver = OneBrokenPage(FakeEngine(), load=EngineLoad(running=4, waiting=2, kv_cache_usage=0.5))
    pool = three_replica_pool(driver, RoutingConfig(load_view="engine"))
    for _ in range(3):
        _, loads = await pool.scrape_engines()
    assert loads["r1"] is None and loads["r0"] is not None and loads["r2"] is not None
    assert pool.replicas["r0"].engine_load is not None and pool.replicas["r1"].engine_load is None
    assert caplog.text.count("reading the load signals of llama/r1 failed") == 1


class OneSlowPage(FakeDriver):
    """r1's metrics page answers only once ``answer`` is set (an engine slow to answer, up to the probe timeout)."""

    def __init__(self, engine: FakeEngine, load: EngineLoad) -> None:
        super().__init__(engine, load=load)
        self.answer = asyncio.Event()
        self.slow_reads = 0

    async def load_signals(self, replica: Endpoint) -> EngineLoad | None:
        if replica.id == "r1":
            self.slow_reads += 1
            await self.answer.wait()
        return await super().load_signals(replica)


def pool_with_a_slow_page(interval_s: float = 0.5) -> tuple[Pool, OneSlowPage]:
    driver = OneSlowPage(FakeEngine(), load=EngineLoad(running=4, waiting=2, kv_cache_usage=0.5))
    routing = RoutingConfig(load_view="engine", load_scrape_interval_s=interval_s)
    return three_replica_pool(driver, routing), driver


async def test_a_replica_slow_to_answer_does_not_hold_back_the_others_readings() -> None:
    """Each replica's reading is taken as it answers. Taken when the slowest answered, an engine whose page took
    the probe timeout (2 s) left the others' readings older than the engine view's 1.5 s 40% of the time: the
    pool routed on this gateway's own count, and lost the adapters running on each GPU."""
    pool, driver = pool_with_a_slow_page()
    scrape = asyncio.create_task(pool.scrape_engines())
    for _ in range(100):  # a bounded wait for the two fast replicas' answers (no clock: a few loop turns)
        await asyncio.sleep(0)
    try:
        assert scrape.done() is False  # r1 has not answered
        assert pool.replicas["r0"].engine_load is not None and pool.replicas["r2"].engine_load is not None
        assert pool.replicas["r1"].engine_load is None
    finally:
        driver.answer.set()
        await scrape
    assert pool.replicas["r1"].engine_load is not None


async def test_the_next_round_neither_waits_for_a_slow_read_nor_starts_another() -> None:
    """A round waits for the replicas' answers a scrape interval at most: one still reading goes on in the
    background, taken when it answers, not read a second time meanwhile, and returned by the next round (what
    serve --workers shares with the other workers)."""
    pool, driver = pool_with_a_slow_page(interval_s=0.05)
    for _ in range(3):
        _, loads = await pool.scrape_engines()
        assert set(loads) == {"r0", "r2"}
    assert driver.slow_reads == 1
    driver.answer.set()
    for _ in range(100):  # a bounded wait for the background read's answer (a few loop turns)
        if pool.replicas["r1"].engine_load is not None:
            break
        await asyncio.sleep(0)
    assert pool.replicas["r1"].engine_load is not None
    driver.answer.clear()  # its next read is slow again: the next round returns the reading taken since the last
    for _ in range(10):  # the background read ends (a few loop turns)
        await asyncio.sleep(0)
    _, loads = await pool.scrape_engines()
    assert set(loads) == {"r0", "r1", "r2"} and driver.slow_reads == 2
    driver.answer.set()


async def test_a_seats_figure_below_what_an_engine_runs_at_once_is_raised_to_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """pools[].seats is the engine's --max-num-seqs. Stated far below it (seats 4 on engines that run 64), every
    key with more than 2 requests in flight per replica counted as queued (placement.seat_share 0.5): homes from
    traffic sized it by seats and grew its set, where every slot was planned paying with a quiet key's planned slot
    (that key's adapter then loaded on demand, on the request path), and a spill left its planned replicas once
    each had 4 in flight. An engine that reports more requests running
    at once than the seats figure proves it wrong: the pool takes the larger (said once), which the placement's plan
    and the spill bound read; the config's figure stays the floor."""
    replicas = [{"id": f"r{i}", "url": f"http://127.0.0.1:{1000 + i}"} for i in range(3)]
    config = PoolConfig.model_validate(
        {"name": "llama", "backend": "vllm", "base_model": "m", "seats": 4, "replicas": replicas}
    )
    endpoints = [Endpoint(r["id"], r["url"]) for r in replicas]
    driver = FakeDriver(FakeEngine(), load=EngineLoad(running=37.0, waiting=0, kv_cache_usage=0.5))
    residency = PoolResidency(
        "llama", endpoints, driver, MemoryStore(), ResidencyConfig(), max_adapters=2, load_timeout_s=5, shared=False
    )
    pool = Pool(config, RoutingConfig(), driver, residency)
    assert pool.seats == 4
    await pool.scrape_engines()
    assert pool.seats == 37
    driver.load = EngineLoad(running=64.0, waiting=3, kv_cache_usage=0.9)
    await pool.scrape_engines()
    driver.load = EngineLoad(running=2.0, waiting=0, kv_cache_usage=0.1)  # quieter later: the seats stay
    await pool.scrape_engines()
    assert pool.seats == 64
    assert caplog.text.count("runs more requests at once than pools[].seats") == 1


def test_learned_seats_follow_the_engines_down_after_a_whole_quiet_window(caplog: pytest.LogCaptureFixture) -> None:
    """Seats learned from an engine (above pools[].seats) were held until restart: an engine replaced by one with a
    smaller --max-num-seqs (or the busiest replica gone) left the figure high, so keys sized by seats counted too
    few requests as queued. Now the figure follows the engines down with hysteresis: only after a whole window
    (SEATS_FOLLOW_S) in which no replica ran more than SEATS_LOWER_BELOW of it, to the most any ran there, never
    below the stated figure; a reading near the figure, or one above it, starts the window again."""
    replicas = [{"id": f"r{i}", "url": f"http://127.0.0.1:{1000 + i}"} for i in range(2)]
    config = PoolConfig.model_validate(
        {"name": "llama", "backend": "vllm", "base_model": "m", "seats": 4, "replicas": replicas}
    )
    endpoints = [Endpoint(r["id"], r["url"]) for r in replicas]
    driver = FakeDriver(FakeEngine())
    residency = PoolResidency(
        "llama", endpoints, driver, MemoryStore(), ResidencyConfig(), max_adapters=2, load_timeout_s=5, shared=False
    )
    pool = Pool(config, RoutingConfig(), driver, residency)
    window = pool_module.SEATS_FOLLOW_S
    assert (window, pool_module.SEATS_LOWER_BELOW) == (300.0, 0.75)  # README: a 5-minute window, three quarters

    def running(at: float, r0: float, r1: float) -> None:
        loads: dict[str, EngineLoad | None] = {
            rid: EngineLoad(running=n, waiting=0, kv_cache_usage=0.1) for rid, n in (("r0", r0), ("r1", r1))
        }
        pool.took_scrape(at, loads)

    running(0.0, 64, 10)
    assert pool.seats == 64
    for at in range(1, int(window), 10):  # quiet, but less than a window: held
        running(float(at), 20, 10)
    assert pool.seats == 64
    running(window - 1, 60, 10)  # near the figure (above 3/4 of it): the window does not lower it
    running(window + 1, 20, 10)
    assert pool.seats == 64
    for at in range(int(window) + 10, int(2 * window) + 20, 10):  # a whole quiet window: down to its most
        running(float(at), 20 if at < 2 * window else 8, 10)
    assert pool.seats == 20
    for at in range(int(2 * window) + 30, int(4 * window) + 20, 10):  # quieter: down a window at a time, to 4
        running(float(at), 2, 1)
        if at == int(3 * window) + 10:
            assert pool.seats == 10  # the most the window before ran (r1's 10), above the stated 4
    assert pool.seats == 4
    running(4 * window + 30, 30, 1)  # up again at once
    assert pool.seats == 30
    assert caplog.text.count("runs more requests at once than pools[].seats") == 1
