"""Properties of the real pool's decisions (Pool.lease over the routing pipeline, not a copy of its logic): whatever
the fleet's health, loads, retries and size, the pick is never a replica a filter left out, and bounded loads never
send a request over the cap while a candidate under it exists. With home reservations: a key's home is taken
whenever it has room, a placement elsewhere is under the bound, and a light key stays home whatever a hot key does.
The bound is the decision's own (``decision.capacity``), never recomputed here. And the ring's bounded walk is the
ring's order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from uhashring import HashRing

from backends.base import Endpoint
from gateway.config import PoolConfig, ResidencyConfig, RoutingConfig
from gateway.fleet.pool import Lease, Pool
from gateway.residency.lifecycle import PoolResidency
from gateway.residency.memory import MemoryStore
from gateway.residency.signal import NO_SIGNAL, Signal
from gateway.routing.decision import RoutingDecision
from gateway.routing.reservations import HomeReservations
from gateway.routing.ring import Ring
from tests.clock import Clock
from tests.gateway.residency.fakes import FakeDriver, FakeEngine, ref


def uhashring(size: int, vnodes: int) -> HashRing:
    """uhashring's own ring on the replicas ``Ring([f"r{i}" ...])`` has: the oracle for its walks."""
    return HashRing(nodes={f"r{i}": {"vnodes": vnodes} for i in range(size)})


def pool_of(
    size: int,
    routing: RoutingConfig,
    cap: int = 512,
    policy: str = "bounded_consistent_hash",
    signal: Signal = NO_SIGNAL,
) -> Pool:
    """A real pool of ``size`` replicas over a fake engine, every replica up; ``signal``: the slot signal its
    residency shares with other gateways' (the in-process store's, which shares nothing, by default)."""
    replicas = [{"id": f"r{i}", "url": f"http://127.0.0.1:{1000 + i}"} for i in range(size)]
    config = PoolConfig.model_validate(
        {"name": "llama", "backend": "vllm", "base_model": "m", "replicas": replicas, "policy": policy}
    )
    endpoints = [Endpoint(r["id"], r["url"]) for r in replicas]
    driver = FakeDriver(FakeEngine())
    residency = PoolResidency(
        "llama",
        endpoints,
        driver,
        MemoryStore(),
        ResidencyConfig(),
        max_adapters=2,
        load_timeout_s=5,
        shared=False,
        signal=signal,
    )
    pool = Pool(config, routing, driver, residency, max_in_flight_per_replica=cap)
    for replica in pool.replicas.values():
        replica.health.probed(True)
    return pool


@settings(max_examples=150, deadline=None)
@given(
    policy=st.sampled_from(["bounded_consistent_hash", "predicted_ttft"]),
    size=st.integers(1, 12),
    candidates=st.integers(1, 12),
    cap=st.integers(1, 6),
    down=st.sets(st.integers(0, 11), max_size=6),
    arrivals=st.lists(st.tuples(st.sampled_from([f"k{i}" for i in range(20)]), st.integers(0, 11)), max_size=40),
)
def test_a_pick_is_never_a_replica_left_out_nor_over_the_bound_while_one_under_it_exists(
    policy: str, size: int, candidates: int, cap: int, down: set[int], arrivals: list[tuple[str, int]]
) -> None:
    pool = pool_of(size, RoutingConfig(candidates=candidates, capacity_floor=1, home_reservation_s=0), cap, policy)
    for index in down:
        if index < size:
            pool.replicas[f"r{index}"].health.up = False
    held = []
    for key, avoid_index in arrivals:
        avoid = (f"r{avoid_index}",)
        before = {r: replica.in_flight for r, replica in pool.replicas.items()}
        lease = pool.lease(key, None, avoid)
        decision = lease.decision
        if decision.chosen is None:
            assert decision.unavailable in ("down", "full")
            assert not decision.candidates
            continue
        held.append(lease.__enter__())
        chosen = decision.chosen
        assert chosen not in decision.excluded or decision.excluded[chosen] == "over_capacity"
        assert pool.replicas[chosen].healthy and chosen not in avoid
        assert before[chosen] < cap  # never past the hard per-replica cap
        bound = decision.capacity
        assert bound is not None
        under = [r for r in decision.candidates if before[r] < bound]
        if under:  # a replica under the bound existed among the candidates: the pick is one of them
            assert before[chosen] < bound
        assert len(decision.candidates) + len(decision.excluded) >= min(size, candidates)
    for lease in held:
        lease.__exit__(None, None, None)
    assert pool.in_flight == 0 and all(replica.in_flight == 0 for replica in pool.replicas.values())


@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 40), count=st.integers(1, 45), salt=st.integers(0, 10_000))
def test_the_bounded_walk_is_the_head_of_the_rings_own_order(size: int, count: int, salt: int) -> None:
    ring = Ring([f"r{i}" for i in range(size)], vnodes=40)
    for key in (f"tenant-{salt}-{i}" for i in range(20)):
        full = tuple(uhashring(size, 40).iterate_nodes(key, distinct=True))  # uhashring's own walk, O(points)
        assert tuple(ring.distinct_from(key)) == full
        assert ring.head(key, count) == full[: min(count, size)]
        assert ring.home(key) == full[0]


def test_a_decision_weighs_only_its_candidates_at_any_fleet_size() -> None:
    pool = pool_of(200, RoutingConfig(candidates=8, capacity_floor=1, home_reservation_s=0), cap=100)
    decision = pool.lease("acme", None).decision
    assert len(decision.candidates) == 8 and decision.chosen == pool.ring.home("acme")
    assert len(pool.explain("acme", None).loads) == 8
    assert pool.ring.head("acme", 8) == pool.ring.preference("acme")[:8]


def reserving_pool(size: int, factor: float, floor: int) -> tuple[Pool, Clock]:
    """A real bounded_consistent_hash pool with home reservations (a 5 s window) on a clock the test moves."""
    routing = RoutingConfig(balance_factor=factor, capacity_floor=floor, home_reservation_s=5.0, vnodes=40)
    pool = pool_of(size, routing)
    clock = Clock()
    pool.reservations = HomeReservations(5.0, clock=clock)  # the pool's own class, on the test's clock
    return pool, clock


@settings(max_examples=200, deadline=None)
@given(
    size=st.integers(1, 6),
    factor=st.sampled_from([1.0, 1.25, 1.5, 2.0]),
    floor=st.sampled_from([1, 2, 8]),
    events=st.lists(st.tuples(st.booleans(), st.integers(0, 20), st.floats(0, 3)), min_size=1, max_size=300),
)
def test_a_keys_home_is_taken_when_it_has_room_and_no_placement_exceeds_the_bound(
    size: int, factor: float, floor: int, events: list[tuple[bool, int, float]]
) -> None:
    """The load a key is judged by is in flight plus reserved when it has requests in flight (reservations bind
    it), in flight alone when it has none; a key that holds its home's reservation takes it at any load."""
    pool, clock = reserving_pool(size, factor, floor)
    running: list[Lease] = []
    for arrival, index, elapsed in events:
        clock.advance(elapsed)
        if not arrival:
            if running:
                running.pop(index % len(running)).__exit__(None, None, None)
            continue
        key = f"k{index}"
        pool.reservations.expire()  # the pool expires lapsed keys first: measure after that
        standing = pool.reservations.standing(key)
        load = {
            r: replica.in_flight + (pool.reservations.reserved(r) if standing.in_flight else 0)
            for r, replica in pool.replicas.items()
        }
        lease = pool.lease(key, None)
        decision: RoutingDecision = lease.decision
        running.append(lease)
        assert decision.chosen is not None and decision.capacity is not None
        home = pool.ring.home(key)
        if standing.holds_reservation or load[home] < decision.capacity:
            assert decision.chosen == home, (decision, load)
        if decision.used_reservation:
            assert decision.chosen == home and standing.holds_reservation
        else:
            assert load[decision.chosen] < decision.capacity, (decision, load)
    for lease in running:
        lease.__exit__(None, None, None)
    assert pool.in_flight == 0 and all(pool.reservations.reserved(r) >= 0 for r in pool.replicas)


@settings(max_examples=200, deadline=None)
@given(
    size=st.integers(2, 6),
    hot_concurrency=st.integers(1, 40),
    events=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 1000)), min_size=1, max_size=400),
)
def test_a_light_key_stays_home_whatever_a_hot_key_does(
    size: int, hot_concurrency: int, events: list[tuple[int, int]]
) -> None:
    """Light keys (one request at a time, active) go home on every request after their first, in any interleaving
    with a hot key that keeps up to ``hot_concurrency`` requests in flight."""
    pool, clock = reserving_pool(size, 1.25, 1)
    lights = [f"light-{i}" for i in range(7)]
    for light in lights:  # each light key's first request, before the hot one turns up
        pool.lease(light, None).__exit__(None, None, None)
    light_running: dict[str, Lease] = {}
    hot_running: list[Lease] = []
    for actor, pick in events:
        clock.advance(0.01)
        if actor == 7:  # the hot key: add a request, or finish one when at its concurrency
            if len(hot_running) < hot_concurrency:
                hot_running.append(pool.lease("hot", None))
            else:
                hot_running.pop(pick % len(hot_running)).__exit__(None, None, None)
            continue
        light = lights[actor]
        if light in light_running:
            light_running.pop(light).__exit__(None, None, None)
        else:
            lease = pool.lease(light, None)
            assert lease.decision.chosen == pool.ring.home(light), (light, lease.decision)
            light_running[light] = lease


@pytest.mark.parametrize("policy", ["bounded_consistent_hash", "predicted_ttft"])
@pytest.mark.parametrize("resident_count", [30, 1])
def test_resident_replicas_take_the_ring_tails_places_up_to_half_of_the_candidates(
    policy: str, resident_count: int
) -> None:
    """At most ``routing.candidates`` replicas are weighed whatever the fleet: replicas where the adapter is
    resident outside the key's first ones replace the last of them, up to half, the home always kept."""
    pool = pool_of(200, RoutingConfig(candidates=8, capacity_floor=1, home_reservation_s=0), cap=100, policy=policy)
    head = pool.ring.head("acme", 8)
    resident = sorted(set(pool.replicas) - set(head))[:resident_count]  # none among the key's first 8
    for replica_id in resident:
        pool.residency.views[replica_id].resident["a"] = 1.0
    kept = min(resident_count, 4)
    assert pool.explain("acme", "a").candidates == [*head[: 8 - kept], *resident[:kept]]


@settings(max_examples=80, deadline=None)
@given(
    size=st.sampled_from([3, 9, 20, 120]),  # 120 x 160 points: past the ring's table, a slice
    count=st.integers(1, 10),
    resident_at=st.sets(st.integers(0, 119), max_size=30),
    keys=st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=8),
)
def test_a_keys_candidates_are_its_head_then_the_first_resident_outside_it_by_name(
    size: int, count: int, resident_at: set[int], keys: list[str]
) -> None:
    """A key's candidates at its first sight, whether resident replicas lie inside its head or not (the pool takes
    the names kept per resident set when none does): the head's first K - w, then the first w = up to K/2 resident
    replicas by name outside the head."""
    pool = pool_of(size, RoutingConfig(candidates=count, capacity_floor=1, home_reservation_s=0), cap=100)
    resident = sorted(f"r{index}" for index in resident_at if index < size)
    for replica_id in resident:
        pool.residency.views[replica_id].resident["a"] = 1.0
    for key in keys:
        head = pool.ring.head(key, count)
        warm = [replica_id for replica_id in resident if replica_id not in head][: count // 2]
        expected = [*head[: len(head) - len(warm)], *warm] if warm else list(head)
        assert pool.explain(key, "a").candidates == expected


async def test_a_keys_candidates_follow_its_adapters_residency_and_the_placement_table() -> None:
    """The pool keeps a key's candidates between decisions (finding the resident ones outside its head costs a
    microsecond): a load elsewhere and a new placement table are seen at the next decision all the same."""
    pool = pool_of(200, RoutingConfig(candidates=8, capacity_floor=1, home_reservation_s=0), cap=100)
    head = pool.ring.head("acme", 8)
    outside = sorted(set(pool.replicas) - set(head))
    await pool.residency.ensure(outside[1], ref("a"))
    assert pool.lease("acme", ref("a")).decision.candidates == [*head[:7], outside[1]]
    await pool.residency.ensure(outside[0], ref("a"))  # first by name: it takes the place of the next in the head
    assert pool.lease("acme", ref("a")).decision.candidates == [*head[:6], outside[0], outside[1]]
    pool.ring.install({"acme": (outside[2],)})
    assert pool.lease("acme", ref("a")).decision.candidates[0] == outside[2]


@settings(max_examples=60, deadline=None)
@given(
    size=st.sampled_from([1, 2, 3, 5, 8, 13, 40, 70, 110]),  # 110 x 160 points: past the table, a slice
    vnodes=st.sampled_from([40, 160]),
    count=st.integers(1, 12),
    salt=st.integers(0, 10_000),
)
def test_a_walk_after_a_balanced_home_is_the_rings_own_order_without_it(
    size: int, vnodes: int, count: int, salt: int
) -> None:
    """With balanced homes (a home before the ring's order), on small rings (a table per point) and large ones
    (a slice), the head is the home, then the ring's own order without it."""
    ring = Ring([f"r{i}" for i in range(size)], vnodes=vnodes)
    keys = [f"tenant-{salt}-{i}" for i in range(3 * size)]
    ring.balance(keys)
    for key in keys[:20]:
        home = ring.balanced_home(key)
        rest = [r for r in uhashring(size, vnodes).iterate_nodes(key, distinct=True) if r != home]  # uhashring's own
        assert ring.head(key, count) == (home, *rest)[: min(count, size)]
