"""Admission control: the buckets on a fake clock, the limiter, and the shared buckets against a real Redis."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
import redis.asyncio

import gateway.tenants.admission as admission_module
from gateway.config import GatewayConfig, TenantLimits
from gateway.errors import InvalidRequest, RequestRateLimited, TokenRateLimited
from gateway.observe.metrics import GatewayMetrics
from gateway.residency.store import StoreUnavailable
from gateway.tenants.admission import Admission, Bucket, RateLimit, estimate_tokens, unreported_usage, with_defaults
from gateway.tenants.rate_buckets import RedisBuckets
from tests.clock import Clock
from tests.redis_server import RedisServer


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


async def test_a_body_being_read_holds_one_of_the_tenants_concurrent_requests() -> None:
    """Half-sent bodies count against the limit (issue 20: a tenant limited to 4 held 50 of them): a read beyond it
    is refused at once, and a read that ends gives its place to the request it admits."""
    limiter = admission(max_concurrent=2)
    with limiter.reading_body("acme"), limiter.reading_body("acme"):
        with pytest.raises(RequestRateLimited, match="concurrent"), limiter.reading_body("acme"):
            pass
        with pytest.raises(RequestRateLimited, match="concurrent"):
            await limiter.admit("acme", 1)
    with limiter.reading_body("acme"):
        pass  # read, then admitted: the place passes from the body to the request
    first = await limiter.admit("acme", 1)
    with limiter.reading_body("acme"):
        pass
    await limiter.admit("acme", 1)
    with pytest.raises(RequestRateLimited), limiter.reading_body("acme"):
        pass
    first.settle(None)
    with limiter.reading_body("acme"), limiter.reading_body("globex"):  # a tenant without limits: never refused
        pass


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

        async def debit(self, *args: object) -> None:
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

        async def debit(self, key: str, amount: float, capacity: float, per_s: float) -> None:
            return None

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


async def test_a_hung_shared_bucket_is_waited_for_once_per_gateway_not_once_per_limit_and_request() -> None:
    """Redis that accepts connections and never answers: each lease waits out the operation timeout. The first
    one to find it so sends every limit of the gateway (each tenant's requests and tokens, and the requests that
    queued behind that lease) to its local bucket at once, instead of each paying the timeout in turn."""

    class Hung:
        calls = 0

        async def lease(self, key: str, want: float, need: float, capacity: float, per_s: float) -> tuple[float, float]:
            Hung.calls += 1
            await asyncio.sleep(0.05)  # the operation timeout, shortened
            raise StoreUnavailable("timed out")

        async def debit(self, key: str, amount: float, capacity: float, per_s: float) -> None:
            raise StoreUnavailable("timed out")

    limits = {"requests_per_minute": 600, "tokens_per_minute": 60_000}
    config = GatewayConfig.model_validate(
        {
            "pools": [{"name": "p", "backend": "vllm", "base_model": "m", "replicas": [{"id": "r0", "url": "http://h"}]}],
            "tenants": [{"id": f"t{i}", "api_keys": ["sha256:" + f"{i}" * 64], "base_models": ["m"], "limits": limits}
                        for i in range(4)],
        }
    )  # fmt: skip
    limiter = Admission(GatewayMetrics(), Hung())
    limiter.configure(config)
    tickets = await asyncio.gather(*(limiter.admit(f"t{i % 4}", 10) for i in range(20)))
    assert len(tickets) == 20  # all admitted, by the local buckets
    # The four tenants' first leases went out together (each request waited once, side by side); none after them:
    # not the requests queued behind a tenant's lease, nor any tenant's tokens limit.
    assert Hung.calls == 4
    await asyncio.gather(*(limiter.admit(f"t{i % 4}", 10) for i in range(20)))
    assert Hung.calls == 4


async def test_a_debt_larger_than_the_limit_is_waited_out_not_a_lock_out(redis_server: RedisServer) -> None:
    """A request that used 750 tokens more than counted, against 600 a minute (10/s): every gateway sharing the
    bucket waits the debt out, then admits again; nobody is locked out for good. The bucket: 600, less the first
    lease (60) and the 700 its lease could not cover, is -160: 10 more tokens are 17 s away."""
    shared = RedisBuckets(redis_server.url, prefix=f"test-{uuid.uuid4().hex}", operation_timeout_s=5)
    try:
        here, there = RateLimit("acme:tokens", 600, shared), RateLimit("acme:tokens", 600, shared)
        assert await here.take(10) == 0  # leases 60
        here.give(-(50 + 700))  # used 760 where 10 were counted: 50 from its lease, 700 from the shared bucket
        assert await here.take(10) == pytest.approx(17.0, abs=0.5)
        assert await there.take(10) == pytest.approx(17.0, abs=0.5)  # the other gateway sees the debt at once
    finally:
        await shared.close()


async def test_gateways_with_different_limits_for_a_tenant_lease_from_a_bucket_each(redis_server: RedisServer) -> None:
    """Two gateways' configs give one tenant different limits (a rolling config change, or configs that differ):
    each leases from the bucket of its own limit, shared with the gateways that have the same one. One bucket for
    both had the stricter capacity clamp the looser one's refill and its leases take what the other counted on:
    the gateway allowing 6,000 tokens a minute was refused 1,000 after the one allowing 60 had leased 6."""
    shared = RedisBuckets(redis_server.url, prefix=f"test-{uuid.uuid4().hex}", operation_timeout_s=5)
    try:
        strict, loose = RateLimit("acme:tokens", 60, shared), RateLimit("acme:tokens", 6000, shared)
        same = RateLimit("acme:tokens", 60, shared)  # a third gateway with the strict gateway's limit
        assert await strict.take(6) == 0  # leases 6 of 60
        assert await loose.take(1000) == 0  # from its own bucket of 6,000
        assert await loose.take(5000) == 0
        assert await strict.take(1) == 0 and strict.leased == 5  # the loose gateway took nothing of the strict's
        assert await same.take(48) == 0  # the strict bucket's 48 left, shared by the gateways with that limit
        assert await same.take(10) > 0
    finally:
        await shared.close()


def limits_config(**limits: int) -> GatewayConfig:
    return GatewayConfig.model_validate(
        {
            "pools": [
                {"name": "p", "backend": "vllm", "base_model": "m", "replicas": [{"id": "r0", "url": "http://h"}]}
            ],
            "tenants": [{"id": "acme", "api_keys": ["sha256:" + "0" * 64], "base_models": ["m"], "limits": limits}],
        }
    )


async def admitted(admission: Admission, most: int = 100) -> int:
    """How many of acme's requests ``admission`` admits in a row before the first 429 (at most ``most``)."""
    for count in range(most):
        try:
            await admission.admit("acme", 1)
        except RequestRateLimited:
            return count
    return most


async def test_a_reload_that_changes_a_limit_leases_from_that_limits_bucket(redis_server: RedisServer) -> None:
    """docs/operations.md (Gateways whose limits differ): a reload that changes a limit leases from the new figure's
    bucket, full unless gateways with that figure already lease from it. What a reload calls (Admission.configure),
    against a real Redis: the tenant at 6 a minute spends its bucket; reloaded to 12 it gets a full bucket of 12
    (the old one's emptiness does not follow it); reloaded back to 6, the first bucket, still spent, is the one."""
    prefix = f"test-{uuid.uuid4().hex}"
    shared = RedisBuckets(redis_server.url, prefix=prefix, operation_timeout_s=5)
    probe = redis.asyncio.Redis.from_url(redis_server.url, decode_responses=True)
    admission = Admission(GatewayMetrics(), shared)
    try:
        admission.configure(limits_config(requests_per_minute=6))
        assert await admitted(admission) == 6
        admission.configure(limits_config(requests_per_minute=12))
        assert await admitted(admission) == 12
        assert await probe.exists(shared.bucket("acme:requests", 6), shared.bucket("acme:requests", 12)) == 2
        admission.configure(limits_config(requests_per_minute=6))
        assert await admitted(admission) == 0
    finally:
        await probe.aclose()
        await shared.close()


class BucketsBeforeLimits(RedisBuckets):
    """A gateway of the version before buckets were kept per limit figure: it leases from ``tg:rl:{tenant:kind}``
    (its scripts read and wrote the bucket as these do)."""

    def bucket(self, key: str, capacity: float) -> str:
        return f"{self._prefix}:rl:{{{key}}}"


async def test_two_versions_of_gateway_admit_at_most_twice_a_tenants_limit(redis_server: RedisServer) -> None:
    """docs/operations.md (Shut down and upgrade): while gateways from before the per-limit buckets run beside newer
    ones, a tenant's per-minute limit may admit up to twice the limit (each bucket holds for the gateways leasing
    from it), and no more: each version's gateways together hold their own bucket's limit."""
    prefix = f"test-{uuid.uuid4().hex}"
    new, old = (
        RedisBuckets(redis_server.url, prefix=prefix, operation_timeout_s=5),
        BucketsBeforeLimits(redis_server.url, prefix=prefix, operation_timeout_s=5),
    )
    gateways = {
        "new-1": Admission(GatewayMetrics(), new), "new-2": Admission(GatewayMetrics(), new),
        "old-1": Admission(GatewayMetrics(), old), "old-2": Admission(GatewayMetrics(), old),
    }  # fmt: skip
    try:
        for admission in gateways.values():
            admission.configure(limits_config(requests_per_minute=10))
        counts = {name: await admitted(admission) for name, admission in gateways.items()}
        assert counts["new-1"] + counts["new-2"] == 10 and counts["old-1"] + counts["old-2"] == 10, counts
        assert sum(counts.values()) == 2 * 10
    finally:
        await new.close()
        await old.close()


def two_tenants(rpm: int) -> GatewayConfig:
    tenants = [
        {"id": name, "api_keys": ["sha256:" + digit * 64], "base_models": ["m"], "limits": {"requests_per_minute": rpm}}
        for name, digit in (("noisy", "1"), ("quiet", "2"))
    ]
    return GatewayConfig.model_validate(
        {
            "pools": [
                {"name": "p", "backend": "vllm", "base_model": "m", "replicas": [{"id": "r0", "url": "http://h"}]}
            ],
            "tenants": tenants,
        }
    )


async def scripts_run(client: redis.asyncio.Redis) -> int:
    stats = await client.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("eval", "evalsha"))


async def test_a_noisy_tenant_over_its_limit_costs_redis_nothing_and_a_quiet_one_of_the_same_limit_nothing(
    redis_server: RedisServer,
) -> None:
    """Two gateways sharing Redis, a noisy and a quiet tenant with the same per-minute limit (each has a bucket of
    its own: the noisy one never takes the quiet one's). A tenant over its limit made a Redis call for every
    request it sent (a lease that answered "wait"): its flood of refused requests was a flood of scripts on the
    Redis every tenant's leases, the residency store and the slot signal share, and each refused request waited a
    round trip. Now a refusal tells the gateway what the shared bucket held: until it can have refilled enough, a
    request is refused here, with the same Retry-After, without asking Redis."""
    prefix = f"test-{uuid.uuid4().hex}"
    probe = redis.asyncio.Redis.from_url(redis_server.url, decode_responses=True)
    shared = [RedisBuckets(redis_server.url, prefix=prefix, operation_timeout_s=5) for _ in range(2)]
    gateways = [Admission(GatewayMetrics(), buckets) for buckets in shared]
    try:
        for gateway in gateways:
            gateway.configure(two_tenants(6))  # 6 a minute: one every 10 s, nothing refills within the test
        admitted, refusals = 0, []
        for i in range(200):
            try:
                await gateways[i % 2].admit("noisy", 1)
                admitted += 1
            except RequestRateLimited as exc:
                refusals.append(int(exc.headers["Retry-After"]))
        assert admitted == 6 and len(refusals) == 194 and all(1 <= wait <= 10 for wait in refusals)
        before = await scripts_run(probe)
        for i in range(200):
            with pytest.raises(RequestRateLimited):
                await gateways[i % 2].admit("noisy", 1)
        assert await scripts_run(probe) - before == 0
        quiet = 0
        for i in range(20):
            with contextlib.suppress(RequestRateLimited):
                await gateways[i % 2].admit("quiet", 1)
                quiet += 1
        assert quiet == 6
    finally:
        await probe.aclose()
        for buckets in shared:
            await buckets.close()


async def test_a_debt_stays_with_the_local_bucket_when_redis_cannot_take_it() -> None:
    class Down:
        async def lease(self, key: str, want: float, need: float, capacity: float, per_s: float) -> tuple[float, float]:
            return want, 0.0

        async def debit(self, key: str, amount: float, capacity: float, per_s: float) -> None:
            raise StoreUnavailable("down")

    limit = RateLimit("acme:tokens", 600, Down())
    assert await limit.take(10) == 0
    limit.give(-1000)
    await asyncio.sleep(0)  # the debit task runs, fails, and charges the local fallback bucket
    assert limit.local.tokens < 0


def test_tenant_defaults_fill_what_a_tenants_own_limits_leave_unset() -> None:
    own, defaults = TenantLimits(max_concurrent=3), TenantLimits(max_concurrent=1, max_tokens=64)
    assert with_defaults(own, defaults) == TenantLimits(max_concurrent=3, max_tokens=64)
    assert with_defaults(own, TenantLimits()) is own


async def test_the_max_tokens_cap_is_the_default_and_a_default_concurrency_applies_to_all() -> None:
    config = GatewayConfig.model_validate(
        {
            "pools": [{"name": "p", "backend": "vllm", "base_model": "m", "replicas": [{"id": "r0", "url": "http://h"}]}],
            "tenants": [{"id": "acme", "api_keys": ["sha256:" + "0" * 64], "base_models": ["m"],
                         "limits": {"max_tokens": 8}}],
            "limits": {"tenant_defaults": {"max_concurrent": 1}},
        }
    )  # fmt: skip
    limiter = Admission(GatewayMetrics(), None)
    limiter.configure(config)
    assert limiter.check_max_tokens("acme", None) == 8
    assert limiter.check_max_tokens("acme", 5) == 5
    assert limiter.check_max_tokens("globex", None) is None
    await limiter.admit("acme", 1)
    with pytest.raises(RequestRateLimited, match="concurrent"):
        await limiter.admit("acme", 1)


@pytest.mark.parametrize(
    ("estimate", "prompt_chars", "events", "most", "charged"),
    [
        pytest.param(258, 5, 1024, 10_000, 2 + 1024, id="more-than-the-estimate"),
        pytest.param(258, 5, 10, 10_000, None, id="less-keeps-the-estimate"),
        pytest.param(258, 5, 10**9, 5_000, 5_000, id="at-most-the-ceiling"),
    ],
)
def test_a_stream_cut_before_its_usage_is_charged_a_token_an_event(
    estimate: int, prompt_chars: int, events: int, most: int, charged: int | None
) -> None:
    assert unreported_usage(estimate, prompt_chars, events, most) == charged


@pytest.mark.parametrize(
    ("tokens", "wait_s"),
    [("-inf", 0.0), ("-1e999", 0.0), ("inf", 0.0), ("nan", 0.0), ("junk", 0.0), ("-1e300", 3601.0)],
)
async def test_a_bucket_another_writer_left_unreadable_still_leases(
    redis_server: RedisServer, tokens: str, wait_s: float
) -> None:
    """A bucket's fields as another writer (another version's gateway, or anyone with Redis access) may leave them:
    a count that is not a finite number is read as a full bucket, as a missing one is, and a debt is kept to an
    hour's refill (60 times the per-minute limit). Lua reads "-inf" (and a figure past a double) as minus infinity:
    the script wrote it back, then failed at its PEXPIRE (as it did for a debt past what PEXPIRE takes), so the
    bucket never healed and every gateway leased from its local fallback for good (each admitting the tenant's whole
    limit: the limit times the gateways), with a failed lease and a warning every 5 s."""
    prefix = f"test-{uuid.uuid4().hex}"
    shared = RedisBuckets(redis_server.url, prefix=prefix, operation_timeout_s=5)
    writer = redis.asyncio.Redis.from_url(redis_server.url)
    bucket = shared.bucket("acme:requests", 60)
    try:
        await writer.hset(bucket, mapping={"tokens": tokens, "at": "0"})
        granted, wait = await shared.lease("acme:requests", 6, 1, 60, 1.0)
        assert granted == (0.0 if wait_s else 6.0) and wait == pytest.approx(wait_s, abs=1)
        await shared.debit("acme:requests", 1, 60, 1.0)
        assert -3600 <= float(await writer.hget(bucket, "tokens") or "nan") <= 60
        assert 0 < await writer.pttl(bucket) <= 1000 * (60 + 3600) + 1000  # refilled from the floor, and a second
    finally:
        await writer.aclose()
        await shared.close()


@pytest.mark.parametrize(
    "write", [lambda c, k: c.set(k, "5"), lambda c, k: c.sadd(k, "tokens")], ids=["a string", "a set"]
)
async def test_a_bucket_key_of_another_type_is_replaced_not_every_limit_local(
    redis_server: RedisServer, write: Any
) -> None:
    """Someone SETs a string where a tenant's bucket HASH lives: both scripts' HMGET raised WRONGTYPE, which is
    StoreUnavailable, and the first lease to meet it sent every limit of the gateway (each tenant's: the outage is
    shared) to its local bucket for FALLBACK_S, again and again while the key stayed: every tenant's limit times
    the gateways, with a warning every 5 s. The gateway owns the key: a key of another type is read as no bucket
    (a full one), and written over."""
    prefix = f"test-{uuid.uuid4().hex}"
    shared = RedisBuckets(redis_server.url, prefix=prefix, operation_timeout_s=5)
    writer = redis.asyncio.Redis.from_url(redis_server.url, decode_responses=True)
    bucket = shared.bucket("acme:requests", 60)
    try:
        await write(writer, bucket)
        granted, wait = await shared.lease("acme:requests", 6, 1, 60, 1.0)
        assert granted == 6.0 and wait == 0.0
        await writer.delete(bucket)
        await write(writer, bucket)
        await shared.debit("acme:requests", 1, 60, 1.0)
        assert await writer.type(bucket) == "hash"
    finally:
        await writer.aclose()
        await shared.close()


async def test_a_refusal_that_came_back_slowly_refuses_nothing_the_bucket_has_refilled_since(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The refusal's figure is what the bucket held when the script ran, which is before its answer arrived: the
    refill counts from the call. Stamped when the answer came, a round trip of 0.6 s (Redis slow, or far) refused
    here, for another half second, a request the bucket had refilled enough for while the answer travelled."""
    clock = [100.0]
    monkeypatch.setattr(admission_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))

    class SlowBucket:  # a shared bucket at 2 tokens a second, empty at first, whose answers take 0.6 s to come back
        def __init__(self) -> None:
            self.tokens, self.at, self.calls = 0.0, clock[0], 0

        async def lease(self, key: str, want: float, need: float, capacity: float, per_s: float) -> tuple[float, float]:
            self.calls += 1
            now = clock[0]  # the script runs as the call arrives
            self.tokens, self.at = min(capacity, self.tokens + (now - self.at) * per_s), now
            clock[0] += 0.6  # and its answer takes this long to come back
            if self.tokens >= need:
                granted = min(want, self.tokens)
                self.tokens -= granted
                return granted, 0.0
            return 0.0, (min(need, capacity) - self.tokens) / per_s

        async def debit(self, key: str, amount: float, capacity: float, per_s: float) -> None:
            return None

    bucket = SlowBucket()
    limit = RateLimit("acme:requests", 120, bucket)
    assert await limit.take(1) == pytest.approx(0.5)  # empty: refill 1 token in 0.5 s
    # 0.6 s have passed since the script ran: the bucket holds 1.2 tokens, and is asked.
    assert await limit.take(1) == 0 and bucket.calls == 2
