"""The plain case's one pass over the pool's records (gateway/fleet/one_pass.py) decides as the general pipeline
does (the pool's snapshot, then routing/pipeline.py), whatever the pool knows: health, loads, reservations, the
adapter's residency, the engines' scrapes, the other gateways' shared loads, the key's recent replicas, the
placement table, the scorers and what the model learned. And it is what a request's own decision takes when every
candidate is up, at full weight and under the bound."""

from __future__ import annotations

import json
import time
from typing import Literal
from unittest import mock

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from backends.base import EngineLoad
from gateway.config import RoutingConfig, TtftPriors
from gateway.fleet.pool import Pool
from gateway.observe.metrics import GatewayMetrics
from gateway.residency.signal import SlotSignal
from gateway.routing.decision import RoutingDecision
from tests.gateway.fleet.test_pool_properties import pool_of

PRIORS = TtftPriors(warm_ms=20, kv_cold_ms=40, host_ms=70, cold_ms=500, per_request_ms=10)
NOW = 10_000.0
KEYS = ("k0", "k1", "k2")
ADAPTERS = ("a", "b", "c")
SIZE = 6
LOAD_AHEAD_ON = {"queue": 1.0, "regime": 1.0, "affinity": 1.0, "cold_stall": 1.0, "load_ahead": 1.0}


async def _published(body: str) -> None:
    return None


def _replica(size: int) -> st.SearchStrategy[str]:
    return st.integers(0, size - 1).map(lambda index: f"r{index}")


@st.composite
def pools(draw: st.DrawFn) -> tuple[Pool, float]:
    """A real pool of up to SIZE replicas in any state this test can give it (mostly healthy, so the plain case is
    common), with the clock it was built on."""
    size = draw(st.integers(1, SIZE))
    replica = _replica(size)
    view: Literal["gateway", "engine", "shared"] = draw(st.sampled_from(["gateway", "engine", "shared"]))
    weights = draw(st.tuples(*[st.sampled_from([0.0, 1.0, 2.0])] * 6))
    names = ("queue", "regime", "affinity", "cold_stall", "load_ahead", "gpu_slot")
    scorers = dict(zip(names, weights, strict=True))
    if draw(st.integers(0, 9)) == 0:
        scorers["eviction"] = 1.0  # not linear: the general pipeline decides every request
    routing = RoutingConfig(
        ttft_priors=PRIORS,
        ttft_learning_rate=0.3,
        candidates=draw(st.integers(1, SIZE)),
        capacity_floor=draw(st.sampled_from([1, 2, 8])),
        home_reservation_s=draw(st.sampled_from([0.0, 5.0])),
        load_view=view,
        prefix_warm_s=30.0,
        cold_margin_ms=draw(st.sampled_from([0.0, 50.0, 500.0])),
        hold_copies=draw(st.booleans()),
        scorers=scorers,
    )
    signal = SlotSignal(_published, GatewayMetrics()) if view == "shared" else None
    policy = draw(st.sampled_from(["bounded_consistent_hash", "predicted_ttft"]))
    if signal is None:
        pool = pool_of(size, routing, draw(st.integers(3, 12)), policy)
    else:
        pool = pool_of(size, routing, draw(st.integers(3, 12)), policy, signal=signal)
    for _ in range(draw(st.integers(0, 4))):  # the model learns: the summed table follows
        if pool.scoring is not None:
            pool.scoring.model.observe(draw(st.sampled_from(["warm", "cold", "host"])), 1, draw(st.floats(1, 900)))
    for replica_id, state in draw(
        st.lists(st.tuples(replica, st.sampled_from(["down", "slow", "ejected"])), max_size=1)
    ):
        health = pool.replicas[replica_id].health
        if state == "down":
            health.up = False
        elif state == "slow":  # back in service 3 s ago: slow start (10 s by default)
            health.serving_since = NOW - 3
        else:
            health.ejected_until = NOW + 30
        health.drained = False  # restates full_weight_at
    for replica_id, name, used in draw(st.lists(st.tuples(replica, st.sampled_from(ADAPTERS), st.integers(0, 9)))):
        view_ = pool.residency.views[replica_id]
        if name in view_.resident or len(view_.resident) < 2:
            view_.resident[name] = NOW - 100 + used
            pool.residency._sets_changed()
    scrape = st.tuples(replica, st.integers(0, 9), st.sets(st.sampled_from(ADAPTERS)), st.booleans(), st.integers(0, 3))
    for replica_id, queued, running, fresh, slots in draw(st.lists(scrape, max_size=4)):
        record = pool.replicas[replica_id]
        record.engine_load = EngineLoad(queued, 0, 0.1, running_adapters=frozenset(running), gpu_slots=slots)
        record.scraped_at = NOW if fresh else NOW - 100  # far from either freshness limit
        record.in_flight_at_scrape = draw(st.integers(0, 2))
    if signal is not None:  # another gateway's requests in flight, as it last shared them
        held: dict[str, list[str]] = {}
        counts: dict[str, int] = {}
        for replica_id, name, count in draw(
            st.lists(st.tuples(replica, st.sampled_from(ADAPTERS), st.integers(1, 4)), max_size=3)
        ):
            held.setdefault(replica_id, []).append(name)
            counts[replica_id] = counts.get(replica_id, 0) + count
        # ... and its adapter loads under way: how many queued, how long the running one has run (ms) or None.
        loads = {
            replica_id: [queued, ran_ms]
            for replica_id, queued, ran_ms in draw(
                st.lists(st.tuples(replica, st.integers(0, 2), st.sampled_from([None, 0.0, 150.0, 900.0])), max_size=2)
            )
        }
        message = {
            "t": "flying", "g": "other", "n": 1, "h": {"llama": held}, "c": {"llama": counts}, "l": {"llama": loads},
        }  # fmt: skip
        signal.heard(json.dumps(message))
    # This gateway's adapter loads under way (queued, and when the running one began), and its expected load time.
    for replica_id, queued, ran_s in draw(
        st.lists(st.tuples(replica, st.integers(0, 2), st.sampled_from([None, 0.05, 0.3, 2.0])), max_size=2)
    ):
        if queued or ran_s is not None:
            pool.residency.loading_here[replica_id] = (queued, None if ran_s is None else NOW - ran_s)
    pool.residency.load_ms = draw(st.sampled_from([0.0, 300.0]))
    if draw(st.booleans()):  # a placement table: the key's replica set beyond its home charges no affinity margin
        pool.ring.install({key: tuple(draw(st.lists(replica, min_size=1, max_size=3, unique=True))) for key in KEYS})
    return pool, NOW


@settings(max_examples=600, deadline=None)
@given(
    built=pools(),
    leases=st.lists(
        st.tuples(
            st.sampled_from(KEYS), st.sampled_from([*ADAPTERS, None]), st.sampled_from([0.0, 100.0]), st.booleans()
        ),
        max_size=10,
    ),
)
def test_the_one_pass_decides_as_the_general_pipeline(
    built: tuple[Pool, float], leases: list[tuple[str, str | None, float, bool]]
) -> None:
    pool, now = built
    clock = [now]
    with mock.patch.object(time, "monotonic", lambda: clock[0]):
        held = []
        # Requests served at now - age (the prefix warm there or not), in flight or done (a key active with nothing
        # in flight holds its home's reservation, when the pool reserves).
        for lease_key, name, age, done in leases:
            clock[0] = now - age
            placed = pool.place(lease_key, name)
            if placed.chosen is not None and done:
                pool.release(placed)
            elif placed.chosen is not None:
                held.append((placed, name))
                if name is not None:  # in use there, as a lease marks it
                    pool.residency.begin_use(placed.chosen, name)
        clock[0] = now
        # Every key and adapter on this state: the decision place takes, without taking it, each way.
        asked = [(key, adapter) for key in KEYS for adapter in (*ADAPTERS, None)]
        fast = [pool._decide(key, adapter) for key, adapter in asked]
        pool.one_pass = False
        general = [pool._decide(key, adapter) for key, adapter in asked]
        for placed, name in held:
            pool.release(placed)
            if name is not None and placed.chosen is not None:
                pool.residency.end_use(placed.chosen, name)
    event(f"{sum(1 for decision in fast if decision.order)} of {len(asked)} in one pass")
    for one, other in zip(fast, general, strict=True):
        assert_same(one, other)


def assert_same(fast: RoutingDecision, general: RoutingDecision) -> None:
    assert fast.chosen == general.chosen
    assert fast.reasons == general.reasons and fast.excluded == general.excluded
    assert fast.capacity == general.capacity and fast.used_reservation == general.used_reservation
    assert fast.candidates == general.candidates and fast.unavailable == general.unavailable
    assert fast.warm_ahead == general.warm_ahead and fast.warm_ahead_due == general.warm_ahead_due
    assert fast.predictions.keys() == general.predictions.keys()
    for replica_id, predicted in fast.predictions.items():
        expected = general.predictions[replica_id]
        assert (predicted.regime, predicted.load) == (expected.regime, expected.load)
        assert predicted.waits_gpu_slot == expected.waits_gpu_slot
        assert predicted.total_ms == pytest.approx(expected.total_ms)


@pytest.mark.parametrize("policy", ["bounded_consistent_hash", "predicted_ttft"])
def test_an_idle_healthy_fleet_is_decided_in_one_pass(policy: str) -> None:
    """The plain case is taken: a request's own decision over an idle, healthy fleet keeps no snapshot (else the
    property above would hold trivially, with the one pass never deciding); with the home over the bound, the
    general pipeline decides."""
    pool = pool_of(4, RoutingConfig(ttft_priors=PRIORS, capacity_floor=1, home_reservation_s=0), policy=policy)
    decision = pool.place("acme", "a")
    assert decision.chosen == pool.ring.home("acme") and decision.reasons == ["home"]
    assert decision.kept == () and decision.candidates == list(pool.ring.head("acme", 4))
    pool.release(decision)
    pool.replicas[pool.ring.home("acme")].in_flight = 9
    over = pool.place("acme", "a")
    assert over.kept != () and over.chosen != pool.ring.home("acme")


@pytest.mark.parametrize("one_pass", [True, False])
def test_a_cold_load_leaves_a_home_where_a_load_runs_with_load_ahead_on(one_pass: bool) -> None:
    """The real pool, the adapter cold everywhere: its home has a load running (this gateway's, begun 100 ms ago, 300
    ms expected) or another gateway's (as its message said). With the default scorers the home takes it (the affinity
    margin); with load_ahead the next replica does: 200 ms left there against a 10 ms margin."""
    signal = SlotSignal(_published, GatewayMetrics(), clock=lambda: NOW)
    chosen: dict[tuple[bool, str], bool] = {}
    number = 0
    default: dict[str, float] = {"queue": 1.0, "regime": 1.0, "affinity": 1.0, "cold_stall": 1.0}
    for scorers in (default, LOAD_AHEAD_ON):
        for whose in ("here", "there"):
            routing = RoutingConfig(ttft_priors=PRIORS, ttft_learning_rate=0, scorers=scorers)
            pool = pool_of(3, routing, policy="predicted_ttft", signal=signal)
            pool.one_pass = one_pass
            pool.residency.load_ms = 300.0
            home = pool.ring.preference("k0")[0]
            with mock.patch.object(time, "monotonic", lambda: NOW):
                if whose == "here":
                    pool.residency.loading_here[home] = (0, NOW - 0.1)
                else:
                    number += 1
                    other = {"t": "flying", "g": "other", "n": number, "h": {}, "l": {"llama": {home: [0, 100.0]}}}
                    signal.heard(json.dumps(other))
                decision = pool._decide("k0", "a")
            chosen[("load_ahead" in scorers, whose)] = decision.chosen == home
            assert decision.chosen is not None and decision.predictions[decision.chosen].regime == "cold"
            number += 1
            signal.heard(json.dumps({"t": "flying", "g": "other", "n": number, "h": {}}))  # the load ended
    assert chosen == {(False, "here"): True, (False, "there"): True, (True, "here"): False, (True, "there"): False}
