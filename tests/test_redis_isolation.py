"""Tests that share the session's redis-server cannot see each other's keys: the ``redis_server`` fixture empties
it for each test. The two tests run in this order (pytest keeps a module's order): the second finds nothing of
what the first left, under the key names a gateway process uses by default."""

from __future__ import annotations

import redis

from tests.redis_server import RedisServer

LEFT_BEHIND = {"tg:{llama:r0}:resident": "lora-a", "tg:rl:{t0:requests}:600": "tokens", "tg:{registry}:tenants": "t9"}


def test_a_test_leaves_keys_behind(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    for key, value in LEFT_BEHIND.items():
        client.set(key, value)
    assert client.dbsize() == len(LEFT_BEHIND)
    client.close()


def test_the_next_test_finds_redis_empty(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    assert client.dbsize() == 0
    assert client.keys("tg:*") == []
    client.close()
