"""predicted_ttft: each scorer's term, and the picker that takes the lowest predicted TTFT under the bound."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.routing.costs import Line, Regime, TtftModel, loads_ahead_ms
from gateway.routing.decision import NEW_KEY, KeyStanding, ReplicaLoad, RoutingDecision
from gateway.routing.pipeline import decide
from gateway.routing.ring import Ring
from gateway.routing.scorers import SCORERS, Candidate, ScorerSettings, Scoring, build_scoring

PRIORS: dict[Regime, Line] = {
    "warm": Line(20, 10),
    "kv_cold": Line(40, 10),
    "host": Line(70, 10),
    "cold": Line(500, 10),
}
RING = Ring(["r0", "r1", "r2"], vnodes=160)
KEY = "acme"
HOME, SECOND, THIRD = RING.preference(KEY)
SCORING = build_scoring(
    {"queue": 1.0, "regime": 1.0, "affinity": 1.0}, ScorerSettings(affinity_margin_ms=10), TtftModel(PRIORS, 0)
)


def replica(replica_id: str, load: int = 0, *, gpu: bool = True, recent: bool = False) -> ReplicaLoad:
    return ReplicaLoad(replica_id, True, load, on_gpu=gpu, key_recent=recent)


def pick(
    *fleet: ReplicaLoad, resident: frozenset[str] = frozenset(), floor: int = 8, standing: KeyStanding = NEW_KEY
) -> RoutingDecision:
    return decide(
        RING.preference(KEY),
        KEY,
        list(fleet),
        pool="p",
        policy="predicted_ttft",
        balance_factor=1.25,
        capacity_floor=floor,
        resident=resident,
        standing=standing,
        scoring=SCORING,
        explain=True,
    )


EVERYWHERE = frozenset({"r0", "r1", "r2"})


# --- the scorers, one by one -----------------------------------------------------------------------------------


def candidate(load: int, regime: Regime = "warm", *, home: bool = True) -> Candidate:
    return Candidate(replica("r0", load), regime, PRIORS[regime], home)


def test_the_queue_term_is_the_regimes_cost_per_request_times_the_load() -> None:
    queue = SCORERS["queue"](ScorerSettings())
    assert queue.score(candidate(0)) == 0
    assert queue.score(candidate(6, "cold")) == 60


def test_the_regime_term_is_the_regimes_cost_at_no_load() -> None:
    regime = SCORERS["regime"](ScorerSettings())
    assert [regime.score(candidate(3, r)) for r in ("warm", "kv_cold", "host", "cold")] == [20, 40, 70, 500]


def test_the_affinity_term_charges_every_replica_but_home() -> None:
    affinity = SCORERS["affinity"](ScorerSettings(affinity_margin_ms=15))
    assert affinity.score(candidate(0, home=True)) == 0
    assert affinity.score(candidate(0, home=False)) == 15


def test_the_cold_stall_term_charges_a_cold_load_to_every_request_already_there() -> None:
    stall = SCORERS["cold_stall"](ScorerSettings())
    assert stall.score(candidate(3, "cold")) == 1500  # 3 requests wait out a 500 ms load
    assert stall.score(candidate(0, "cold")) == 0  # an idle replica: nobody waits
    assert stall.score(candidate(3, "host")) == 0  # a swap-in does not stop the engine


def test_the_eviction_term_charges_a_cold_load_what_losing_its_victim_costs() -> None:
    eviction = SCORERS["eviction"](ScorerSettings(eviction_cost=2.0))
    wanted = Candidate(ReplicaLoad("r0", True, 3, evict_loss=0.5), "cold", PRIORS["cold"], True)
    assert eviction.score(wanted) == 500  # 2 cold loads of 500 ms, half likely
    assert eviction.score(wanted._replace(regime="host")) == 0  # resident: nothing is pushed out
    assert eviction.score(wanted._replace(replica=ReplicaLoad("r0", True, 3))) == 0  # a free slot, or nobody wants it


def test_a_cold_load_goes_where_its_victim_is_least_wanted() -> None:
    scoring = build_scoring(
        {"queue": 1, "regime": 1, "affinity": 1, "eviction": 1}, ScorerSettings(affinity_margin_ms=10),
        TtftModel(PRIORS, 0),
    )  # fmt: skip
    fleet = [ReplicaLoad(HOME, True, 0, evict_loss=0.9), ReplicaLoad(SECOND, True, 1, evict_loss=0.1),
             ReplicaLoad(THIRD, True, 0, evict_loss=0.5)]  # fmt: skip
    for explain in (False, True):  # a scorer that is not linear: both paths ask it per candidate
        decision = decide(RING.preference(KEY), KEY, fleet, pool="p", policy="predicted_ttft", balance_factor=1.25,
                          capacity_floor=8, standing=NEW_KEY, resident=frozenset(), scoring=scoring,
                          explain=explain)  # fmt: skip
        assert decision.chosen == SECOND  # one request queued there costs 10 ms; its victim's loss saves 800


def test_the_load_ahead_term_charges_a_cold_load_the_loads_it_would_wait_for_there() -> None:
    load_ahead = SCORERS["load_ahead"](ScorerSettings())
    busy = Candidate(ReplicaLoad("r0", True, 3, loads_ahead_ms=250.0), "cold", PRIORS["cold"], True)
    assert load_ahead.score(busy) == 250  # what is left of the load running there, and those queued
    assert load_ahead.score(busy._replace(regime="host")) == 0  # no load of its own: nothing to queue behind
    assert load_ahead.score(busy._replace(regime="warm")) == 0
    assert load_ahead.score(busy._replace(replica=ReplicaLoad("r0", True, 3))) == 0  # nothing loading there


def test_the_loads_ahead_are_what_is_left_of_the_running_one_and_a_load_per_queued_one() -> None:
    now = 100.0
    assert loads_ahead_ms(None, None, now, 400.0) == 0
    assert loads_ahead_ms((0, now - 0.1), None, now, 400.0) == pytest.approx(300)  # ran 100 ms of 400
    assert loads_ahead_ms((0, now - 0.5), None, now, 400.0) == 0  # overran its expected time: none left
    assert loads_ahead_ms((2, None), None, now, 400.0) == 800  # two queued, none at the engine yet
    # This gateway's queued load behind another gateway's running one (one replica, one load at a time).
    assert loads_ahead_ms((1, None), (0, now - 0.3), now, 400.0) == pytest.approx(500)
    # Both report a running load (the store's lock was down): the earlier one is what the engine runs now.
    assert loads_ahead_ms((0, now - 0.1), (1, now - 0.3), now, 400.0) == pytest.approx(500)


@pytest.mark.parametrize("explain", [False, True])
def test_a_cold_load_leaves_a_home_that_is_loading_for_an_idle_replica(explain: bool) -> None:
    """The adapter is cold everywhere; the home has a load running with 300 ms left: without the term the home
    wins (the affinity margin), with it the idle replica does (its 10 ms margin against 300 ms of waiting)."""
    fleet = [
        ReplicaLoad(HOME, True, 1, loads_ahead_ms=300.0),
        ReplicaLoad(SECOND, True, 1),
        ReplicaLoad(THIRD, True, 1, loads_ahead_ms=50.0),
    ]
    for weights, chosen in (
        ({"queue": 1, "regime": 1, "affinity": 1, "cold_stall": 1}, HOME),
        ({"queue": 1, "regime": 1, "affinity": 1, "cold_stall": 1, "load_ahead": 1}, SECOND),
    ):
        scoring = build_scoring(weights, ScorerSettings(affinity_margin_ms=10), TtftModel(PRIORS, 0))
        decision = decide(RING.preference(KEY), KEY, fleet, pool="p", policy="predicted_ttft", balance_factor=1.25,
                          capacity_floor=8, standing=NEW_KEY, resident=frozenset(), scoring=scoring,
                          explain=explain)  # fmt: skip
        assert decision.chosen == chosen
        assert decision.predictions[chosen].regime == "cold"


def test_the_load_ahead_term_never_moves_a_request_whose_adapter_is_warm() -> None:
    """Warm at home with a load running there (another adapter's): the term prices cold loads only."""
    scoring = build_scoring(
        {"queue": 1, "regime": 1, "affinity": 1, "cold_stall": 1, "load_ahead": 1},
        ScorerSettings(affinity_margin_ms=10),
        TtftModel(PRIORS, 0),
    )
    fleet = [ReplicaLoad(HOME, True, 1, on_gpu=True, loads_ahead_ms=5_000.0), ReplicaLoad(SECOND, True, 0),
             ReplicaLoad(THIRD, True, 0)]  # fmt: skip
    decision = decide(RING.preference(KEY), KEY, fleet, pool="p", policy="predicted_ttft", balance_factor=1.25,
                      capacity_floor=8, standing=NEW_KEY, resident=frozenset(), scoring=scoring)  # fmt: skip
    assert decision.chosen == HOME


def test_an_unknown_scorer_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown scorers"):
        build_scoring({"queue": 1, "vibes": 2}, ScorerSettings(), TtftModel(PRIORS, 0))


def test_weights_scale_each_term_and_zero_drops_it() -> None:
    scoring = build_scoring({"queue": 2.0, "regime": 1.0, "affinity": 0.0}, ScorerSettings(), TtftModel(PRIORS, 0))
    assert [name for name, _, _ in scoring.terms] == ["queue", "regime"]
    decision = decide(
        [HOME, SECOND],
        KEY,
        [replica(HOME, 2, recent=True), replica(SECOND, 0, recent=True)],
        pool="p",
        policy="predicted_ttft",
        balance_factor=1.25,
        capacity_floor=8,
        scoring=scoring,
        explain=True,
    )
    assert decision.predictions[HOME].parts == {"queue": 40.0, "regime": 20.0}


# --- the picker -----------------------------------------------------------------------------------------------


def test_an_idle_fleet_keeps_the_key_home() -> None:
    decision = pick(replica(HOME), replica(SECOND), replica(THIRD), resident=EVERYWHERE)
    assert decision.chosen == HOME and decision.reasons == ["home"]
    assert set(decision.predictions) == {HOME, SECOND, THIRD}
    assert decision.predictions[HOME].total_ms == 40  # kv_cold at no load
    assert decision.predictions[SECOND].parts == {"queue": 0.0, "regime": 40.0, "affinity": 10.0}


def test_a_busy_home_under_the_bound_is_left_for_a_faster_replica() -> None:
    # home: 5 ahead x 10 ms + 40 = 90 ms; second: 0 ahead + 40 + 10 margin = 50 ms. The bound (floor 8) allows both.
    decision = pick(replica(HOME, 5), replica(SECOND), replica(THIRD, 3), resident=EVERYWHERE)
    assert decision.capacity == 8 and "over_capacity" not in decision.excluded.values()
    assert decision.chosen == SECOND
    assert decision.reasons == ["spill:faster"]


def test_leaving_home_must_pay_more_than_the_margin() -> None:
    # home: 1 ahead = 50 ms; second: 40 + 10 margin = 50 ms: a tie stays home
    decision = pick(replica(HOME, 1), replica(SECOND), replica(THIRD), resident=EVERYWHERE)
    assert decision.chosen == HOME


def test_a_cold_adapter_is_worth_a_long_queue_elsewhere() -> None:
    # home: adapter not resident, idle: 500 ms; second: resident on the GPU with 20 ahead: 40 + 200 + 10 = 250 ms
    decision = pick(
        replica(HOME, gpu=False), replica(SECOND, 20), replica(THIRD, gpu=False), resident=frozenset({SECOND}), floor=30
    )
    assert decision.predictions[HOME].regime == "cold"
    assert decision.chosen == SECOND and decision.reasons == ["spill:faster"]


def test_a_warm_prefix_beats_a_cold_one_by_its_cost() -> None:
    decision = pick(replica(HOME, 2), replica(SECOND, recent=True), replica(THIRD), resident=EVERYWHERE)
    # home: 20 + 40 = 60; second (warm): 20 + 10 = 30; third (kv_cold): 40 + 10 = 50
    assert decision.chosen == SECOND
    assert decision.predictions[SECOND].regime == "warm"


def test_the_fastest_replica_over_the_bound_is_never_taken_while_a_warm_one_is_under_it() -> None:
    # floor 1, loads 6/0/0: cap ceil(1.25 x 7/3) = 3; home is over it whatever it would predict
    decision = pick(
        replica(HOME, 6, recent=True),
        replica(SECOND, gpu=False),
        replica(THIRD, gpu=False),
        resident=frozenset({HOME, SECOND}),
        floor=1,
    )
    assert decision.excluded[HOME] == "over_capacity"
    assert HOME not in decision.predictions
    assert decision.chosen == SECOND and decision.reasons == ["spill:over_capacity"]


def test_the_bound_never_forces_a_cold_load() -> None:
    # Home is over the cap (3) but the adapter is cold everywhere under it: home competes, and 6 ahead x 10 ms +
    # 20 (warm) = 80 ms beats 500 ms + a cold load elsewhere.
    decision = pick(replica(HOME, 6, recent=True), replica(SECOND, gpu=False), replica(THIRD, gpu=False), floor=1)
    assert "over_capacity" not in decision.excluded.values()
    assert decision.chosen == HOME and decision.reasons == ["home"]
    # ... until waiting there costs more than loading elsewhere: 60 ahead = 620 ms against 510 ms
    decision = pick(replica(HOME, 60, recent=True), replica(SECOND, gpu=False), replica(THIRD, gpu=False), floor=1)
    assert decision.chosen == SECOND and decision.predictions[SECOND].regime == "cold"


# --- a cold replica against a warm one: the cold margin and warming ahead (issue 19) ----------------------------

MARGIN = build_scoring(
    {"queue": 1.0, "regime": 1.0, "affinity": 1.0},
    ScorerSettings(affinity_margin_ms=10, cold_margin_ms=500),
    TtftModel(PRIORS, 0),
)
LIGHT_KEY = KeyStanding(in_flight=2)  # the floor below is 8
HOT_KEY = KeyStanding(in_flight=-1)  # ``choose``: every request at home is the key's


def choose(
    home_load: int, standing: KeyStanding, scoring: Scoring = MARGIN, explain: bool = False, cold_load: int = 0
) -> RoutingDecision:
    """Home warm with ``home_load`` ahead (20 + 10 x load ms), the adapter cold on the two others (510 ms + 10 x
    ``cold_load``)."""
    if standing is HOT_KEY:
        standing = KeyStanding(in_flight=home_load)
    fleet = [
        replica(HOME, home_load, recent=True),
        replica(SECOND, cold_load, gpu=False),
        replica(THIRD, cold_load + 1, gpu=False),
    ]
    return decide(RING.preference(KEY), KEY, fleet, pool="p", policy="predicted_ttft", balance_factor=1.25,
                  capacity_floor=8, resident=frozenset({HOME}), standing=standing, scoring=scoring,
                  explain=explain)  # fmt: skip


@pytest.mark.parametrize("explain", [False, True], ids=["table", "per_scorer"])
def test_a_hot_key_waits_where_its_adapter_is_warm_and_has_it_warmed_where_a_cold_load_was_faster(
    explain: bool,
) -> None:
    """A key whose requests in flight fill the floor of every replica where its adapter is warm does not take a
    cold replica predicted faster by less than the cold margin: it stays warm, and the decision names the cold
    replica to warm the adapter on in the background (before the key's requests spill there)."""
    decision = choose(60, HOT_KEY, explain=explain)  # home 620 ms, second 510 ms: faster, by less than 500 ms
    assert decision.chosen == HOME and decision.warm_ahead == SECOND
    assert decision.warm_ahead_due  # faster outright: without the margin the key would take it now
    decision = choose(10, HOT_KEY, explain=explain)  # home 120 ms: the cold one within the margin of it (620 ms)
    assert decision.chosen == HOME and decision.warm_ahead == SECOND and not decision.warm_ahead_due
    decision = choose(110, HOT_KEY, explain=explain)  # home 1,120 ms: the cold one wins by more than the margin
    assert decision.chosen == SECOND and decision.predictions[SECOND].regime == "cold" and decision.warm_ahead is None
    decision = choose(10, HOT_KEY, explain=explain, cold_load=20)  # the cold ones 710 ms: beyond it, nothing warmed
    assert decision.chosen == HOME and decision.warm_ahead is None


@pytest.mark.parametrize(
    "standing",
    [LIGHT_KEY, KeyStanding(in_flight=20)],
    ids=["under_the_floor", "under_two_thirds_of_the_load"],
)
def test_a_key_that_is_not_hot_spills_cold_when_faster_as_before(standing: KeyStanding) -> None:
    """A key under the floor, or one whose requests are under two thirds of the load where its adapter is warm
    (heavy keys sharing a replica: the scheduler's spills spread them), takes the cold replica predicted faster,
    whatever the margin, and warms nothing ahead: a copy warmed for it on a full replica would evict an adapter
    another tenant still wants."""
    decision = choose(60, standing)
    assert decision.chosen == SECOND and decision.warm_ahead is None
    decision = choose(45, standing)
    assert decision.chosen == HOME and decision.warm_ahead is None


def test_without_a_cold_margin_a_hot_key_spills_as_before() -> None:
    scoring = build_scoring({"queue": 1.0, "regime": 1.0, "affinity": 1.0}, ScorerSettings(affinity_margin_ms=10),
                            TtftModel(PRIORS, 0))  # fmt: skip
    decision = choose(60, HOT_KEY, scoring)
    assert decision.chosen == SECOND and decision.warm_ahead is None


HOLD = build_scoring(
    {"queue": 1.0, "regime": 1.0, "affinity": 1.0},
    ScorerSettings(affinity_margin_ms=10, hold_copies=True),
    TtftModel(PRIORS, 0),
)


def copies(load: int, standing: KeyStanding, scoring: Scoring = HOLD, explain: bool = False) -> RoutingDecision:
    """The adapter warm on home and on the second replica, ``load`` ahead on each (20 + 10 x load ms, the second
    10 ms more off home), cold on the third (510 ms + 10 ms off home)."""
    fleet = [replica(HOME, load, recent=True), replica(SECOND, load, recent=True), replica(THIRD, 0, gpu=False)]
    return decide(RING.preference(KEY), KEY, fleet, pool="p", policy="predicted_ttft", balance_factor=1.25,
                  capacity_floor=8, resident=frozenset({HOME, SECOND}), standing=standing, scoring=scoring,
                  explain=explain)  # fmt: skip


@pytest.mark.parametrize("explain", [False, True], ids=["table", "per_scorer"])
@pytest.mark.parametrize("standing", [KeyStanding(in_flight=120), KeyStanding(in_flight=2)], ids=["hot", "light"])
def test_a_key_with_two_copies_takes_no_cold_replica_and_has_its_next_warmed(
    explain: bool, standing: KeyStanding
) -> None:
    """routing.hold_copies: a key whose adapter is warm on two replicas stays on them however much faster a cold
    replica is predicted, whatever its share of their load, and the decision names that replica to warm the adapter
    on, due (issue 19's hot trace: the hot tenant's third copy loaded on the request path, its streams waiting for
    that load; a first build that held only keys two thirds of the load missed it at 14 of 25)."""
    decision = copies(60, standing, explain=explain)  # warm 620 ms, cold 520 ms: faster outright
    assert decision.chosen == HOME and decision.warm_ahead == THIRD and decision.warm_ahead_due
    decision = copies(200, standing, explain=explain)  # warm 2,020 ms: still no cold load
    assert decision.chosen == HOME and decision.warm_ahead == THIRD and decision.warm_ahead_due
    decision = copies(40, standing, explain=explain)  # warm 420 ms: the cold one slower, no warm-up
    assert decision.chosen == HOME and decision.warm_ahead is None


def test_without_the_hold_a_key_with_two_copies_spills_cold_when_faster() -> None:
    """With ``hold_copies`` off, the cold replica predicted faster is taken, as before."""
    plain = build_scoring({"queue": 1.0, "regime": 1.0, "affinity": 1.0}, ScorerSettings(affinity_margin_ms=10),
                          TtftModel(PRIORS, 0))  # fmt: skip
    decision = copies(60, KeyStanding(in_flight=120), plain)
    assert decision.chosen == THIRD and decision.warm_ahead is None


def test_one_copy_is_not_held_its_first_spill_loads_the_second() -> None:
    """With the adapter warm on one replica only, the hold does not apply: a hot key's first spill loads its
    second copy on the request path when faster (the bar counts from the second copy warm)."""
    decision = choose(60, HOT_KEY, HOLD)
    assert decision.chosen == SECOND and decision.warm_ahead is None


def test_a_key_holding_its_reservation_may_take_its_home_over_the_bound() -> None:
    standing = KeyStanding(in_flight=2, holds_reservation=True)
    decision = pick(replica(HOME, 6, recent=True), replica(SECOND, 5), replica(THIRD, 5), floor=1, standing=standing)
    assert HOME in decision.predictions and HOME not in decision.excluded


def test_an_unhealthy_home_is_never_scored() -> None:
    decision = pick(
        ReplicaLoad(HOME, False, 0, on_gpu=True, key_recent=True), replica(SECOND), replica(THIRD), resident=EVERYWHERE
    )
    assert decision.excluded[HOME] == "unhealthy" and HOME not in decision.predictions
    assert decision.reasons[0] == "spill:unhealthy"


def test_a_requests_own_decision_keeps_the_chosen_prediction_and_explain_keeps_every_part() -> None:
    fleet = [replica(HOME, 5), replica(SECOND), replica(THIRD, 3)]
    explained = pick(*fleet, resident=EVERYWHERE)
    placed = decide(RING.preference(KEY), KEY, fleet, pool="p", policy="predicted_ttft", balance_factor=1.25,
                    capacity_floor=8, resident=EVERYWHERE, scoring=SCORING)  # fmt: skip
    assert placed.chosen == explained.chosen == SECOND
    assert placed.predictions == {SECOND: explained.predictions[SECOND]._replace(parts={})}
    assert set(explained.predictions) == {HOME, SECOND, THIRD}
    assert all(p.parts for p in explained.predictions.values())


class _Square:
    """A scorer that is not linear in the load (so decisions ask it per candidate)."""

    def score(self, candidate: Candidate) -> float:
        return float(candidate.replica.in_flight**2)


_FLEETS = st.lists(
    st.tuples(st.integers(0, 12), st.booleans(), st.booleans(), st.booleans(), st.booleans()), min_size=3, max_size=3
)


@settings(max_examples=300, deadline=None)
@given(
    fleet=_FLEETS,
    weights=st.tuples(*[st.sampled_from([0.0, 0.5, 1.0, 2.0])] * 4),
    learned=st.integers(0, 5),
    cold_margin=st.sampled_from([0.0, 50.0, 500.0]),
    in_flight=st.sampled_from([1, 4, 8, 40]),
    hold=st.booleans(),
)
def test_the_summed_linear_table_decides_as_asking_each_scorer_would(
    fleet: list[tuple[int, bool, bool, bool, bool]],
    weights: tuple[float, ...],
    learned: int,
    cold_margin: float,
    in_flight: int,
    hold: bool,
) -> None:
    """The linear table (a request's own decision) and the per-scorer path (explain) agree on the choice and its
    total, whatever the weights, loads and regimes, and after the model has moved its lines."""
    names = ("queue", "regime", "affinity", "cold_stall")
    model = TtftModel(PRIORS, 0.3)
    for i in range(learned):  # the table follows the model's lines as they move
        model.observe("cold" if i % 2 else "warm", i, 100.0 * i)
    settings_ = ScorerSettings(affinity_margin_ms=10, cold_margin_ms=cold_margin, hold_copies=hold)
    scoring = build_scoring(dict(zip(names, weights, strict=True)), settings_, model)
    loads = [
        ReplicaLoad(r, True, load, on_gpu=gpu, key_recent=recent)
        for r, (load, gpu, recent, _, _) in zip(RING.preference(KEY), fleet, strict=True)
    ]
    resident = frozenset(r for r, (_, _, _, here, _) in zip(RING.preference(KEY), fleet, strict=True) if here)
    holds = KeyStanding(in_flight, holds_reservation=fleet[0][4])
    common = {"pool": "p", "policy": "predicted_ttft", "balance_factor": 1.25, "capacity_floor": 4,
              "resident": resident, "standing": holds, "scoring": scoring}  # fmt: skip
    placed = decide(RING.preference(KEY), KEY, loads, **common)  # type: ignore[arg-type]
    explained = decide(RING.preference(KEY), KEY, loads, explain=True, **common)  # type: ignore[arg-type]
    assert placed.chosen == explained.chosen
    assert placed.reasons == explained.reasons and placed.excluded == explained.excluded
    assert placed.warm_ahead == explained.warm_ahead and placed.warm_ahead_due == explained.warm_ahead_due
    chosen = placed.predictions[placed.chosen or ""]
    assert chosen.regime == explained.predictions[placed.chosen or ""].regime
    assert chosen.total_ms == pytest.approx(explained.predictions[placed.chosen or ""].total_ms)


def test_a_scorer_that_is_not_linear_is_asked_per_candidate() -> None:
    scoring = Scoring((("square", 1.0, _Square()),), TtftModel(PRIORS, 0))
    assert scoring.table() is None
    fleet = [replica(HOME, 3), replica(SECOND, 1), replica(THIRD, 2)]
    decision = decide(RING.preference(KEY), KEY, fleet, pool="p", policy="predicted_ttft", balance_factor=1.25,
                      capacity_floor=8, resident=EVERYWHERE, scoring=scoring)  # fmt: skip
    assert decision.chosen == SECOND
    assert {r: p.total_ms for r, p in decision.predictions.items()} == {HOME: 9.0, SECOND: 1.0, THIRD: 4.0}


def test_a_replica_of_the_keys_placement_set_pays_no_affinity_margin() -> None:
    """Placement gave the key a second replica (a hot adapter replicated): leaving home for it needs no margin,
    so the lighter of the two takes the request; a replica outside the set still pays the margin."""
    fleet = [replica(HOME, 1), replica(SECOND), replica(THIRD)]
    common = {"pool": "p", "policy": "predicted_ttft", "balance_factor": 1.25, "capacity_floor": 8,
              "resident": EVERYWHERE, "scoring": SCORING}  # fmt: skip
    alone = decide(RING.preference(KEY), KEY, fleet, **common)  # type: ignore[arg-type]
    assert alone.chosen == HOME  # 40 + 10 ms of queue at home, 40 + the 10 ms margin elsewhere: a tie stays home
    shared = decide(RING.preference(KEY), KEY, fleet, also_home=frozenset({SECOND}), **common)  # type: ignore[arg-type]
    assert shared.chosen == SECOND and shared.predictions[SECOND].total_ms == 40.0  # kv_cold, no margin
    explained = decide(RING.preference(KEY), KEY, fleet, also_home=frozenset({SECOND}), explain=True, **common)  # type: ignore[arg-type]
    assert explained.predictions[SECOND].parts["affinity"] == 0.0
    assert explained.predictions[THIRD].parts["affinity"] == 10.0
