"""The Redis store when Redis dies: every operation fails as StoreUnavailable, and it recovers when Redis is back."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import redis.asyncio

from backends.base import Endpoint
from gateway.config import ResidencyConfig
from gateway.observe.metrics import GatewayMetrics
from gateway.residency.lifecycle import PoolResidency
from gateway.residency.redis import RedisStore
from gateway.residency.store import ReplicaRecord, StoreUnavailable
from tests.gateway.residency.fakes import FakeDriver, FakeEngine, ref
from tests.redis_server import RedisServer

OPERATIONS: dict[str, Callable[[RedisStore], Awaitable[object]]] = {
    "record": lambda store: store.record("llama", "r0"),
    "acquire": lambda store: store.acquire("llama", "r0", "gw1 a", ttl_s=5),
    "release": lambda store: store.release("llama", "r0", "gw1 a"),
    "add": lambda store: store.add("llama", "r0", "a", 1.0, pinned=True),
    "remove": lambda store: store.remove("llama", "r0", ["a"]),
    "touch": lambda store: store.touch({("llama", "r0", "a"): 2.0}),
    "reconcile": lambda store: store.reconcile("llama", "r0", ["a"], now=3.0),
    "ping": lambda store: store.ping(),
}


async def test_a_dead_redis_is_unavailable_and_the_store_recovers_when_it_is_back(tmp_path: Path) -> None:
    with RedisServer(log_path=tmp_path / "redis.log") as server:
        store = RedisStore(server.url, operation_timeout_s=0.5)
        try:
            await store.add("llama", "r0", "a", 1.0)  # the pool holds a connection to the server about to die
            server.stop()
            for name, operation in OPERATIONS.items():
                try:
                    await operation(store)
                except StoreUnavailable:
                    continue
                raise AssertionError(f"{name} did not raise StoreUnavailable with Redis down")
            server.start()  # same port, empty (no persistence)
            await store.ping()
            await store.add("llama", "r0", "b", 5.0, pinned=True)
            assert await store.acquire("llama", "r0", "gw1 b", ttl_s=5)
            assert await store.record("llama", "r0") == ReplicaRecord({"b": 5.0}, frozenset({"b"}), "gw1 b")
            assert (await store.reconcile("llama", "r0", ["b", "c"], now=9.0)).resident == {"b": 5.0}
        finally:
            await store.close()


WRONG_TYPES = [
    pytest.param("resident", lambda raw, key: raw.set(key, "lora-a"), id="resident a string"),
    pytest.param("pinned", lambda raw, key: raw.hset(key, "a", "1"), id="pinned a hash"),
    pytest.param("lock", lambda raw, key: raw.sadd(key, "gw9 a"), id="lock a set"),
]


@pytest.mark.parametrize(("which", "write"), WRONG_TYPES)
async def test_a_record_key_of_the_wrong_type_is_repaired_alone_not_the_store_down(
    redis_server: RedisServer, which: str, write: Callable[[redis.asyncio.Redis, str], Awaitable[object]]
) -> None:
    """Someone SETs a string where the replica's resident ZSET lives (or a hash for its pinned SET, a set for its
    lock STRING): every call on the replica raised WRONGTYPE, which is StoreUnavailable, so the pool's store was
    down (routing from the local view, readyz saying so) until an operator deleted the key. The gateway owns these
    keys: the bad one is deleted (the record rebuilt from the engines by the next reconciliation), logged and
    counted, and every operation on the replica answers; the other replica's record is untouched."""
    prefix = f"test-{uuid.uuid4().hex}"
    metrics = GatewayMetrics()
    store = RedisStore(redis_server.url, prefix=prefix, operation_timeout_s=5, metrics=metrics)
    raw = redis.asyncio.Redis.from_url(redis_server.url, decode_responses=True)
    key = f"{prefix}:{{llama:r0}}:{which}"

    async def spoil() -> None:
        await raw.delete(key)
        await write(raw, key)

    try:
        await store.add("llama", "r1", "b", 1.0, pinned=True)
        await spoil()
        record = await store.record("llama", "r0")
        assert record.repaired == frozenset({which}) and record.resident == {}
        for operation in OPERATIONS.values():
            await spoil()
            await operation(store)  # none raises
        await raw.delete(*(f"{prefix}:{{llama:r0}}:{name}" for name in ("resident", "pinned", "lock")))
        await store.add("llama", "r0", "c", 7.0, pinned=True)
        assert await store.acquire("llama", "r0", "gw1 c", ttl_s=5)
        assert await store.record("llama", "r0") == ReplicaRecord({"c": 7.0}, frozenset({"c"}), "gw1 c")
        assert await store.record("llama", "r1") == ReplicaRecord({"b": 1.0}, frozenset({"b"}), None)
        repairs = metrics.registry.get_sample_value("tenantgate_redis_key_repairs_total", {"store": "residency"})
        assert repairs is not None and repairs >= 2
    finally:
        await raw.aclose()
        await store.close()


@pytest.mark.parametrize("which", ["resident", "pinned"])
async def test_a_sync_that_meets_a_bad_record_key_keeps_the_store_up_and_rebuilds_the_record(
    redis_server: RedisServer, which: str
) -> None:
    """The pool's sync reads every replica's record: one replica's resident key SET to a string raised out of the
    sync before the other replicas were read, and marked the store down until an operator deleted it. Now the
    store stays up, the other replica's record is still read (another gateway's load there seen), and the bad
    replica's record is rebuilt from its engine's listing and its pins from the gateway's view, which is kept
    meanwhile."""
    prefix = f"test-{uuid.uuid4().hex}"
    store = RedisStore(redis_server.url, prefix=prefix, operation_timeout_s=5)
    raw = redis.asyncio.Redis.from_url(redis_server.url, decode_responses=True)
    engine = FakeEngine()

    def gateway() -> PoolResidency:
        return PoolResidency(
            "llama", [Endpoint("r0", "http://r0"), Endpoint("r1", "http://r1")], FakeDriver(engine), store,
            ResidencyConfig(), max_adapters=2, load_timeout_s=30.0, shared=True,
        )  # fmt: skip

    here, there = gateway(), gateway()
    try:
        await here.sync()
        await here.ensure("r0", ref("a"), pinned=True)
        await raw.set(f"{prefix}:{{llama:r0}}:{which}", "not a zset or a set")
        await there.ensure("r1", ref("b"))  # another gateway's load on the other replica
        await here.sync()
        assert here.store_up
        assert "b" in here.views["r1"].resident  # read past the bad replica
        assert "a" in here.views["r0"].resident  # kept, and written back from the engine's listing:
        record = await store.record("llama", "r0")
        assert record.resident.keys() == {"a"} and record.pinned == {"a"} and not record.repaired
        await here.sync()  # the record as it is now adopted: the pin with it
        assert here.views["r0"].pinned == {"a"}
    finally:
        await raw.aclose()
        await store.close()


@pytest.mark.parametrize(
    ("which", "write"),
    [
        pytest.param("resident", lambda store: store.add("llama", "r0", "c", 7.0), id="resident, by an add"),
        pytest.param("pinned", lambda store: store.remove("llama", "r0", ["b"]), id="pinned, by a remove"),
    ],
)
async def test_a_repair_by_a_write_is_reported_by_the_replicas_next_read(
    redis_server: RedisServer, which: str, write: Callable[[RedisStore], Awaitable[object]]
) -> None:
    """A write (an add, a remove) that meets a record key of another type deletes it too, and with it what the
    record held but the adapter written. Only a read said so, so the lifecycle took the rest for gone: its view of
    the replica lost the adapters (or pins) another gateway had recorded there, and nothing rebuilt the record from
    the engine. The replica's next read says what was repaired since its last one, once; a reconciliation, which
    rebuilds the record, clears it."""
    prefix = f"test-{uuid.uuid4().hex}"
    store = RedisStore(redis_server.url, prefix=prefix, operation_timeout_s=5)
    raw = redis.asyncio.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        await store.add("llama", "r0", "a", 1.0, pinned=True)
        await raw.delete(f"{prefix}:{{llama:r0}}:{which}")
        await raw.set(f"{prefix}:{{llama:r0}}:{which}", "not what the gateway writes")
        await write(store)
        assert (await store.record("llama", "r0")).repaired == {which}
        assert not (await store.record("llama", "r0")).repaired
        await raw.set(f"{prefix}:{{llama:r0}}:{which}", "again")
        await write(store)
        await store.reconcile("llama", "r0", ["a"], now=9.0)
        assert not (await store.record("llama", "r0")).repaired
    finally:
        await raw.aclose()
        await store.close()
