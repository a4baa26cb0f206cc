"""Which failures count against a replica (gateway/fleet/outlier.py), through ReplicaHealth on a fake clock: what
the request caused never ejects a replica; a replica the evidence points at is ejected, even with one tenant."""

from __future__ import annotations

import pytest

from backends.base import EngineLoad
from gateway.config import HealthConfig, OutlierConfig
from gateway.fleet.health import ReplicaHealth
from gateway.fleet.outlier import Blame, Failure
from tests.clock import Clock

OUTLIER = OutlierConfig(consecutive_failures=5, base_ejection_s=10, stall_after_s=3)


def replica(clock: Clock) -> ReplicaHealth:
    return ReplicaHealth(HealthConfig(), OUTLIER, slow_start_s=0, clock=clock)


def fail(health: ReplicaHealth, times: int, blame: Blame, tenant: str = "acme", elsewhere: bool = False) -> list[str]:
    """Report ``times`` failures; the ejection reasons they gave (none when no failure ejected)."""
    reasons = [health.attempt_failed(Failure(blame, tenant, elsewhere), may_eject=True) for _ in range(times)]
    return [reason for reason in reasons if reason is not None]


def scrape(health: ReplicaHealth, clock: Clock, tokens: float, running: float = 0, waiting: float = 0) -> None:
    health.progress.scraped(EngineLoad(running, waiting, 0.0, generated_tokens=tokens), clock())


@pytest.mark.parametrize(
    ("blame", "elsewhere", "ejected_by"),
    [
        pytest.param("replica", False, "unreachable", id="refused-or-reset-always-counts"),
        pytest.param("suspect", True, "failed_here_only", id="5xx-that-then-succeeded-elsewhere-counts"),
        pytest.param("suspect", False, None, id="one-tenants-5xx-or-timeouts-never-count"),
        pytest.param("none", False, None, id="4xx-or-clients-error-never-counts"),
    ],
)
def test_one_tenant_alone(blame: Blame, elsewhere: bool, ejected_by: str | None) -> None:
    health = replica(Clock(100))
    reasons = fail(health, 20, blame, elsewhere=elsewhere)
    assert reasons[:1] == ([ejected_by] if ejected_by else [])
    assert health.ejected is (ejected_by is not None)


def test_suspect_failures_that_span_two_tenants_all_count() -> None:
    health = replica(Clock(100))
    assert fail(health, 4, "suspect", "noisy") == []
    assert health.consecutive_failures == 0  # held back: one tenant's failures may be its own doing
    assert fail(health, 1, "suspect", "other") == ["several_tenants"]  # the fifth, and the four held back
    assert health.ejection_reason == "several_tenants" and health.ejected


def test_a_success_clears_the_suspicions_noted_before_it_started() -> None:
    clock = Clock(100)
    health = replica(clock)
    fail(health, 4, "suspect", "noisy")
    clock.advance(1)
    health.request_succeeded(clock())  # another tenant's request went well here
    assert fail(health, 1, "suspect", "other") == []  # one tenant since that success: still held back
    long_one = clock()
    clock.advance(1)
    fail(health, 3, "suspect", "noisy")
    health.request_succeeded(long_one)  # started before those: it does not clear them
    assert fail(health, 1, "suspect", "third") == ["several_tenants"]


def test_timeouts_count_when_the_engines_metrics_show_it_stalled() -> None:
    """One tenant only (tenant affinity), requests waiting and no token generated for stall_after_s: the engine is
    stuck, and its timeouts count."""
    clock = Clock(100)
    health = replica(clock)
    scrape(health, clock, tokens=500, running=2, waiting=3)
    clock.advance(2)
    scrape(health, clock, tokens=500, running=2, waiting=3)
    assert fail(health, 5, "suspect") == []  # 2 s without a token is not yet a stall
    clock.advance(1.5)
    scrape(health, clock, tokens=500, running=2, waiting=4)
    assert fail(health, 5, "suspect") == ["stalled"]


def test_a_long_generation_past_the_timeout_is_not_a_stall() -> None:
    """The repro: long generations of one tenant run past the pool's timeout while the engine keeps generating."""
    clock = Clock(100)
    health = replica(clock)
    for tokens in range(0, 4000, 100):
        scrape(health, clock, tokens=tokens, running=5)
        clock.advance(0.5)
    assert fail(health, 20, "suspect") == []
    assert health.available()


@pytest.mark.parametrize(
    ("scrapes", "age_s"),
    [
        pytest.param([(500, 0), (500, 0)], 0.0, id="idle-engine"),  # nothing waits: nothing to generate
        pytest.param([(500, 3), (500, 3)], 10.0, id="stale-scrape"),  # the last scrape is too old to tell
    ],
)
def test_no_stall_without_fresh_evidence(scrapes: list[tuple[float, float]], age_s: float) -> None:
    clock = Clock(100)
    health = replica(clock)
    for tokens, waiting in scrapes:
        scrape(health, clock, tokens=tokens, waiting=waiting)
        clock.advance(4)
    clock.advance(age_s)
    assert fail(health, 10, "suspect") == []


def test_a_stall_is_15_s_without_a_token_by_default() -> None:  # the README says so
    assert OutlierConfig().stall_after_s == 15.0


def test_an_engine_without_a_token_counter_never_looks_stalled() -> None:
    clock = Clock(100)
    health = replica(clock)
    for _ in range(5):
        health.progress.scraped(EngineLoad(running=3, waiting=3, kv_cache_usage=0.0), clock())  # e.g. Triton
        clock.advance(2)
    assert not health.progress.stalled(clock())
