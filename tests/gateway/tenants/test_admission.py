"""Admission control: the buckets on a fake clock, the limiter, and the shared buckets against a real Redis."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from gateway.config import GatewayConfig
from gateway.errors import InvalidRequest, RequestRateLimited, TokenRateLimited
from gateway.observe.metrics import GatewayMetrics
from gateway.residency.store import StoreUnavailable
from gateway.tenants.admission import Admission, Bucket, RateLimit, estimate_tokens
from gateway.tenants.rate_buckets import RedisBuckets
from tests.clock import Clock


def test_a_bucket_refills_continuously_and_says_how_long_to_wait() -> None:
    clock = Clock()
    bucket = Bucket(capacity=60, per_s=1, clock=clock)
    assert bucket.take(60) == 0
    assert bucket.take(1) == pytest.approx(1.0)
    clock.advance(10)
    assert bucket.take(10) == 0 and bucket.take(1) == pytest.approx(1.0)
    bucket.give(5)  # a request used 5 tokens fewer than counted
    assert bucket.take(5) == 0


def admission(**limits: int) -> Admission:
    config = GatewayConfig.model_validate(
        {
            "pools": [
                {"name": "p", "backend": "vllm", "base_model": "m", "replicas": [{"id": "r0", "url": "http://h"}]}
            ],
            "tenants": [{"id": "acme", "api_keys": ["sha256:" + "0" * 64], "base_models": ["m"], "limits": limits}],
        }
    )
    admit = Admission(GatewayMetrics(), None)
    admit.configure(config)
    return admit


async def test_requests_per_minute() -> None:
    limiter = admission(requests_per_minute=2)
    await limiter.admit("acme", 10)
    await limiter.admit("acme", 10)
    with pytest.raises(RequestRateLimited) as refused:
        await limiter.admit("acme", 10)
    assert refused.value.status == 429 and refused.value.code == "rate_limit_exceeded"
    assert int(refused.value.headers["Retry-After"]) >= 1
    await limiter.admit("globex", 10)  # a tenant without limits is never refused


async def test_tokens_per_minute_are_corrected_by_actual_usage() -> None:
    limiter = admission(tokens_per_minute=100)
    ticket = await limiter.admit("acme", 90)
    with pytest.raises(TokenRateLimited):
        await limiter.admit("acme", 20)
    ticket.settle(actual_tokens=10)  # it used 10, not 90: 80 come back
    await limiter.admit("acme", 80)


async def test_concurrency_and_max_tokens() -> None:
    limiter = admission(max_concurrent=1, max_tokens=50)
    ticket = await limiter.admit("acme", 1)
    with pytest.raises(RequestRateLimited, match="concurrent"):
        await limiter.admit("acme", 1)
    ticket.settle(None)
    await limiter.admit("acme", 1)
    limiter.check_max_tokens("acme", 50)
    with pytest.raises(InvalidRequest, match="at most 50"):
        limiter.check_max_tokens("acme", 51)


def test_the_estimate_counts_the_prompt_and_the_answer() -> None:
    assert estimate_tokens(prompt_chars=40, max_tokens=16) == 26
    assert estimate_tokens(prompt_chars=1, max_tokens=None) == 257


@pytest.mark.parametrize("kind", ["redis", "cluster"])
async def test_shared_buckets_hold_the_limit_across_gateways(kind: str, request: pytest.FixtureRequest) -> None:
    """Three "gateways" leasing from one Redis bucket (a server, or a cluster) never admit more than the limit."""
    server = request.getfixturevalue("redis_cluster" if kind == "cluster" else "redis_server")
    shared = RedisBuckets(  # a slow answer would fall back to a local bucket: not what this test is about
        server.url, prefix=f"test-{uuid.uuid4().hex}", cluster=kind == "cluster", operation_timeout_s=5
    )
    try:
        gateways = [RateLimit("acme:requests", 60, shared) for _ in range(3)]
        admitted = 0
        for _ in range(40):
            for gateway in gateways:
                admitted += await gateway.take(1) == 0
        assert 60 - 3 * gateways[0].lease_size <= admitted <= 60 + 1  # +1: a second's refill while it ran
    finally:
        await shared.close()


async def test_a_shared_bucket_that_cannot_be_reached_falls_back_to_a_local_one() -> None:
    class Down:
        async def lease(self, *args: object) -> tuple[float, float]:
            raise StoreUnavailable("down")

    limit = RateLimit("acme:requests", 2, Down())
    assert [await limit.take(1) == 0 for _ in range(3)] == [True, True, False]


async def test_concurrent_admissions_cannot_pass_the_concurrency_limit_while_a_lease_is_awaited() -> None:
    class SlowShared:
        calls = 0

        async def lease(self, key: str, want: float, need: float, capacity: float, per_s: float) -> tuple[float, float]:
            SlowShared.calls += 1
            await asyncio.sleep(0.05)  # a Redis round trip, slowed so the admissions overlap
            return want, 0.0

    config = GatewayConfig.model_validate(
        {
            "pools": [{"name": "p", "backend": "vllm", "base_model": "m", "replicas": [{"id": "r0", "url": "http://h"}]}],
            "tenants": [{"id": "acme", "api_keys": ["sha256:" + "0" * 64], "base_models": ["m"],
                         "limits": {"max_concurrent": 2, "requests_per_minute": 600}}],
        }
    )  # fmt: skip
    limiter = Admission(GatewayMetrics(), SlowShared())
    limiter.configure(config)
    results = await asyncio.gather(*(limiter.admit("acme", 1) for _ in range(20)), return_exceptions=True)
    assert sum(not isinstance(r, BaseException) for r in results) == 2
    assert SlowShared.calls == 1  # one lease for everyone who waited on it


async def test_a_debt_larger_than_the_limit_does_not_lock_the_tenant_out() -> None:
    class Full:
        async def lease(self, key: str, want: float, need: float, capacity: float, per_s: float) -> tuple[float, float]:
            return (min(want, capacity), 0.0) if need <= capacity else (0.0, 0.0)

    limit = RateLimit("acme:tokens", 1000, Full())
    limit.give(-1200)  # a request used 1200 tokens more than counted
    assert await limit.take(100) == 0
