"""The slot signal over Redis pub/sub (gateway/residency/signal_redis.py): two gateways' channels on a real
redis-server and a real Redis Cluster; the subscription dropping when Redis dies, and coming back with it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import uuid
from collections.abc import AsyncIterator, Callable, Collection, Iterator
from pathlib import Path

import pytest

from gateway.observe.metrics import GatewayMetrics
from gateway.residency.signal_redis import QUIET_S, RedisSlotChannel
from tests.redis_cluster import RedisCluster
from tests.redis_server import RedisServer


class Listener:
    """A pool's lifecycle as the signal sees it: what it holds, and the releases it was told of."""

    def __init__(self, held: frozenset[str] = frozenset()) -> None:
        self.held = held
        self.released: list[str] = []
        self.changed: list[str] = []

    def held_here(self, replica_id: str) -> frozenset[str]:
        return self.held

    def remote_release(self, replica_id: str) -> None:
        self.released.append(replica_id)

    def remote_set_changed(self, replica_id: str) -> None:
        self.changed.append(replica_id)

    def remote_unlocked(self, replica_id: str) -> None:
        pass

    def flying(self) -> Iterator[tuple[str, frozenset[str], int]]:
        return iter([("r0", self.held, len(self.held))] if self.held else [])

    def remote_used(self, replica_id: str, adapters: Collection[str]) -> None:
        pass


@contextlib.asynccontextmanager
async def channel(url: str, prefix: str, *, cluster: bool = False) -> AsyncIterator[RedisSlotChannel]:
    slots = RedisSlotChannel(url, GatewayMetrics(), operation_timeout_s=2.0, prefix=prefix, cluster=cluster)
    following = asyncio.create_task(slots.run())
    try:
        yield slots
    finally:
        following.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await following
        await slots.close()


async def until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(2_000):  # a bounded poll, up to 10 s
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never: {what}")


def signal_up(slots: RedisSlotChannel) -> float | None:
    return slots.signal.metrics.registry.get_sample_value("tenantgate_adapter_slot_signal_up")


def received(slots: RedisSlotChannel) -> float | None:
    labels = {"pool": "llama", "direction": "received"}
    return slots.signal.metrics.registry.get_sample_value("tenantgate_adapter_slot_releases_total", labels)


@pytest.mark.parametrize("kind", ["redis", "cluster"])
async def test_a_wait_and_a_release_reach_the_other_gateway(kind: str, request: pytest.FixtureRequest) -> None:
    cluster = kind == "cluster"
    server: RedisServer | RedisCluster = request.getfixturevalue("redis_cluster" if cluster else "redis_server")
    prefix = f"test-{uuid.uuid4().hex}"
    async with channel(server.url, prefix, cluster=cluster) as a, channel(server.url, prefix, cluster=cluster) as b:
        holder, waiter = Listener(frozenset({"x"})), Listener()
        a.signal.attach("llama", holder)
        b.signal.attach("llama", waiter)
        await until(lambda: a.signal.listening and b.signal.listening, "both subscribed")
        assert signal_up(a) == 1
        with b.signal.waiting("llama", "r0"):
            await until(lambda: a.signal.remote_waiting("llama", "r0"), "A hears B's wait")
            await until(lambda: b.signal.remote_holds("llama", "r0") == frozenset({"x"}), "B knows A holds x")
            holder.held = frozenset()
            a.signal.changed("llama", "r0", freed=True)
            await until(lambda: received(b) == 1, "B hears A's release")
            assert b.signal.remote_holds("llama", "r0") == frozenset()
            assert waiter.released == ["r0", "r0"]  # woken when its wait settled, then by the release
        assert holder.released == []  # A waits nowhere: nothing to wake
        a.signal.set_changed("llama", "r1")  # A loaded or unloaded an adapter there: B reads r1 again
        await until(lambda: waiter.changed == ["r1"], "B hears that r1's resident set changed")
        assert holder.changed == []  # a gateway's own news is not news to it
        holder.held = frozenset({"y"})  # a request of A's with y began on r0: shared at A's next batch
        a.signal.changed("llama", "r0", freed=False)
        await until(lambda: b.signal.flying_elsewhere("llama", "r0", "y"), "B knows A has y in flight on r0")
        assert b.signal.load_elsewhere("llama") == {"r0": 1}
        assert not a.signal.flying_elsewhere("llama", "r0", "y")  # its own, not another gateway's


def test_the_subscriptions_quiet_period_is_the_second_the_runbook_gives() -> None:
    """docs/operations.md, tenantgate_adapter_slot_signal_up: a subscription silent for a second is pinged, and
    taken as down when that ping goes unanswered for another (a frozen Redis shows within 2 s; the timing itself is
    bounded by the test below, not asserted to the millisecond)."""
    assert QUIET_S == 1.0


async def test_a_frozen_redis_turns_the_signal_down_within_two_quiet_periods(tmp_path: Path) -> None:
    """Redis SIGSTOPped (accepts nothing, answers nothing, resets nothing): the signal says it does not listen within
    2 x signal_redis.QUIET_S (2 s) of the last message, not the connection-wide 15-30 s it took before (found with a
    real frozen Redis: the gauge stayed 1 for up to 30 s). The bounded poll allows 8 s; it waited 15 s at least."""
    with RedisServer(log_path=tmp_path / "redis.log") as server:
        async with channel(server.url, "tg") as a:
            await until(lambda: a.signal.listening, "subscribed")
            assert server._process is not None
            os.kill(server._process.pid, signal.SIGSTOP)
            try:
                for _ in range(800):  # a bounded poll, up to 8 s
                    if not a.signal.listening:
                        break
                    await asyncio.sleep(0.01)
                assert signal_up(a) == 0
            finally:
                os.kill(server._process.pid, signal.SIGCONT)
            await until(lambda: a.signal.listening, "subscribed again once Redis runs")


async def test_the_subscription_drops_with_redis_and_comes_back_with_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """While Redis is away the signal says it does not listen (metric 0; waits judge by the in-use window); back,
    it subscribes again and announces the waits it has, so the others hear of them."""
    with RedisServer(log_path=tmp_path / "redis.log") as server:
        async with channel(server.url, "tg") as a, channel(server.url, "tg") as b:
            await until(lambda: a.signal.listening and b.signal.listening, "both subscribed")
            server.stop()
            await until(lambda: not a.signal.listening, "A notices the subscription dropped")
            assert signal_up(a) == 0
            assert "slot signal: not listening" in caplog.text
            with a.signal.waiting("llama", "r0"):
                assert a.signal.remote_holds("llama", "r0") is None
                server.start()  # same port, empty
                await until(lambda: a.signal.listening and b.signal.listening, "both subscribed again")
                await until(lambda: b.signal.remote_waiting("llama", "r0"), "B hears A's wait, announced again")
                await until(lambda: a.signal.remote_holds("llama", "r0") is not None, "A's wait settles")
            assert signal_up(a) == 1
