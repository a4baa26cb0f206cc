"""The TTFT model predicted_ttft reads: each regime's line starts at its prior and follows what is measured."""

from __future__ import annotations

import random

import pytest

from gateway.routing.costs import REGIMES, Line, Regime, TtftModel, regime_of

PRIORS: dict[Regime, Line] = {
    "warm": Line(20, 10),
    "kv_cold": Line(40, 10),
    "host": Line(70, 10),
    "cold": Line(500, 10),
}


def test_a_model_that_has_seen_nothing_predicts_its_priors() -> None:
    model = TtftModel(PRIORS, learning_rate=0.05)
    for regime in REGIMES:
        assert model.line(regime) == pytest.approx(PRIORS[regime])
    assert model.line("cold").at(3) == pytest.approx(530)


def test_a_regime_learns_the_line_its_measurements_follow_and_leaves_the_others_alone() -> None:
    rng = random.Random(7)
    model = TtftModel(PRIORS, learning_rate=0.05)
    for _ in range(400):  # the fleet's truth: 8 ms at no load, 3 ms per request ahead, with noise
        load = rng.randrange(0, 12)
        model.observe("warm", load, 8 + 3 * load + rng.gauss(0, 1))
    learned = model.line("warm")
    assert learned.base_ms == pytest.approx(8, abs=1.5)
    assert learned.per_request_ms == pytest.approx(3, abs=0.3)
    assert model.line("cold") == PRIORS["cold"]


def test_one_outlier_does_not_swing_a_line_learned_from_many() -> None:
    model = TtftModel(PRIORS, learning_rate=0.05)
    for load in range(200):
        model.observe("kv_cold", load % 6, 30.0)
    model.observe("kv_cold", 0, 3000.0)  # one request that waited behind a stalled prefill
    assert model.line("kv_cold").at(0) < 40


def test_a_regime_far_slower_than_its_prior_is_learned_all_the_same() -> None:
    model = TtftModel(PRIORS, learning_rate=0.05)
    for index in range(150):  # cold loads take 2 s on this fleet, not the prior's 500 ms
        model.observe("cold", index % 3, 2000.0)
    assert model.line("cold").at(1) == pytest.approx(2000, rel=0.1)


def test_learning_rate_zero_keeps_the_priors() -> None:
    model = TtftModel(PRIORS, learning_rate=0.0)
    for _ in range(50):
        model.observe("warm", 2, 900.0)
    assert model.line("warm") == PRIORS["warm"]


def test_a_line_never_predicts_less_than_nothing() -> None:
    model = TtftModel(PRIORS, learning_rate=0.5)
    for load in (0, 10, 0, 10, 0, 10):  # more load, faster: noise, not a negative cost per request
        model.observe("host", load, 50.0 - 4 * load)
    line = model.line("host")
    assert line.per_request_ms >= 0 and line.base_ms >= 0


def test_a_constant_load_still_has_a_slope_from_the_prior() -> None:
    model = TtftModel(PRIORS, learning_rate=0.05)
    for _ in range(300):
        model.observe("warm", 4, 60.0)  # every measurement at the same load: only the level is learned
    line = model.line("warm")
    assert line.at(4) == pytest.approx(60, abs=3)
    assert line.per_request_ms > 0


@pytest.mark.parametrize(
    ("on_gpu", "resident", "key_recent", "regime"),
    [
        (True, True, True, "warm"),
        (True, True, False, "kv_cold"),
        (False, True, True, "host"),
        (False, True, False, "host"),
        (False, False, True, "cold"),
        (True, False, False, "kv_cold"),  # running there by another gateway's request: on the GPU all the same
    ],
)
def test_the_regime_of_a_request_on_a_replica(on_gpu: bool, resident: bool, key_recent: bool, regime: str) -> None:
    assert regime_of(on_gpu, resident, key_recent) == regime
