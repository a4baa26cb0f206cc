"""Spills kept on a key's planned replicas (gateway/fleet/plan_bound.py) in the real pool: below the queue bound a
request takes its planned replicas only, even where its adapter is warm elsewhere; past it a replica off the set
competes only where it pushes out no planned adapter still in use, and wins only by the margin."""

from __future__ import annotations

import time

from gateway.config import RoutingConfig
from gateway.fleet.plan_bound import PlanBound
from gateway.fleet.pool import Pool
from tests.gateway.fleet.test_pool_properties import pool_of
from tests.gateway.fleet.test_predicted_pool import ADAPTER, PRIORS, until_resident_on


def planned_pool(margin_ms: float = 100.0) -> Pool:
    """Three replicas of 2 slots; key k (adapter a) planned on r0; r1 holds two other keys' planned adapters."""
    routing = RoutingConfig(ttft_priors=PRIORS, ttft_learning_rate=0.0, home_reservation_s=0)
    pool = pool_of(3, routing, policy="predicted_ttft")
    pool.plan_bound = PlanBound(queue=8, margin_ms=margin_ms, idle_s=5.0)
    pool.ring.install({"k": ("r0",), "x": ("r1",), "y": ("r1",)})
    pool.residency.plan = {"r0": frozenset({"a"}), "r1": frozenset({"x", "y"}), "r2": frozenset()}
    return pool


def hold(pool: Pool, replica_id: str, name: str, idle_s: float = 0.0) -> None:
    pool.residency.views[replica_id].resident[name] = time.time() - idle_s
    pool.residency._sets_changed()


def test_below_the_queue_bound_a_request_stays_on_its_planned_replicas() -> None:
    pool = planned_pool()
    hold(pool, "r2", "a")  # a stray copy, warm, off the plan
    assert pool.explain("k", "a").chosen == "r0"  # cold at home, but planned
    pool.plan_bound = None
    assert pool.explain("k", "a").chosen == "r2"  # unconfined, the warm copy wins (the code before)


def test_past_the_bound_an_off_set_replica_wins_by_the_margin_where_it_pushes_out_nothing_in_use() -> None:
    pool = planned_pool()
    hold(pool, "r0", "a")
    hold(pool, "r1", "x")
    hold(pool, "r1", "y")  # r1 full of planned adapters used just now
    pool.replicas["r0"].in_flight = 8  # the bound: 8 in flight on every planned replica
    assert pool.explain("k", "a").chosen == "r0"  # r2 cold (500 ms) against r0 warm at 8 (about 120 ms)
    pool.replicas["r0"].in_flight = 60  # r0 about 640 ms; r2 cold about 510 ms: faster by more than 100 ms
    pool.replicas["r2"].in_flight = 30  # now r2 about 810 ms, r1 idle would be 510 ms: but it pushes out x or y
    assert pool.explain("k", "a").chosen == "r0"
    hold(pool, "r1", "y", idle_s=60.0)  # y idle for a minute: r1 may take the load
    assert pool.explain("k", "a").chosen == "r1"
    wide = planned_pool(margin_ms=200.0)
    hold(wide, "r0", "a")
    wide.replicas["r0"].in_flight = 60
    assert wide.explain("k", "a").chosen == "r0"  # 130 ms faster is within a 200 ms margin
    wide.replicas["r0"].in_flight = 80
    assert wide.explain("k", "a").chosen != "r0"


def test_a_request_whose_planned_replicas_are_down_or_avoided_is_not_confined() -> None:
    pool = planned_pool()
    hold(pool, "r2", "a")
    assert pool.place("k", "a", avoid=("r0",)).chosen == "r2"
    pool.replicas["r0"].health.probed(False)
    pool.replicas["r0"].health.probed(False)
    pool.replicas["r0"].health.probed(False)
    assert not pool.is_healthy("r0")
    assert pool.explain("k", "a").chosen == "r2"


def test_a_copy_off_the_set_is_not_used_where_the_adapters_planned_there_fill_the_slots() -> None:
    """collide: a heavy key moved by the plan kept using its copy at the old home, where the light keys planned
    there then had one slot fewer than they needed."""
    pool = planned_pool()
    pool.residency.plan["r2"] = frozenset({"p", "q"})
    hold(pool, "r1", "x")
    hold(pool, "r1", "y")
    hold(pool, "r0", "a")
    hold(pool, "r2", "a")  # the copy at the old home, warm: 50 ms against r0's 640
    pool.replicas["r0"].in_flight = 60
    assert pool.explain("k", "a").chosen == "r0"
    pool.residency.plan["r2"] = frozenset({"p"})  # a slot beside the planned adapter: the copy may serve
    assert pool.explain("k", "a").chosen == "r2"


def test_a_request_whose_planned_replicas_are_at_their_cap_is_not_confined() -> None:
    """docs/architecture.md, Spills kept on the plan: planned replicas at limits.max_in_flight_per_replica leave the
    request unconfined (confined, it had only replicas it may not take: no replica at all)."""
    pool = planned_pool()
    hold(pool, "r2", "a")
    pool.replicas["r0"].in_flight = pool.max_in_flight_per_replica
    assert pool.explain("k", "a").chosen == "r2"
    assert pool.place("k", "a").chosen == "r2"


def test_an_unplanned_key_goes_where_its_adapter_is_or_a_load_pushes_out_no_planned_adapter_in_use() -> None:
    """A key whose planned slot paid for a heavy key's copy (placement's unplanned keys): its adapter is loaded on
    demand, on a replica where that pushes out no planned adapter a request used within idle_s."""
    pool = planned_pool()
    pool.ring.install({"k": ("r1",), "x": ("r1",), "y": ("r1",)})  # k's set names r1, full of planned adapters
    pool.unplanned = frozenset({"k"})
    hold(pool, "r1", "x")
    hold(pool, "r1", "y")
    hold(pool, "r0", "p")
    hold(pool, "r0", "q")
    pool.residency.plan["r0"] = frozenset({"p", "q"})
    hold(pool, "r2", "s")
    hold(pool, "r2", "t")  # r2 full too, of adapters planned nowhere
    assert pool.explain("k", "a").chosen == "r2"  # the only one where its load pushes out no planned adapter
    hold(pool, "r0", "a")
    assert pool.explain("k", "a").chosen in ("r0", "r2")  # resident on r0 now: that may serve too
    pool.unplanned = frozenset()
    assert pool.explain("k", "a").chosen == "r1"  # planned there: confined to its set below the bound


def test_with_the_pools_seats_stated_a_spill_may_leave_once_every_planned_replica_runs_that_many() -> None:
    pool = planned_pool()
    pool.plan_bound = PlanBound(queue=0, margin_ms=100.0, idle_s=5.0)  # 0: the pool's seats, else capacity_floor
    hold(pool, "r0", "a")
    pool.replicas["r0"].in_flight = 60  # r0 about 640 ms; r2 cold about 510 ms, and free
    pool.seats = 64
    assert pool.explain("k", "a").chosen == "r0"  # below the seats: the planned replica only
    pool.seats = 4
    assert pool.explain("k", "a").chosen == "r2"
    pool.seats, pool.capacity_floor = 0, 100
    assert pool.explain("k", "a").chosen == "r0"  # not stated: the capacity floor bounds it


def test_with_seats_stated_a_planned_replica_far_over_them_may_push_out_a_planned_adapter_in_use() -> None:
    """collide (docs/benchmarks.md, 2026-12-02 morning): with every off-set slot holding a planned adapter in use,
    the two heavy keys confined to the home they shared queued 39 deep there while the other replicas ran 0-2. Where
    the pool states its seats, such a replica competes too, taken when predicted faster than the best planned one
    by the margin plus one adapter load (what the neighbour pushed out pays at its next request)."""
    pool = planned_pool()
    pool.plan_bound = PlanBound(queue=0, margin_ms=100.0, idle_s=5.0)
    pool.residency.plan["r2"] = frozenset({"p", "q"})
    for replica_id, names in (("r0", ("a",)), ("r1", ("x", "y")), ("r2", ("p", "q"))):
        for name in names:
            hold(pool, replica_id, name)  # every slot off the set: a planned adapter used just now
    pool.seats = 4
    load_ms = pool.residency.load_ms  # 460 ms from these priors (cold 500 less kv_cold 40)
    pool.replicas["r0"].in_flight = 60  # r0 about 620 ms; r1 cold about 510 ms: faster, by less than 100 + 460
    assert pool.explain("k", "a").chosen == "r0"
    pool.replicas["r0"].in_flight = 60 + int((100 + load_ms) / 10)  # now faster by more than the margin and a load
    assert pool.explain("k", "a").chosen in ("r1", "r2")
    assert pool.place("k", "a").chosen in ("r1", "r2")
    pool.seats = 0  # not stated: a queue cannot be told from a batch, the bound stays as it was
    assert pool.explain("k", "a").chosen == "r0"


async def test_a_key_with_a_second_home_leaving_for_a_cold_replica_warms_it_there_and_stays_meanwhile() -> None:
    """The hot trace (issue 19): the hot tenant's first spill loaded its second home; past the bound on both, its
    requests left them for a third replica where its adapter was cold, and each waited for that load on the request
    path (6-7 of its streams a seed, seconds before the plan's first look at it). A key whose adapter already has a
    second home (planned, or warm where a spill loaded it) stays on its planned replicas instead, its adapter is
    warmed on that replica in the background, and its next requests leave warm. A key with one copy leaves as
    before: its first spill loads its second home (above)."""
    pool = planned_pool()
    pool.ring.install({"k": ("r0", "r1"), "x": ("r1",)})
    pool.residency.plan = {"r0": frozenset({"a"}), "r1": frozenset({"a", "x"}), "r2": frozenset()}
    hold(pool, "r0", "a")
    hold(pool, "r1", "a")
    hold(pool, "r1", "x")
    pool.replicas["r0"].in_flight = pool.replicas["r1"].in_flight = 60  # about 640 ms; r2 cold and free: 510 ms
    decision = pool.explain("k", "a")
    assert decision.chosen in ("r0", "r1") and (decision.warm_ahead, decision.warm_ahead_due) == ("r2", True)
    with pool.lease("k", ADAPTER) as stayed:
        assert stayed.replica_id in ("r0", "r1")  # not on r2 while the adapter loads there
        await until_resident_on(pool, "r2", "a")
    assert pool.warm_aheads == 1
    with pool.lease("k", ADAPTER) as left:  # warm on r2 now: it leaves for it, no load on its path
        assert left.replica_id == "r2" and left.adapter_resident()
    # Planned on r0 alone, its adapter warm on r1 too (its first spill loaded it there; r1 busy now): the same.
    pool.ring.install({"k": ("r0",), "x": ("r1",)})
    pool.residency.plan = {"r0": frozenset({"a"}), "r1": frozenset({"x"}), "r2": frozenset()}
    pool.residency.views["r2"].resident.clear()
    pool.residency._sets_changed()
    decision = pool.explain("k", "a")
    assert decision.chosen == "r0" and decision.warm_ahead == "r2"
    # One copy (r0's) and nothing else: its first spill takes the cold r2 as before.
    pool.residency.views["r1"].resident.pop("a")
    pool.residency._sets_changed()
    decision = pool.explain("k", "a")
    assert decision.chosen == "r2" and decision.warm_ahead is None


def test_a_key_refused_a_cold_replica_takes_the_best_of_the_rest_a_warm_copy_off_the_set_included() -> None:
    """The cold replica off the set is warmed ahead, not taken; a replica off the set where the adapter is warm
    still competes for the request by the margin, as before."""
    routing = RoutingConfig(ttft_priors=PRIORS, ttft_learning_rate=0.0, home_reservation_s=0)
    pool = pool_of(4, routing, policy="predicted_ttft")
    pool.spill_warm_replicas = 4  # a fourth copy may be warmed ahead (at the cap none is: the test below)
    pool.plan_bound = PlanBound(queue=8, margin_ms=100.0, idle_s=5.0)
    pool.ring.install({"k": ("r0", "r1")})
    pool.residency.plan = {"r0": frozenset({"a"}), "r1": frozenset({"a"}), "r2": frozenset(), "r3": frozenset()}
    for replica_id in ("r0", "r1", "r3"):
        hold(pool, replica_id, "a")  # r3: a copy an earlier spill loaded
    pool.replicas["r0"].in_flight = pool.replicas["r1"].in_flight = 60  # about 640 ms; r2 cold and free: 510 ms
    pool.replicas["r3"].in_flight = 48  # warm, about 520 ms: slower than r2, faster than r0 by more than 100 ms
    decision = pool.explain("k", "a")
    assert (decision.chosen, decision.warm_ahead) == ("r3", "r2")
    pool.replicas["r3"].in_flight = 58  # within the margin of r0: the planned replicas keep it
    decision = pool.explain("k", "a")
    assert decision.chosen in ("r0", "r1") and decision.warm_ahead == "r2"


def test_a_key_resident_on_spill_warm_replicas_replicas_stays_on_its_copies_and_no_warm_up_is_named() -> None:
    """At warm_ahead's cap (the adapter resident on routing.spill_warm_replicas replicas) no warm-up ahead starts, so
    the key's spills make no copy more: refused the cold replica, it stays on its copies, and the decision names no
    warm-up (it named one that never came, on /admin/route too). Taking the cold fourth instead cost the hot trace's
    hot tenant 6 cold streams after its second home was warm (seed 19)."""
    routing = RoutingConfig(ttft_priors=PRIORS, ttft_learning_rate=0.0, home_reservation_s=0, spill_warm_replicas=3)
    pool = pool_of(4, routing, policy="predicted_ttft")
    pool.plan_bound = PlanBound(queue=8, margin_ms=100.0, idle_s=5.0)
    pool.ring.install({"k": ("r0", "r1")})
    pool.residency.plan = {"r0": frozenset({"a"}), "r1": frozenset({"a"}), "r2": frozenset(), "r3": frozenset()}
    for replica_id in ("r0", "r1", "r3"):
        hold(pool, replica_id, "a")  # r3: a copy an earlier spill loaded; three copies, the cap
        pool.replicas[replica_id].in_flight = 60  # about 640 ms each; r2 cold and free: 510 ms
    decision = pool.explain("k", "a")
    assert decision.chosen in ("r0", "r1", "r3") and (decision.warm_ahead, decision.warm_ahead_due) == (None, False)
    with pool.lease("k", ADAPTER) as lease:
        assert lease.replica_id in ("r0", "r1", "r3") and not pool._warming_ahead
