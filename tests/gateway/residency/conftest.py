from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from gateway.residency.memory import MemoryStore
from gateway.residency.redis import RedisStore
from gateway.residency.store import ResidencyStore
from tests.redis_server import RedisServer


@pytest.fixture(params=["memory", "redis"], ids=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[ResidencyStore]:
    """Each contract test runs against the in-process store and against a real redis-server."""
    if request.param == "memory":
        memory = MemoryStore()
        yield memory
        await memory.close()
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    shared = RedisStore(server.url, prefix=f"test-{uuid.uuid4().hex}")
    try:
        yield shared
    finally:
        await shared.close()
