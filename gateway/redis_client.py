"""One way to talk to Redis: a client that fails fast (no retries, bounded calls), and every failure as
``StoreUnavailable``, so callers fall back to local state instead of waiting on Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.residency.store import StoreUnavailable


def make_client(url: str, operation_timeout_s: float, *, subscriber: bool = False) -> redis.asyncio.Redis:
    """``subscriber``: for pub/sub, whose reads wait for the next message however long (no read timeout)."""
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
