"""The Redis store when Redis dies: every operation fails as StoreUnavailable, and it recovers when Redis is back."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from gateway.residency.redis import RedisStore
from gateway.residency.store import ReplicaRecord, StoreUnavailable
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
