"""Every store whose Redis scripts begin with OWNED_LUA (gateway/redis_client.py) says each key of another type it
deleted: counted in tenantgate_redis_key_repairs_total{store} and logged. Before, only the residency store counted
its repairs; the placement store logged without a figure, and the rate buckets, the traffic exchange, the reload
fan-out and the drains deleted such a key in silence. A test per store: the key spoiled, the store's own call made,
the repair counted under that store's label (and no other) and named in a warning."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest
import redis.asyncio

from gateway.admin.drains import Drains
from gateway.observe.metrics import GatewayMetrics
from gateway.placement.exchange import TrafficExchange
from gateway.placement.store import RedisHomesStore
from gateway.redis_client import _LOGGED_KEYS, KEY_REPAIR_STORES, KeyRepairs, make_client
from gateway.reload_fanout import GATEWAY_ID, Fanout
from gateway.residency.redis import RedisStore
from gateway.tenants.rate_buckets import RedisBuckets
from tests.redis_server import RedisServer

pytestmark = pytest.mark.timeout(60)


@dataclass
class Case:
    key: str  # the key spoiled, after the prefix
    call: Callable[[str, str, GatewayMetrics], Awaitable[None]]  # (url, prefix, metrics): the store's own call


async def residency(url: str, prefix: str, metrics: GatewayMetrics) -> None:
    store = RedisStore(url, prefix=prefix, operation_timeout_s=5, metrics=metrics)
    try:
        await store.record("llama", "r0")
    finally:
        await store.close()


async def placement(url: str, prefix: str, metrics: GatewayMetrics) -> None:
    client = make_client(url, 5.0)
    store = RedisHomesStore(client, operation_timeout_s=5, lease_s=30.0, prefix=prefix, repairs=metrics.key_repairs)
    try:
        await store.poll("gw-a", 0)
    finally:
        await store.close()


async def rate_buckets(url: str, prefix: str, metrics: GatewayMetrics) -> None:
    buckets = RedisBuckets(url, prefix=prefix, operation_timeout_s=5, repairs=metrics.key_repairs)
    try:
        await buckets.lease("acme:requests", 1, 1, 60, 1.0)
    finally:
        await buckets.close()


async def rate_buckets_debit(url: str, prefix: str, metrics: GatewayMetrics) -> None:
    buckets = RedisBuckets(url, prefix=prefix, operation_timeout_s=5, repairs=metrics.key_repairs)
    try:
        await buckets.debit("acme:requests", 1, 60, 1.0)
    finally:
        await buckets.close()


async def traffic(url: str, prefix: str, metrics: GatewayMetrics) -> None:
    exchange = TrafficExchange(
        url, operation_timeout_s=5, stale_after_s=30.0, prefix=prefix, repairs=metrics.key_repairs
    )
    try:
        await exchange.swap("gw-a", "{}")
    finally:
        await exchange.close()


async def _no_reload() -> dict[str, str]:
    return {}


async def reload_fanout(url: str, prefix: str, metrics: GatewayMetrics) -> None:
    fanout = Fanout(url, _no_reload, operation_timeout_s=5, prefix=prefix, repairs=metrics.key_repairs)
    try:
        await fanout.everywhere({"gateway": GATEWAY_ID})
    finally:
        await fanout._client.aclose()
        await fanout._subscriber.aclose()


async def reload_fanout_heartbeat(url: str, prefix: str, metrics: GatewayMetrics) -> None:
    fanout = Fanout(url, _no_reload, operation_timeout_s=5, prefix=prefix, repairs=metrics.key_repairs)
    try:
        await fanout.beat()
    finally:
        await fanout._client.aclose()
        await fanout._subscriber.aclose()


async def drains(url: str, prefix: str, metrics: GatewayMetrics) -> None:
    store = Drains(url, prefix=prefix, operation_timeout_s=5, repairs=metrics.key_repairs)
    try:
        await store.sync()
    finally:
        await store.close()


async def drains_set(url: str, prefix: str, metrics: GatewayMetrics) -> None:
    store = Drains(url, prefix=prefix, operation_timeout_s=5, repairs=metrics.key_repairs)
    try:
        await store.set("llama", "r0", True)
    finally:
        await store.close()


CASES = {
    "residency": Case("{llama:r0}:resident", residency),
    "placement": Case("{placement}:operator", placement),
    "rate_buckets": Case("rl:{acme:requests}:60", rate_buckets),
    "rate_buckets debit": Case("rl:{acme:requests}:60", rate_buckets_debit),
    "traffic": Case("{traffic}:by_gateway", traffic),
    "reload_fanout": Case("gateways", reload_fanout),
    "reload_fanout heartbeat": Case("gateways", reload_fanout_heartbeat),
    "drains": Case("{drains}", drains),
    "drains set": Case("{drains}", drains_set),
}


@pytest.fixture
async def raw(redis_server: RedisServer) -> AsyncIterator[redis.asyncio.Redis]:
    client = redis.asyncio.Redis.from_url(redis_server.url, decode_responses=True)
    yield client
    await client.aclose()


def test_every_store_is_covered() -> None:
    assert {name.partition(" ")[0] for name in CASES} == set(KEY_REPAIR_STORES)


@pytest.mark.parametrize("name", CASES)
async def test_each_stores_repair_is_counted_under_its_label_and_logged(
    redis_server: RedisServer, raw: redis.asyncio.Redis, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    store, case = name.partition(" ")[0], CASES[name]
    prefix = f"test-{uuid.uuid4().hex}"
    key = f"{prefix}:{case.key}"
    metrics = GatewayMetrics()
    await raw.set(key, "someone else's string")
    await case.call(redis_server.url, prefix, metrics)
    assert await raw.type(key) != "string"  # repaired (deleted, and written again by the call where it writes)
    for label in KEY_REPAIR_STORES:
        count = metrics.registry.get_sample_value("tenantgate_redis_key_repairs_total", {"store": label})
        assert (count or 0.0) == (1.0 if label == store else 0.0), (label, count)
    assert f"{store} store: {key} held a string" in caplog.text


def test_past_the_remembered_keys_a_repair_is_counted_and_not_logged_again(caplog: pytest.LogCaptureFixture) -> None:
    """Each key's repair is logged once for the first _LOGGED_KEYS keys; past them one line says the rest are counted
    only. Before, every repair of a key the set could no longer hold was logged, each time it was met."""
    metrics = GatewayMetrics()
    repairs = KeyRepairs("rate_buckets", metrics.key_repairs)
    with caplog.at_level(logging.WARNING, logger="gateway.redis_client"):
        repairs.note(f"tg:rl:{n} string" for n in range(_LOGGED_KEYS))
        repairs.note(["tg:rl:0 string"])  # remembered: counted, not logged
        assert len(caplog.records) == _LOGGED_KEYS
        for _ in range(3):
            repairs.note(["tg:rl:late string", "tg:rl:later set"])
    assert len(caplog.records) == _LOGGED_KEYS + 1
    assert "further repairs are counted only" in caplog.records[-1].getMessage()
    assert metrics.key_repairs.labels("rate_buckets")._value.get() == _LOGGED_KEYS + 1 + 6
