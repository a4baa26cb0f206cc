"""One way to talk to Redis: a client that fails fast (no retries, bounded calls), and every failure as
``StoreUnavailable``, so callers fall back to local state instead of waiting on Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis.asyncio
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.residency.store import StoreUnavailable

Client = redis.asyncio.Redis | RedisCluster


def make_client(url: str, operation_timeout_s: float, *, subscriber: bool = False, cluster: bool = False) -> Client:
    """``subscriber``: for pub/sub, whose reads wait for the next message however long (no read timeout).
    ``cluster``: a Redis Cluster (``url`` names any node); every multi-key change the gateway makes touches one
    slot (hash-tagged keys). The cluster client keeps its own retries: a failover needs a topology refresh."""
    if cluster:
        return RedisCluster.from_url(
            url,
            socket_timeout=None if subscriber else operation_timeout_s,
            socket_connect_timeout=operation_timeout_s,
            decode_responses=True,
        )
    return redis.asyncio.Redis.from_url(
        url,
        socket_timeout=None if subscriber else operation_timeout_s,
        socket_connect_timeout=operation_timeout_s,
        retry=Retry(NoBackoff(), 0),
        decode_responses=True,
    )


@asynccontextmanager
async def redis_call(what: str, timeout_s: float) -> AsyncIterator[None]:
    # asyncio.TimeoutError is TimeoutError (Python >= 3.11); redis' own TimeoutError is a RedisError.
    try:
        async with asyncio.timeout(timeout_s):
            yield
    except (RedisError, OSError, TimeoutError) as exc:
        raise StoreUnavailable(f"redis {what} failed: {exc!r}") from exc
