"""Two gateways sharing Redis whose wall clocks disagree (one 5 minutes ahead, as a host whose NTP broke).

Use marks in the shared record are unix seconds, compared by every gateway with its own clock: a mark a gateway
ahead wrote looked, to the others, like a use still to come. Those adapters were never idle to them (never the
least recently used, never evicted by the timer) until the real time caught up with the mark; and as last-use
times only move forward (``ZADD GT``), the mark stayed after the clock was fixed. Now the gateways sharing a store
stamp use times on the store's clock (Redis' ``TIME``, learned at each sync), whatever their own says.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from backends.base import Endpoint
from gateway.config import ResidencyConfig
from gateway.residency.lifecycle import PoolResidency
from gateway.residency.redis import RedisStore
from tests.gateway.residency.fakes import FakeDriver, FakeEngine, ref
from tests.redis_server import RedisServer

AHEAD_S = 300.0


def gateway(store: RedisStore, engine: FakeEngine, clock: Callable[[], float]) -> PoolResidency:
    """A gateway's lifecycle on a TensorRT-LLM-like engine (a full working set refuses a load: it must evict)."""
    return PoolResidency(
        "llama", [Endpoint("r0", "http://r0")], FakeDriver(engine), store, ResidencyConfig(slot_wait_timeout_s=3.0),
        max_adapters=2, load_timeout_s=30.0, shared=True, wall_clock=clock,
    )  # fmt: skip


def ahead() -> float:
    return time.time() + AHEAD_S


async def test_a_gateway_whose_clock_is_ahead_does_not_pin_its_adapters_for_the_others(
    redis_server: RedisServer,
) -> None:
    store = RedisStore(redis_server.url, prefix="skew", operation_timeout_s=5.0)
    engine = FakeEngine()
    fast, right = gateway(store, engine, ahead), gateway(store, engine, time.time)
    try:
        for life in (fast, right):
            await life.sync()
        for name in ("a", "b"):  # the fast gateway's requests used both adapters, then ended
            await fast.ensure("r0", ref(name))
            fast.begin_use("r0", name)
            fast.end_use("r0", name)
        await fast.flush_uses()
        await right.sync()
        assert set(right.views["r0"].resident) == {"a", "b"}
        # Nothing is in flight anywhere: once the marks leave the in-use window (a second), one is evicted.
        await right.ensure("r0", ref("c"))
        assert "c" in engine.loaded["r0"] and len(engine.loaded["r0"]) == 2
        # And no mark in the record lies in the future of the store's clock.
        record = await store.record("llama", "r0")
        assert max(record.resident.values()) <= time.time() + 5, record
    finally:
        await store.close()
