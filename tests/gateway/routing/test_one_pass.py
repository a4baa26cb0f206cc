"""The plain case's one pass (gateway/routing/one_pass.py) decides as the general pipeline does, whatever the
snapshot, and it is what a request's own decision takes when every candidate is up, at full weight and under the
bound."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.routing.costs import Line, Regime, TtftModel
from gateway.routing.decision import KeyStanding, ReplicaLoad
from gateway.routing.one_pass import decide_plain
from gateway.routing.pipeline import decide
from gateway.routing.ring import Ring
from gateway.routing.scorers import ScorerSettings, build_scoring

PRIORS: dict[Regime, Line] = {
    "warm": Line(20, 10),
    "kv_cold": Line(40, 10),
    "host": Line(70, 10),
    "cold": Line(500, 10),
}
RING = Ring([f"r{i}" for i in range(8)], vnodes=40)
KEY = "acme"
ORDER = RING.preference(KEY)

# Mostly plain (up, full weight, under the cap), with loads near the bound: where the two paths could part.
_REPLICA = st.tuples(
    st.integers(0, 6),  # in flight
    st.integers(0, 2),  # reserved
    st.sampled_from([True] * 9 + [False]),  # healthy
    st.sampled_from([1.0] * 9 + [0.5]),  # weight
    st.sampled_from([False] * 9 + [True]),  # at the per-replica cap
    st.booleans(),  # on the GPU
    st.booleans(),  # the key recent there
    st.booleans(),  # resident there
)


@settings(max_examples=1000, deadline=None)
@given(
    policy=st.sampled_from(["bounded_consistent_hash", "predicted_ttft"]),
    fleet=st.lists(_REPLICA, min_size=1, max_size=8),
    standing=st.tuples(st.sampled_from([0, 1, 2, 3, 8, 16]), st.booleans()),
    floor=st.sampled_from([1, 2, 8]),
    also_home=st.sets(st.sampled_from(ORDER), max_size=2),
    weights=st.tuples(*[st.sampled_from([0.0, 1.0, 2.0])] * 4),
    learned=st.integers(0, 4),
    cold_margin=st.sampled_from([0.0, 50.0, 500.0]),
)
def test_the_one_pass_decides_as_the_general_pipeline(
    policy: str,
    fleet: list[tuple[int, int, bool, float, bool, bool, bool, bool]],
    standing: tuple[int, bool],
    floor: int,
    also_home: set[str],
    weights: tuple[float, ...],
    learned: int,
    cold_margin: float,
) -> None:
    order = ORDER[: len(fleet)]
    loads = [
        ReplicaLoad(r, healthy, load, reserved, weight, at_cap, gpu, recent)
        for r, (load, reserved, healthy, weight, at_cap, gpu, recent, _) in zip(order, fleet, strict=True)
    ]
    resident = frozenset(r for r, spec in zip(order, fleet, strict=True) if spec[7])
    model = TtftModel(PRIORS, 0.3)
    for i in range(learned):  # the summed table follows the model's lines as they move
        model.observe("cold" if i % 2 else "warm", i, 100.0 * i)
    names = ("queue", "regime", "affinity", "cold_stall")
    settings_ = ScorerSettings(affinity_margin_ms=10, cold_margin_ms=cold_margin)
    scoring = build_scoring(dict(zip(names, weights, strict=True)), settings_, model)
    common = {
        "pool": "p", "policy": policy, "balance_factor": 1.25, "capacity_floor": floor, "resident": resident,
        "standing": KeyStanding(standing[0], standing[0] == 0 or standing[1]), "scoring": scoring,
        "aligned": True, "also_home": frozenset(also_home),
    }  # fmt: skip
    fast = decide(order, KEY, loads, **common)  # type: ignore[arg-type]
    general = decide(order, KEY, loads, one_pass=False, **common)  # type: ignore[arg-type]
    assert fast.chosen == general.chosen
    assert fast.reasons == general.reasons and fast.excluded == general.excluded
    assert fast.capacity == general.capacity and fast.used_reservation == general.used_reservation
    assert fast.candidates == general.candidates and fast.unavailable == general.unavailable
    assert fast.warm_ahead == general.warm_ahead
    assert fast.predictions.keys() == general.predictions.keys()
    for replica_id, predicted in fast.predictions.items():
        expected = general.predictions[replica_id]
        assert (predicted.regime, predicted.load) == (expected.regime, expected.load)
        assert predicted.total_ms == pytest.approx(expected.total_ms)


@pytest.mark.parametrize("policy", ["bounded_consistent_hash", "predicted_ttft"])
def test_an_idle_healthy_fleet_is_decided_in_one_pass(policy: str) -> None:
    """The plain case is taken: a request's own decision over an idle, healthy fleet (else the property above
    would hold trivially, with the one pass never deciding)."""
    loads = [ReplicaLoad(r, True, 1, on_gpu=True) for r in ORDER]
    scoring = build_scoring({"queue": 1.0, "regime": 1.0}, ScorerSettings(), TtftModel(PRIORS, 0))
    table = scoring.table() if policy == "predicted_ttft" else None
    no_key = KeyStanding()
    plain = decide_plain(ORDER, KEY, loads, "p", policy, 1.25, 1, no_key, frozenset(), table, frozenset())
    assert plain is not None and plain.chosen == ORDER[0] and plain.reasons == ["home"]
    over = [loads[0]._replace(in_flight=9), *loads[1:]]  # the home over the bound: the general pipeline decides
    assert decide_plain(ORDER, KEY, over, "p", policy, 1.25, 1, no_key, frozenset(), table, frozenset()) is None
