"""The gpu_slot scorer: when a request would wait for one of a replica's GPU adapter slots (costs.gpu_slot_waits),
what the term charges, how the wait is learned, and the picker leaving a replica whose slots are all taken."""

from __future__ import annotations

import pytest

from gateway.routing.costs import TtftModel, gpu_slot_waits
from gateway.routing.decision import NEW_KEY, ReplicaLoad
from gateway.routing.pipeline import decide
from gateway.routing.scorers import SCORERS, Candidate, ScorerSettings, build_scoring
from tests.gateway.routing.test_predicted_ttft import HOME, KEY, PRIORS, RING, SECOND, THIRD

DEFAULT = {"queue": 1.0, "regime": 1.0, "affinity": 1.0, "cold_stall": 1.0}
NONE: frozenset[str] = frozenset()


def test_a_request_waits_only_where_other_adapters_in_use_fill_every_slot() -> None:
    # Two slots. This gateway's in-flight adapters b and c fill both: a waits; b does not (its adapter holds one).
    assert gpu_slot_waits("a", {"b": 1, "c": 3}, {}, NONE, 2)
    assert not gpu_slot_waits("b", {"b": 1, "c": 3}, {}, NONE, 2)
    # One in use: a slot is free, or held by an idle adapter (the engine frees it for the request).
    assert not gpu_slot_waits("a", {"b": 1}, {}, NONE, 2)
    # Another gateway's in-flight adapter counts with this one's, once each.
    assert gpu_slot_waits("a", {"b": 1}, {"c": 1}, NONE, 2)
    assert not gpu_slot_waits("a", {"b": 1}, {"b": 2}, NONE, 2)
    # The engine's scrape lists what runs there (any gateway's, or traffic that came past the gateways).
    assert gpu_slot_waits("a", {}, {}, frozenset({"b", "c"}), 2)
    assert gpu_slot_waits("a", {"b": 1}, {}, frozenset({"b", "c"}), 2)
    assert not gpu_slot_waits("a", {"b": 1}, {"c": 1}, frozenset({"a"}), 2)  # a runs there: it holds a slot
    assert not gpu_slot_waits("a", {"b": 1}, {"c": 1}, frozenset({"b", "c"}), 3)
    # The adapter already in flight there holds a slot, unless the engine lists others running in every slot and
    # not it: its requests there are queued for one, and this one joins them.
    assert not gpu_slot_waits("b", {"b": 1, "c": 1, "d": 1}, {}, NONE, 2)
    assert gpu_slot_waits("b", {"b": 1, "c": 1, "d": 1}, {}, frozenset({"c", "d"}), 2)
    assert gpu_slot_waits("b", {"c": 1}, {"b": 1, "d": 1}, frozenset({"c", "d"}), 2)
    assert not gpu_slot_waits("b", {"b": 1, "c": 1, "d": 1}, {}, frozenset({"c"}), 2)
    # An engine that does not say its slot count: no wait predicted.
    assert not gpu_slot_waits("a", {"b": 1, "c": 1}, {}, NONE, None)


def test_the_term_is_the_wait_where_one_is_predicted_whatever_the_regime() -> None:
    term = SCORERS["gpu_slot"](ScorerSettings())
    waiting = Candidate(ReplicaLoad("r0", True, 3, gpu_slot_ms=180.0), "host", PRIORS["host"], True)
    assert term.score(waiting) == 180
    # An adapter likely in a slot by its recent use, not in use now, loses it the same way.
    assert term.score(waiting._replace(regime="warm")) == 180
    assert term.score(waiting._replace(regime="cold")) == 180
    assert term.score(waiting._replace(replica=ReplicaLoad("r0", True, 3))) == 0


@pytest.mark.parametrize("explain", [False, True])
def test_a_request_leaves_a_home_whose_slots_are_taken_for_a_replica_with_one_free(explain: bool) -> None:
    """The adapter is in host memory at home and on the second replica, equally loaded. At home every GPU slot is
    held by other adapters in use (a 200 ms wait predicted): without the term the home wins (the affinity margin),
    with it the second replica does."""
    fleet = [
        ReplicaLoad(HOME, True, 2, gpu_slot_ms=200.0),
        ReplicaLoad(SECOND, True, 2),
        ReplicaLoad(THIRD, True, 9),
    ]
    resident = frozenset({HOME, SECOND})
    for weights, chosen in ((DEFAULT, HOME), ({**DEFAULT, "gpu_slot": 1.0}, SECOND)):
        scoring = build_scoring(weights, ScorerSettings(affinity_margin_ms=10), TtftModel(PRIORS, 0))
        decision = decide(RING.preference(KEY), KEY, fleet, pool="p", policy="predicted_ttft", balance_factor=1.25,
                          capacity_floor=8, standing=NEW_KEY, resident=resident, scoring=scoring,
                          explain=explain)  # fmt: skip
        assert decision.chosen == chosen
        assert decision.predictions[chosen].regime == "host"
        assert decision.predictions[chosen].waits_gpu_slot == (chosen == HOME)  # the home's figure says it waits
    # Where it waits everywhere it pays the wait everywhere: the home again, and the prediction says it waits.
    fleet = [r._replace(gpu_slot_ms=200.0) for r in fleet]
    scoring = build_scoring({**DEFAULT, "gpu_slot": 1.0}, ScorerSettings(), TtftModel(PRIORS, 0))
    decision = decide(RING.preference(KEY), KEY, fleet, pool="p", policy="predicted_ttft", balance_factor=1.25,
                      capacity_floor=8, standing=NEW_KEY, resident=resident, scoring=scoring,
                      explain=explain)  # fmt: skip
    assert decision.chosen == HOME and decision.predictions[HOME].waits_gpu_slot
    assert decision.predictions[HOME].total_ms == pytest.approx(70 + 20 + 200)


def test_the_wait_is_learned_apart_from_the_regime_line() -> None:
    """A request predicted to wait for a slot teaches the wait (what it took beyond its regime's line, a moving
    average from the prior), and not the line; a request that did not wait teaches the line only."""
    model = TtftModel(PRIORS, 0.5, gpu_slot_ms=200.0)
    model.observe_gpu_slot("host", 2, 70 + 20 + 400)  # waited 400 ms beyond the line
    assert model.gpu_slot_ms == pytest.approx(300)
    assert model.lines["host"] == PRIORS["host"] and model.version == 0
    model.observe_gpu_slot("host", 2, 50)  # faster than the line: it did not wait after all
    assert model.gpu_slot_ms == pytest.approx(150)
    model.observe_gpu_slot("host", 2, 60_000)  # one stuck stream counts as at most 3x the prediction (+10 ms)
    assert model.gpu_slot_ms == pytest.approx(150 + 0.5 * (3 * (90 + 150) + 10 - 90 - 150))
    frozen = TtftModel(PRIORS, 0, gpu_slot_ms=200.0)
    frozen.observe_gpu_slot("host", 2, 5_000)
    assert frozen.gpu_slot_ms == 200
