"""Replica health bookkeeping and the retry budget, on a fake clock."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config import HealthConfig, OutlierConfig
from gateway.fleet.health import ReplicaHealth
from gateway.fleet.retry_budget import RetryBudget
from tests.clock import Clock

START = 100.0  # the fake clock's first reading


def health(clock: Clock, outlier: OutlierConfig | None = None) -> ReplicaHealth:
    return ReplicaHealth(
        HealthConfig(unhealthy_after=2, healthy_after=3), outlier or OutlierConfig(), slow_start_s=10, clock=clock
    )


def test_probe_thresholds() -> None:
    replica = health(Clock(START))
    assert replica.probed(False) is None and not replica.up  # the start-up probe sets the state outright
    assert [replica.probed(True) for _ in range(3)] == [None, None, "up"]
    assert [replica.probed(False), replica.probed(True), replica.probed(False)] == [None, None, None]  # no streak
    assert replica.probed(False) == "down"


def test_consecutive_failures_eject_with_doubling_backoff() -> None:
    clock = Clock(START)
    replica = health(clock, OutlierConfig(consecutive_failures=3, base_ejection_s=10, max_ejection_s=25))
    assert [replica.request_failed(True) for _ in range(3)] == [False, False, True]
    assert not replica.available() and replica.ejected_until == 110
    clock.advance(10)
    assert replica.available() and replica.weight() == pytest.approx(0.1)  # slow start from the ejection's end
    replica.request_failed(True)
    replica.request_succeeded()  # a success breaks the streak
    assert [replica.request_failed(True) for _ in range(3)] == [False, False, True]
    assert replica.ejected_until == 130  # 20 s: doubled
    clock.advance(20)
    assert [replica.request_failed(True) for _ in range(3)] == [False, False, True]
    assert replica.ejected_until == 155  # 40 s capped at 25


def test_the_pool_cap_can_forbid_an_ejection() -> None:
    replica = health(Clock(START), OutlierConfig(consecutive_failures=1))
    assert not replica.request_failed(may_eject=False)
    assert replica.available()


def test_slow_start_after_coming_back() -> None:
    clock = Clock(START)
    replica = health(clock)
    assert replica.weight() == 1.0  # serving since before the gateway started
    replica.returning = True
    assert not replica.available()
    replica.back_in_service()
    assert replica.available() and replica.weight() == pytest.approx(0.1)
    clock.advance(5)
    assert replica.weight() == pytest.approx(0.5)
    clock.advance(5)
    assert replica.weight() == 1.0


def test_retry_budget_is_a_ratio_of_recent_requests_with_a_floor() -> None:
    clock = Clock(START)
    budget = RetryBudget(ratio=0.2, min_per_s=0.1, window_s=10, clock=clock)  # floor: 1 retry per 10 s
    assert budget.try_spend() and not budget.try_spend()
    for _ in range(20):
        budget.request()
    assert [budget.try_spend() for _ in range(4)] == [True, True, True, False]  # 20% of 20 = 4 in the window
    clock.advance(10)  # the window has moved on
    assert budget.try_spend() and not budget.try_spend()


def test_a_long_request_that_ends_well_does_not_clear_failures_counted_while_it_ran() -> None:
    """Streams report their outcome at their end: a stream that began before the replica started refusing must not
    wipe out the refusals since (it would keep a broken replica from ever being ejected)."""
    clock = Clock(START)
    replica = health(clock, OutlierConfig(consecutive_failures=3))
    stream_started = clock()
    clock.advance(1)
    assert [replica.request_failed(True) for _ in range(2)] == [False, False]
    replica.request_succeeded(stream_started)  # the long stream ends well
    assert replica.request_failed(True)  # the third refusal in a row still ejects it
    clock.advance(60)
    replica.request_failed(True)
    replica.request_succeeded(clock())  # a request that started after that failure does clear it
    assert replica.consecutive_failures == 0


@settings(max_examples=200, deadline=None)
@given(
    events=st.lists(
        st.tuples(
            st.sampled_from(["probe_ok", "probe_fail", "fail", "back", "drain", "undrain", "return"]), st.floats(0, 8)
        ),
        max_size=40,
    )
)
def test_full_weight_at_never_says_more_than_routing_state(events: list[tuple[str, float]]) -> None:
    """The pool's shortcut (past ``full_weight_at``: in service at full weight) agrees with ``routing_state``
    whatever probes, ejections, returns and drains came before: it never says more, and it says it once slow
    start is over."""
    clock = Clock(START)
    replica = ReplicaHealth(
        HealthConfig(unhealthy_after=1, healthy_after=1),
        OutlierConfig(consecutive_failures=2, base_ejection_s=5, max_ejection_s=20),
        slow_start_s=10,
        clock=clock,
    )
    for event, elapsed in events:
        if event.startswith("probe"):
            replica.probed(event == "probe_ok")
        elif event == "fail":
            replica.request_failed(may_eject=True)
        elif event == "back":
            replica.back_in_service()
        elif event == "return":
            replica.returning = True
        else:
            replica.drained = event == "drain"
        clock.advance(elapsed)
        now = clock()
        if now >= replica.full_weight_at:
            assert replica.routing_state(now) == (True, 1.0)
        elif replica.up and not replica.returning and not replica.drained and now >= replica.ejected_until:
            assert replica.routing_state(now)[1] < 1.0  # in slow start: not yet at its full weight
