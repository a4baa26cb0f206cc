"""Two gateways sharing Redis whose wall clocks disagree (one 5 minutes ahead, as a host whose NTP broke).

Use marks in the shared record are unix seconds, compared by every gateway with its own clock: a mark a gateway
ahead wrote looked, to the others, like a use still to come. Those adapters were never idle to them (never the
least recently used, never evicted by the timer) until the real time caught up with the mark; and as last-use
times only move forward (``ZADD GT``), the mark stayed after the clock was fixed. Now the gateways sharing a store
stamp use times on the store's clock (Redis' ``TIME``, learned at each sync), whatever their own says.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import pytest

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


class JumpingRedis(RedisStore):
    """A Redis whose clock runs ``jump_s`` ahead while the test says so (its host's clock set wrong, then fixed)."""

    jump_s = 0.0

    async def clock(self) -> float | None:
        now = await super().clock()
        return None if now is None else now + self.jump_s


async def test_a_redis_clock_that_jumped_an_hour_ahead_and_back_leaves_no_adapter_in_use_for_good(
    redis_server: RedisServer,
) -> None:
    """Marks stamped while Redis' clock ran an hour ahead stayed an hour in the future once it was set back (last
    uses only move forward): those adapters were "just used" to every gateway, never evicted, and a load needing
    their slot on an engine that refuses a full cache waited out the slot wait and was refused (503). Now the
    reconciliation sets such marks to now and no view keeps them."""
    store = JumpingRedis(redis_server.url, prefix="jump", operation_timeout_s=5.0)
    engine = FakeEngine()
    life = gateway(store, engine, time.time)
    try:
        store.jump_s = 3600.0
        await life.sync()
        for name in ("a", "b"):  # used, then ended, while Redis' clock ran ahead
            await life.ensure("r0", ref(name))
            life.begin_use("r0", name)
            life.end_use("r0", name)
        await life.flush_uses()
        assert max((await store.record("llama", "r0")).resident.values()) > time.time() + 3000
        store.jump_s = 0.0  # the clock is set right
        await life.sync()
        await life.reconcile()
        record = await store.record("llama", "r0")
        assert max(record.resident.values()) <= time.time() + 5, record
        assert max(life.views["r0"].resident.values()) <= time.time() + 5
        await life.ensure("r0", ref("c"))  # once a and b leave the in-use window (a second), one makes room
        assert "c" in engine.loaded["r0"] and len(engine.loaded["r0"]) == 2
    finally:
        await store.close()


@pytest.mark.parametrize("answer", [["x", "1"], ["1700000000"], [str(10**12), "0"], ["1700000000", "-5"], None])
async def test_a_time_answer_that_is_no_time_keeps_the_offset_and_the_sync_goes_on(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, answer: list[str] | None
) -> None:
    """A Redis-speaking server (a proxy, another implementation) whose TIME is garbage: the sync raised ValueError,
    read no record (every 2 s, for good), and ended a starting gateway's start-up task (never ready). Now the
    offset is kept, logged."""
    store = RedisStore(redis_server.url, prefix=f"garbage-{uuid.uuid4().hex}", operation_timeout_s=5.0)
    engine = FakeEngine()
    life, other = gateway(store, engine, time.time), gateway(store, engine, time.time)
    try:
        await life.sync()
        offset = life._clock_offset

        async def garbage(**_: object) -> object:
            return answer

        monkeypatch.setattr(store, "_clock", garbage)
        await other.ensure("r0", ref("a"))  # another gateway's load: this one's sync must read it
        await life.sync()
        assert "a" in life.views["r0"].resident and life.store_up
        assert life._clock_offset == offset
    finally:
        await store.close()
