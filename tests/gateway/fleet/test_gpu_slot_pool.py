"""The gpu_slot scorer in the real pool: what the pool says of each candidate's wait for a GPU adapter slot (from this
gateway's in-flight adapters, the other gateways' as shared, the engine's scrape and its slot count), whichever way
the decision is taken (the one pass or the general pipeline), and what a lease predicted to wait teaches."""

from __future__ import annotations

import time

import pytest

from backends.base import EngineLoad
from gateway.config import RoutingConfig, TtftPriors
from gateway.fleet.pool import Pool
from gateway.residency.signal import NO_SIGNAL, Signal, SlotSignal
from tests.gateway.fleet.test_pool_properties import pool_of
from tests.gateway.residency.fakes import ref
from tests.gateway.residency.test_slot_signal import Bus, until

PRIORS = TtftPriors(warm_ms=20, kv_cold_ms=40, host_ms=70, cold_ms=500, per_request_ms=10, gpu_slot_ms=200)
ON = {"queue": 1.0, "regime": 1.0, "affinity": 1.0, "cold_stall": 1.0, "gpu_slot": 1.0}


def slot_pool(on: bool = True, learning_rate: float = 0.0, signal: Signal = NO_SIGNAL) -> Pool:
    """Three replicas, each scraped just now with two GPU adapter slots and nothing running; no reservations."""
    routing = RoutingConfig(ttft_priors=PRIORS, ttft_learning_rate=learning_rate, home_reservation_s=0)
    if on:
        routing = routing.model_copy(update={"scorers": ON})
    pool = pool_of(3, routing, policy="predicted_ttft", signal=signal)
    for replica in pool.replicas.values():
        replica.engine_load = EngineLoad(0, 0, 0.0, gpu_slots=2)
        replica.scraped_at = time.monotonic()
    for replica_id in pool.replicas:  # the adapter in host memory everywhere: no cold load decides it
        pool.residency.views[replica_id].resident["a"] = time.monotonic() - 100
    pool.residency._sets_changed()
    return pool


@pytest.mark.parametrize("one_pass", [True, False])
def test_a_request_leaves_a_home_whose_gpu_slots_other_adapters_in_use_fill(one_pass: bool) -> None:
    """This gateway has requests for adapters b and c in flight at the key's home (two GPU slots): a request for a
    would wait there for a slot, so with the scorer on it goes to a replica with a slot free; off, it stays home."""
    pool, off = slot_pool(), slot_pool(on=False)
    home = pool.ring.home("k")
    for p in (pool, off):
        p.one_pass = one_pass
        p.residency.begin_use(home, "b")
        p.residency.begin_use(home, "c")
    assert off.place("k", "a").chosen == home
    chosen = pool.place("k", "a").chosen
    assert chosen is not None and chosen != home
    assert not pool.explain("k", "a").predictions[chosen].waits_gpu_slot
    explained = pool.explain("k", "a").predictions[home]
    assert explained.waits_gpu_slot and explained.parts["gpu_slot"] == 200
    # b's request there ended: a slot is free (or held by an idle adapter), no wait.
    pool.residency.end_use(home, "b")
    assert not pool.explain("k", "a").predictions[home].waits_gpu_slot


def test_the_engines_running_adapters_count_only_while_its_last_scrape_is_one_interval_old() -> None:
    pool = slot_pool()
    home = pool.ring.home("k")
    replica = pool.replicas[home]
    replica.engine_load = EngineLoad(2, 0, 0.1, running_adapters=frozenset({"b", "c"}), gpu_slots=2)
    replica.scraped_at = time.monotonic()
    assert pool.explain("k", "a").predictions[home].waits_gpu_slot
    replica.scraped_at = time.monotonic() - 1.0  # two intervals old: b and c may have ended since
    assert not pool.explain("k", "a").predictions[home].waits_gpu_slot


async def test_another_gateways_in_flight_adapters_fill_the_slots_with_this_ones() -> None:
    bus = Bus()
    a, b = slot_pool(signal=bus.signal()), slot_pool(signal=bus.signal())
    home = b.ring.home("k")
    a.residency.begin_use(home, "c")
    b.residency.begin_use(home, "d")
    assert not b.explain("k", "a").predictions[home].waits_gpu_slot
    assert isinstance(a.residency.signal, SlotSignal)
    a.residency.signal.share()
    await until(lambda: b.explain("k", "a").predictions[home].waits_gpu_slot, lambda: str(bus.published))
    a.residency.end_use(home, "c")
    a.residency.signal.share()
    await until(lambda: not b.explain("k", "a").predictions[home].waits_gpu_slot, lambda: "A's ended request counts")


def test_a_lease_predicted_to_wait_teaches_the_wait_not_its_regimes_line() -> None:
    pool = slot_pool(learning_rate=0.5)
    assert pool.scoring is not None
    model = pool.scoring.model
    for replica_id in pool.replicas:  # every replica's slots taken: it waits wherever it goes
        pool.residency.begin_use(replica_id, "b")
        pool.residency.begin_use(replica_id, "c")
    with pool.lease("k", None) as base:  # the base model never waits for an adapter slot
        assert not base.decision.predictions[base.replica_id].waits_gpu_slot
    with pool.lease("k", ref("a")) as lease:
        predicted = lease.decision.predictions[lease.replica_id]
        # Its regime is "warm" (the key was served there just now, and a by its recent use is among the two newest
        # in the record): the slots b and c fill say otherwise, and the wait is priced whatever the regime.
        assert predicted.waits_gpu_slot and predicted.regime == "warm"
        line = model.line("warm").at(predicted.load)
        learned = lease.learn_ttft(lease.placed_at + (line + 600) / 1000)
    assert learned is not None
    assert learned[1] == pytest.approx(line + 200)  # the line and the wait it expected
    assert model.gpu_slot_ms == pytest.approx(400)  # halfway from 200 to the 600 it waited
    assert model.version == 0  # no line moved
