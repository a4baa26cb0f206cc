"""predicted_ttft in the real pool: what the pool tells the picker about each candidate (the adapter on the GPU,
the key's prefix warm there) and what a lease teaches the pool's TTFT model."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gateway.fleet.pool as pool_module
from backends.base import AdapterRef, Endpoint, EngineLoad
from backends.errors import EngineUnavailable
from gateway.config import RoutingConfig, TelemetryConfig, TtftPriors
from gateway.fleet.pool import Pool
from gateway.observe.metrics import GatewayMetrics
from gateway.observe.telemetry import RequestRecord, Telemetry
from gateway.residency.signal import NO_SIGNAL, Signal, SlotSignal
from tests.gateway.fleet.test_pool_properties import pool_of
from tests.gateway.residency.fakes import ref
from tests.gateway.residency.test_slot_signal import Bus, until

ADAPTER: AdapterRef = ref("a")


PRIORS = TtftPriors(warm_ms=20, kv_cold_ms=40, host_ms=70, cold_ms=500, per_request_ms=10)


def predicting_pool(
    learning_rate: float = 0.0,
    prefix_warm_s: float = 30.0,
    policy: str = "predicted_ttft",
    routing: RoutingConfig | None = None,
    signal: Signal = NO_SIGNAL,
) -> Pool:
    """Three replicas; the priors above, frozen unless ``learning_rate``; no reservations."""
    routing = routing or RoutingConfig(
        ttft_priors=PRIORS, ttft_learning_rate=learning_rate, prefix_warm_s=prefix_warm_s, home_reservation_s=0
    )
    return pool_of(3, routing, policy=policy, signal=signal)


def test_the_replica_that_served_a_key_has_its_prefix_warm_for_the_window() -> None:
    pool = predicting_pool()
    with pool.lease("k", None) as first:
        served = first.replica_id
    decision = pool.explain("k", None)
    regimes = {r: p.regime for r, p in decision.predictions.items()}
    assert regimes[served] == "warm"
    assert [regime for r, regime in regimes.items() if r != served] == ["kv_cold"] * 2
    assert decision.chosen == served


def test_a_prefix_older_than_the_window_is_cold_again() -> None:
    pool = predicting_pool(prefix_warm_s=0.0)
    with pool.lease("k", None):
        pass
    time.sleep(0.01)  # not a timing assertion: the window is 0, any later decision is past it
    assert {p.regime for p in pool.explain("k", None).predictions.values()} == {"kv_cold"}


def test_the_pool_remembers_the_most_recently_routed_keys_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past its bound the pool forgets the least recently routed key's warm replicas (session keys are unbounded in
    number); a key routed again counts as recent, whenever it was first seen."""
    monkeypatch.setattr(pool_module, "_RECENT_KEYS", 3)
    pool = predicting_pool()

    def warm(key: str) -> bool:
        return any(p.regime == "warm" for p in pool.explain(key, None).predictions.values())

    for key in ("k0", "k1", "k2", "k0", "k3"):  # k0 routed again before k3 came: k1 is the least recent
        with pool.lease(key, None):
            pass
    assert [warm(key) for key in ("k0", "k1", "k2", "k3")] == [True, False, True, True]


async def test_an_adapter_in_use_or_among_the_most_recently_used_is_on_the_gpu_others_in_host_memory() -> None:
    pool = predicting_pool()
    for replica_id in ("r0", "r1", "r2"):
        await pool.residency.ensure(replica_id, ADAPTER)
        await pool.residency.ensure(replica_id, ref("b"))  # used after it: "a" is no longer the most recent
    with pool.lease("k", ADAPTER) as lease:
        busy = lease.replica_id
        regimes = {r: p.regime for r, p in pool.explain("other-key", ADAPTER.engine_name).predictions.items()}
    assert regimes[busy] == "kv_cold"  # in use here: on the GPU; the other key's prefix is not warm
    assert [regimes[r] for r in sorted(set(regimes) - {busy})] == ["host", "host"]  # one GPU slot until a scrape
    # Once the request ends, "a" is the most recently used where it ran, and "b" where it did not.
    regimes = {r: p.regime for r, p in pool.explain("other-key", "b").predictions.items()}
    assert regimes == {r: "host" if r == busy else "kv_cold" for r in regimes}


async def test_the_engines_gpu_slots_say_how_many_recent_adapters_are_on_the_gpu() -> None:
    pool = predicting_pool()
    await pool.residency.ensure("r1", ADAPTER)
    await pool.residency.ensure("r1", ref("b"))
    assert pool.explain("k", "a").predictions["r1"].regime == "host"
    pool.replicas["r1"].engine_load = EngineLoad(0, 0, 0.0, gpu_slots=2)
    assert pool.explain("k", "a").predictions["r1"].regime == "kv_cold"


async def test_a_request_another_gateway_placed_makes_its_adapter_warm_there_so_no_second_cold_load() -> None:
    """Gateway A placed a request for adapter "a" on a replica where it was cold (A loads it there: hundreds of
    milliseconds on a GPU). Once A's in-flight adapters are shared (the slot signal's batch), gateway B's next
    request for "a" goes there too rather than loading it cold at its own choice: with three gateways on the hot
    trace, such duplicate loads were 6-7 per run, none with one gateway."""
    bus = Bus()
    a, b = predicting_pool(signal=bus.signal()), predicting_pool(signal=bus.signal())
    home = b.explain("k", "a").chosen
    assert home is not None
    elsewhere = next(replica for replica in sorted(b.replicas) if replica != home)
    assert {p.regime for p in b.explain("k", "a").predictions.values()} == {"cold"}
    a.residency.begin_use(elsewhere, "a")
    assert isinstance(a.residency.signal, SlotSignal)
    a.residency.signal.share()
    await until(lambda: b.explain("k", "a").chosen == elsewhere, lambda: f"B still goes home: {bus.published}")
    assert b.explain("k", "a").predictions[elsewhere].regime == "kv_cold"
    a.residency.end_use(elsewhere, "a")
    a.residency.signal.share()
    await until(lambda: b.explain("k", "a").chosen == home, lambda: "B still counts A's ended request")


async def test_the_shared_load_view_counts_the_requests_other_gateways_have_in_flight() -> None:
    """``routing.load_view: shared`` (the default): a replica's load is this gateway's requests there plus the other
    gateways', as they last shared them; ``gateway`` counts this gateway's own only."""
    bus = Bus()
    routing = RoutingConfig(ttft_priors=PRIORS, ttft_learning_rate=0, home_reservation_s=0)
    assert routing.load_view == "shared"
    a = predicting_pool(signal=bus.signal())
    b = predicting_pool(routing=routing, signal=bus.signal())
    own = predicting_pool(routing=routing.model_copy(update={"load_view": "gateway"}), signal=bus.signal())
    for _ in range(3):
        a.residency.begin_use("r2", "a")
    assert isinstance(a.residency.signal, SlotSignal)
    a.residency.signal.share()
    await until(lambda: b.explain("k", "a").predictions["r2"].load == 3, lambda: str(bus.published))
    with b.lease("k", ref("a")) as lease:
        assert b.routed_load(lease.replica_id, time.monotonic()) == 1 + 3 * (lease.replica_id == "r2")
    assert own.explain("k", "a").predictions["r2"].load == 0
    assert own.routed_load("r2", time.monotonic()) == 0


async def test_the_shared_load_view_leaves_out_other_gateways_requests_for_the_base_model() -> None:
    """What the README says of ``shared``: another gateway's requests for the base model are not counted (its
    message counts the requests of the adapters it holds), and without Redis the view is this gateway's own."""
    bus = Bus()
    routing = RoutingConfig(ttft_priors=PRIORS, ttft_learning_rate=0, home_reservation_s=0, load_view="shared")
    a, b = predicting_pool(signal=bus.signal()), predicting_pool(routing=routing, signal=bus.signal())
    with a.lease("base", None):
        for _ in range(3):
            a.residency.begin_use("r2", "a")
        assert isinstance(a.residency.signal, SlotSignal)
        a.residency.signal.share()  # one message with both: the adapter's 3 requests and the base model's lease
        await until(lambda: b.explain("k", "a").predictions["r2"].load == 3, lambda: str(bus.published))
        assert sum(p.load for p in b.explain("k", "a").predictions.values()) == 3
    alone = predicting_pool(routing=routing)  # no Redis: no signal, nothing heard
    assert not alone.shared_load_view  # its own count, without a lookup per candidate
    with alone.lease("k", None) as lease:
        assert alone.routed_load(lease.replica_id, time.monotonic()) == 1
        assert {r: p.load for r, p in alone.explain("k", "a").predictions.items()}[lease.replica_id] == 1


def test_the_engines_running_adapters_count_while_the_scrape_is_fresh() -> None:
    pool = predicting_pool()
    replica = pool.replicas["r1"]
    replica.engine_load = EngineLoad(1, 0, 0.1, running_adapters=frozenset({"a"}))
    replica.scraped_at = time.monotonic()
    assert pool.explain("k", "a").predictions["r1"].regime == "kv_cold"
    replica.scraped_at = time.monotonic() - 10  # older than 3 scrape intervals: not evidence any more
    assert pool.explain("k", "a").predictions["r1"].regime == "cold"


def test_a_lease_teaches_the_model_the_ttft_it_measured_for_its_regime_and_load() -> None:
    pool = predicting_pool(learning_rate=0.5)
    assert pool.scoring is not None
    model = pool.scoring.model
    with pool.lease("k", None) as lease:
        regime = lease.decision.predictions[lease.replica_id].regime
        learned = lease.learn_ttft(lease.placed_at + 0.300)
    assert learned is not None
    assert learned[0] == regime == "kv_cold"
    assert learned[1] == pytest.approx(40)  # what it expected at no load
    assert learned[2] == pytest.approx(300)
    assert model.line("kv_cold").at(0) > 40  # it moved toward what it measured
    assert model.line("warm").at(0) == pytest.approx(20)


async def test_an_attempt_that_loaded_its_adapter_is_learned_as_cold() -> None:
    pool = predicting_pool(learning_rate=0.5)
    with pool.lease("k", ADAPTER) as lease:
        await lease.load_adapter()
        learned = lease.learn_ttft(lease.placed_at + 0.9)
    assert learned is not None and learned[0] == "cold"


def test_a_pool_of_another_policy_learns_nothing() -> None:
    pool = predicting_pool(policy="bounded_consistent_hash")
    with pool.lease("k", None) as lease:
        assert lease.learn_ttft(lease.placed_at + 0.1) is None


async def test_residency_is_the_host_regimes_evidence_whatever_prefer_resident_says() -> None:
    pool = predicting_pool(routing=RoutingConfig(ttft_priors=PRIORS, prefer_resident=False, home_reservation_s=0))
    await pool.residency.ensure("r1", ADAPTER)
    await pool.residency.ensure("r1", ref("b"))  # used after it: "a" is resident there, not the most recent
    assert pool.explain("k", "a").predictions["r1"].regime == "host"


@settings(max_examples=80, deadline=None)
@given(
    resident=st.lists(st.tuples(st.integers(0, 5), st.sampled_from(["a", "b", "c"]), st.integers(0, 9)), max_size=12),
    leases=st.lists(st.tuples(st.sampled_from(["k0", "k1", "k2"]), st.sampled_from(["a", "b", None])), max_size=6),
    scrapes=st.lists(
        st.tuples(st.integers(0, 5), st.sets(st.sampled_from(["a", "b", "c"])), st.booleans(), st.integers(1, 3)),
        max_size=4,
    ),
    down=st.sets(st.integers(0, 5), max_size=2),
    adapter=st.sampled_from(["a", "b", "c", None]),
)
def test_the_snapshot_says_what_the_pool_knows_of_each_candidate(
    resident: list[tuple[int, str, int]],
    leases: list[tuple[str, str | None]],
    scrapes: list[tuple[int, set[str], bool, int]],
    down: set[int],
    adapter: str | None,
) -> None:
    """The snapshot's shortcuts (health's full_weight_at; the adapter on the GPU asked of the record only where it
    is resident or this gateway has requests in flight) say what health and the record say, at every candidate: on
    the GPU where the engine's fresh scrape lists the adapter running, or where the record has it in use or among
    the replica's most recently used (as many as the last scrape's GPU slots, else 1)."""
    pool = pool_of(6, RoutingConfig(ttft_priors=PRIORS, home_reservation_s=0), policy="predicted_ttft")
    for index, name, used in resident:
        pool.residency.views[f"r{index}"].resident[name] = float(used)
    now = time.monotonic()
    for index, running, fresh, slots in scrapes:
        replica = pool.replicas[f"r{index}"]
        replica.engine_load = EngineLoad(1, 0, 0.1, running_adapters=frozenset(running), gpu_slots=slots)
        replica.scraped_at = now if fresh else now - 100  # far from the freshness limit either way
    for index in down:
        pool.replicas[f"r{index}"].health.up = False
    held = [pool.lease(key, ref(name) if name else None) for key, name in leases]
    decision = pool.explain("k0", adapter)
    for load in decision.snapshot:
        replica = pool.replicas[load.id]
        healthy, weight = replica.health.routing_state(time.monotonic())
        assert (load.healthy, load.weight) == (healthy, weight)
        scraped = replica.engine_load
        fresh = time.monotonic() - replica.scraped_at <= pool.scrape_fresh_s
        listed = scraped is not None and adapter in scraped.running_adapters and fresh
        slots = 1 if scraped is None else scraped.gpu_slots or 1
        gpu = adapter is None or listed or pool.residency.likely_on_gpu(load.id, adapter, slots)
        assert load.on_gpu == (healthy and gpu), load
    for lease in held:
        lease.__exit__(None, None, None)


async def test_a_cold_candidate_says_how_likely_the_adapter_its_load_pushes_out_is_wanted_again() -> None:
    """With the eviction scorer on, a replica whose set is full tells the picker how wanted its least recently used
    idle adapter is (its request rate over the reuse window, as a chance within the horizon); one with a free
    slot, or where the request's adapter is resident, says nothing."""
    routing = RoutingConfig(
        ttft_priors=PRIORS, ttft_learning_rate=0, home_reservation_s=0, eviction_horizon_s=5, reuse_window_s=30,
        scorers={"queue": 1, "regime": 1, "affinity": 1, "cold_stall": 1, "eviction": 1},
    )  # fmt: skip
    pool = predicting_pool(routing=routing)
    await pool.residency.ensure("r2", ref("busy"))
    for _ in range(30):  # "busy" is wanted: 30 requests just now (served on r2, where it is resident)
        with pool.lease("k", ref("busy")):
            pass
    for adapter in ("busy", "idle"):  # r0 full, "busy" its least recently used; r1 full, "quiet" its oldest
        await pool.residency.ensure("r0", ref(adapter))
    await pool.residency.ensure("r1", ref("quiet"))
    await pool.residency.ensure("r1", ref("idle"))
    snapshot = {r.id: r for r in pool.explain("new", "new-adapter").snapshot}
    assert snapshot["r1"].evict_loss == 0.0  # "quiet" was never asked for
    # "busy": about 30 requests over a 30 s window, shared by r0 and r2: 0.5 per second, 1 - e^-2.5 within 5 s.
    assert snapshot["r0"].evict_loss == pytest.approx(1 - math.exp(-2.5), rel=0.01)
    assert snapshot["r2"].evict_loss == 0.0  # a free slot there (max_adapters 2, one held)
    assert {r.id: r.evict_loss for r in pool.explain("k", "busy").snapshot}["r2"] == 0.0  # resident: no load
    decision = pool.explain("new", "new-adapter")
    assert decision.predictions["r0"].parts["eviction"] == pytest.approx(2 * 500 * (1 - math.exp(-2.5)), rel=0.01)
    assert decision.chosen != "r0"


def test_without_the_eviction_scorer_the_pool_reads_no_victims() -> None:
    """It is off by default (README, docs/architecture.md): a pool of the default scorers reads no victims."""
    assert "eviction" not in RoutingConfig().scorers
    pool = predicting_pool()
    assert all(r.evict_loss == 0.0 for r in pool.explain("k", "a").snapshot)


async def until_resident_on(pool: Pool, replica_id: str, name: str) -> None:
    for _ in range(5_000):  # a bounded poll: the warm-up runs in a task of its own
        if pool.residency.is_resident(replica_id, name) and not pool._warming_ahead:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"{name} was not warmed on {replica_id}")


async def test_a_hot_keys_adapter_is_warmed_ahead_in_the_background_before_its_requests_spill() -> None:
    """A key whose requests in flight reach the floor at home, where a cold replica is predicted within the cold
    margin: its requests stay where the adapter is warm, the pool loads and warms the adapter on the cold replica in
    the background (one load, one one-token request), and the key's next requests find it resident there: they
    spill warm. Up to routing.spill_warm_replicas replicas (2 here): then nothing more is warmed."""
    # Home reservations on (their default): they are what counts a key's requests in flight.
    routing = RoutingConfig(
        ttft_priors=PRIORS, ttft_learning_rate=0, capacity_floor=2, cold_margin_ms=500, spill_warm_replicas=2
    )
    pool = predicting_pool(routing=routing)
    engine = pool.residency.driver.engine  # type: ignore[attr-defined]
    home = pool.ring.preference("k")[0]
    await pool.residency.ensure(home, ADAPTER)
    leases = [pool.lease("k", ADAPTER) for _ in range(3)]
    assert [lease.replica_id for lease in leases] == [home] * 3  # warm at home, within the margin of a cold load
    ahead = [lease.decision.warm_ahead for lease in leases]
    assert ahead[:2] == [None, None] and ahead[2] not in (None, home)  # the third sees 2 in flight: the floor
    await until_resident_on(pool, ahead[2] or "", "a")
    assert engine.loads[(ahead[2], "a")] == 1
    assert [replica for replica, body in engine.warm_requests if b'"max_tokens": 1' in body] == [ahead[2]]
    assert pool.warm_aheads == 1
    with pool.lease("k", ADAPTER) as spilled:  # home has 3 in flight: the copy warmed ahead takes it, warm
        assert spilled.replica_id == ahead[2] and spilled.adapter_resident()
        more = [pool.lease("k", ADAPTER) for _ in range(4)]
        assert {lease.decision.warm_ahead for lease in more} - {None} <= {
            r for r in pool.replicas if r not in (home, ahead[2])
        }
        assert not pool._warming_ahead  # resident on 2 replicas: spill_warm_replicas, nothing more warmed
    for lease in [*leases, *more]:
        lease.__exit__(None, None, None)


@pytest.mark.parametrize("hold", [True, False], ids=["held", "hold_off"])
async def test_a_key_with_two_copies_stays_on_them_while_its_third_is_warmed_ahead(hold: bool) -> None:
    """routing.hold_copies, on by default, on the real pool: a key whose adapter is resident on two replicas, its
    requests the whole load there, never leases the third replica while its adapter is cold there, however long its
    two queues grow; the pool warms the adapter there in the background, and the key's next request spills there
    warm. With the hold off, the same requests take the third replica cold once predicted faster (as before)."""
    routing = RoutingConfig(ttft_priors=PRIORS, ttft_learning_rate=0, hold_copies=hold)
    assert RoutingConfig().hold_copies  # the default
    pool = predicting_pool(routing=routing)
    first, second, third = pool.ring.preference("k")[:3]
    await pool.residency.ensure(first, ADAPTER)
    await pool.residency.ensure(second, ADAPTER)
    leases = []
    for _ in range(150):  # up to 75 a copy: past 49, a cold load (500 ms) is predicted faster than either queue
        leases.append(pool.lease("k", ADAPTER))
        if leases[-1].replica_id == third:
            break
    if not hold:
        assert leases[-1].replica_id == third and not leases[-1].adapter_resident()
    else:
        assert {lease.replica_id for lease in leases} == {first, second}
        ahead = [lease.decision for lease in leases if lease.decision.warm_ahead is not None]
        assert ahead and all(d.warm_ahead == third and d.warm_ahead_due for d in ahead)
        await until_resident_on(pool, third, "a")
        with pool.lease("k", ADAPTER) as spilled:  # the copy warmed ahead takes it, warm
            assert spilled.replica_id == third and spilled.adapter_resident()
    for lease in leases:
        lease.__exit__(None, None, None)


async def test_a_key_held_on_its_copies_at_the_warm_up_cap_names_no_warm_up() -> None:
    """Resident on routing.spill_warm_replicas replicas (2 here), a key held on its copies names no warm-up ahead:
    Pool.warm_ahead would start none, and /admin/route would show one that never comes."""
    routing = RoutingConfig(ttft_priors=PRIORS, ttft_learning_rate=0, spill_warm_replicas=2)
    pool = predicting_pool(routing=routing)
    first, second = pool.ring.preference("k")[:2]
    await pool.residency.ensure(first, ADAPTER)
    await pool.residency.ensure(second, ADAPTER)
    leases = [pool.lease("k", ADAPTER) for _ in range(150)]
    assert {lease.replica_id for lease in leases} == {first, second}
    assert all(lease.decision.warm_ahead is None for lease in leases)
    assert pool.explain("k", "a").warm_ahead is None and not pool._warming_ahead
    for lease in leases:
        lease.__exit__(None, None, None)


async def test_warm_ups_ahead_run_one_at_a_time_in_a_pool() -> None:
    pool = predicting_pool(routing=RoutingConfig(ttft_priors=PRIORS, ttft_learning_rate=0, home_reservation_s=0))
    engine = pool.residency.driver.engine  # type: ignore[attr-defined]
    pool.warm_ahead("r1", ADAPTER)
    pool.warm_ahead("r1", ADAPTER)  # while the first runs
    pool.warm_ahead("r2", ref("b"))  # another adapter elsewhere, too: one at a time
    await until_resident_on(pool, "r1", "a")
    assert not pool.residency.is_resident("r2", "b")
    pool.warm_ahead("r1", ADAPTER)  # resident already
    assert not pool._warming_ahead
    assert engine.loads[("r1", "a")] == 1 and engine.duplicate_loads == 0 and len(engine.warm_requests) == 1


async def test_a_warm_up_ahead_that_failed_is_not_tried_on_that_replica_again_within_the_retry_window() -> None:
    """A confined key refused its cold replica asks for a warm-up there at each request (Pool._decide_confined): one
    that failed (the replica would not load the adapter) was started again by every such request, a load attempt
    and a warning each, nothing backing off. Now not on that replica for WARM_AHEAD_RETRY_S; elsewhere, and there
    after the window, it is tried."""
    pool = predicting_pool(routing=RoutingConfig(ttft_priors=PRIORS, ttft_learning_rate=0, home_reservation_s=0))
    attempts: list[str] = []

    async def refused_on_r1(replica: Endpoint, adapter: AdapterRef) -> None:
        attempts.append(replica.id)
        if replica.id == "r1":
            raise EngineUnavailable(f"{replica.id} would not load {adapter.engine_name}")

    pool.residency.driver.before_load = refused_on_r1  # type: ignore[attr-defined]
    for _ in range(3):
        pool.warm_ahead("r1", ADAPTER, due=True)
        await until(lambda: not pool._warming_ahead, lambda: "the warm-up ahead did not end")
    assert attempts == ["r1"]
    pool.warm_ahead("r2", ADAPTER, due=True)
    await until_resident_on(pool, "r2", "a")
    pool._warm_failed[("r1", "a")] -= pool_module.WARM_AHEAD_RETRY_S  # the window past
    pool.warm_ahead("r1", ADAPTER, due=True)
    await until(lambda: not pool._warming_ahead, lambda: "the warm-up ahead did not end")
    assert attempts == ["r1", "r2", "r1"]


async def test_a_warm_up_ahead_whose_load_hangs_gives_the_pool_s_one_slot_up_for_another_tenant_s() -> None:
    """The pool runs one warm-up ahead at a time. Tenant a's adapter hangs at its load on r1 (the engine never
    answers; its own bound, adapter_load_timeout_s, is 60 s): it held that one slot, and r1's lock, and tenant b's
    warm-up ahead was refused for as long as the load hung. Now a warm-up is given up after
    residency.warm_up_timeout_s and its load cancelled (no request waits for it): b's warm-up takes the slot and
    completes, on r1 itself; a is not warmed ahead again on any replica within WARM_AHEAD_RETRY_S (replica after
    replica, it would take the slot again). A load a request waits for goes on, and no warm-up ahead joins it (it
    would hold the slot again). No timing assertion: the hung load never ends on its own, so before, the slot was
    never freed (the bounded poll failed)."""
    pool = predicting_pool(routing=RoutingConfig(ttft_priors=PRIORS, ttft_learning_rate=0, home_reservation_s=0))
    pool.residency.config = pool.residency.config.model_copy(update={"warm_up_timeout_s": 0.05})
    hang = asyncio.Event()

    async def hangs_a_on_r1(replica: Endpoint, adapter: AdapterRef) -> None:
        if (replica.id, adapter.engine_name) == ("r1", "a"):
            await hang.wait()

    pool.residency.driver.before_load = hangs_a_on_r1  # type: ignore[attr-defined]
    request: asyncio.Task[bool] | None = None
    try:
        pool.warm_ahead("r1", ADAPTER, due=True)
        pool.warm_ahead("r1", ref("b"), due=True)  # while a's runs: one at a time
        assert list(pool._warming_ahead) == [("r1", "a")]
        await until(lambda: not pool._warming_ahead, lambda: "the hung warm-up ahead still holds the pool's slot")
        assert not pool.residency.load_under_way("r1", "a") and not pool.residency.is_resident("r1", "a")
        pool.warm_ahead("r2", ADAPTER, due=True)  # timed out: on no replica within the retry window
        assert not pool._warming_ahead
        pool.warm_ahead("r1", ref("b"), due=True)
        await until_resident_on(pool, "r1", "b")
        # A request waits for a's load: it is not cancelled, and a warm-up ahead does not join it.
        request = asyncio.create_task(pool.residency.ensure("r1", ADAPTER))
        await until(lambda: pool.residency.load_under_way("r1", "a"), lambda: "the request's load did not begin")
        pool._warm_failed.clear()  # past the retry window
        pool.warm_ahead("r1", ADAPTER, due=True)
        assert not pool._warming_ahead
    finally:
        hang.set()
        if request is not None:
            await request
    assert pool.residency.is_resident("r1", "a")


async def test_a_warm_up_ahead_takes_a_free_slot_or_pushes_out_only_an_adapter_idle_long_enough() -> None:
    """Where the replica's set is full, warming ahead would push out its least recently used adapter: only one no
    request has used for routing.spill_warm_idle_s is pushed out (its tenant is not back soon); one used more
    recently stays, and nothing is warmed ahead there (collide: 16 adapters in 16 slots, where a copy pushing out a
    tenant in use made it push out another), until the warm-up is due: the cold replica predicted faster outright,
    where the key would take it without the margin and push out the same adapter."""
    pool = predicting_pool(routing=RoutingConfig(ttft_priors=PRIORS, ttft_learning_rate=0, spill_warm_idle_s=5))
    residency = pool.residency
    engine = residency.driver.engine  # type: ignore[attr-defined]
    now = [1_000.0]
    residency._wall_clock = lambda: now[0]
    for name in ("b", "c"):  # r1 full (max_adapters 2), both used at 1,000 s
        await residency.ensure("r1", ref(name))
    now[0] = 1_004.0  # b and c idle 4 s: in use, by the rule
    pool.warm_ahead("r1", ADAPTER)
    assert not pool._warming_ahead and not residency.is_resident("r1", "a")
    await residency.ensure("r0", ref("b"))
    await residency.ensure("r0", ref("c"))  # r0 full too, both used just now
    pool.warm_ahead("r0", ref("e"), due=True)  # the cold replica predicted faster outright: warmed all the same
    await until_resident_on(pool, "r0", "e")
    await residency.ensure("r2", ref("b"))  # a free slot is taken whatever the others' use
    pool.warm_ahead("r2", ADAPTER)
    await until_resident_on(pool, "r2", "a")
    now[0] = 1_005.0  # r1's least recently used adapter idle 5 s: pushed out for the copy
    pool.warm_ahead("r1", ref("d"))
    await until_resident_on(pool, "r1", "d")
    assert engine.loads[("r1", "d")] == 1 and len(residency.views["r1"].resident) == 2


async def test_a_lease_that_waited_for_its_adapters_load_lets_the_loads_hold_go_at_its_first_byte() -> None:
    """The load keeps the replica's lock until the requests that waited for it started (PoolResidency._settle):
    dispatch hands the lease's ``first_byte`` to the request's record, which calls it once at the first byte; a
    lease that ends without one (an error, a whole answer) lets it go at its end. A lease that found its adapter
    resident holds nothing."""
    pool = predicting_pool()
    telemetry = Telemetry(TelemetryConfig(), GatewayMetrics())
    with pool.lease("k", ADAPTER) as lease:
        await lease.load_adapter()
        assert lease.starting and pool.residency._starting == {(lease.replica_id, "a"): 1}
        record = RequestRecord("/v1/completions", on_first_byte=lease.first_byte)
        telemetry.first_byte(record)
        telemetry.first_byte(record)  # once only
        assert not lease.starting and pool.residency._starting == {}
    with pool.lease("k", ref("b")) as lease:
        await lease.load_adapter()
        assert pool.residency._starting == {(lease.replica_id, "b"): 1}
    assert pool.residency._starting == {}
    with pool.lease("k", ADAPTER) as lease:
        assert lease.adapter_resident() and not lease.starting


def test_a_keys_first_request_keeps_its_reservation_in_its_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A key's first placement keeps one object for its candidates, where it was served and its reservation; a key
    the pool forgot while its reservation holds keeps that reservation, counted as before."""
    monkeypatch.setattr(pool_module, "_RECENT_KEYS", 2)
    pool = predicting_pool(routing=RoutingConfig(ttft_priors=PRIORS, ttft_learning_rate=0.0, home_reservation_s=2))
    with pool.lease("k0", None) as lease:
        entry = pool.keys["k0"]
        assert pool.reservations.active["k0"] is entry and (entry.home, entry.in_flight) == (lease.decision.home, 1)
    assert entry.in_flight == 0 and pool.reservations.reserved(entry.home) == 1
    for key in ("k1", "k2"):  # k0 forgotten by the pool, its reservation still held
        with pool.lease(key, None):
            pass
    assert "k0" not in pool.keys and pool.reservations.active["k0"] is entry
    held = pool.reservations.reserved(entry.home)
    with pool.lease("k0", None):  # a new entry for its candidates; its reservation is still the one it held
        assert pool.keys["k0"] is not entry and pool.reservations.active["k0"] is entry and entry.in_flight == 1
    assert pool.reservations.reserved(entry.home) == held
