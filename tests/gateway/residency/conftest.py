from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from gateway.residency.memory import MemoryStore
from gateway.residency.redis import RedisStore
from gateway.residency.store import ResidencyStore
from tests.redis_cluster import RedisCluster
from tests.redis_server import RedisServer


@pytest.fixture(params=["memory", "redis", "cluster"], ids=["memory", "redis", "cluster"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[ResidencyStore]:
    """Each contract test runs against the in-process store, a real redis-server and a real Redis Cluster."""
    if request.param == "memory":
        memory = MemoryStore()
        yield memory
        await memory.close()
        return
    cluster = request.param == "cluster"
    server: RedisServer | RedisCluster = request.getfixturevalue("redis_cluster" if cluster else "redis_server")
    # The contract is what a call does, not how fast: the default 0.5 s fail-fast bound (tested with the gateway's
    # fallbacks) is too short for a cluster client's first call, which discovers the slots, on a loaded machine.
    shared = RedisStore(server.url, prefix=f"test-{uuid.uuid4().hex}", operation_timeout_s=5.0, cluster=cluster)
    try:
        yield shared
    finally:
        await shared.close()
