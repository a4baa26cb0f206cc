"""Slot releases across gateways (gateway/residency/signal.py): gateways' lifecycles sharing a store (in-process, a
real redis-server, a real Redis Cluster), their signals joined by an in-memory bus that delivers as pub/sub does
(to every subscribed signal, the sender's own included, a loop turn later). The Redis transport has its own tests
(test_slot_signal_redis.py).

The in-use window is 10 s (a flush every 2.5 s) and the slot wait 3 s: without the signal, a slot another gateway
frees is seen only when its use mark leaves the window, long after the wait has given up.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Collection, Iterator
from typing import Any

import pytest

from backends.base import AdapterRef, Endpoint
from backends.errors import AdapterCacheFull, AdapterLoadFailed
from gateway.config import ResidencyConfig
from gateway.observe.metrics import GatewayMetrics
from gateway.residency import signal as signal_module
from gateway.residency import signal_redis
from gateway.residency.lifecycle import PoolResidency
from gateway.residency.memory import MemoryStore
from gateway.residency.signal import FLYING_GRACE_S, REMOTE_TTL_S, RENEW_S, SETTLE_S, SlotSignal
from gateway.residency.signal_redis import RedisSlotChannel
from gateway.residency.store import ReplicaRecord, ResidencyStore
from gateway.tasks import cancel_and_wait
from tests.clock import Clock
from tests.gateway.residency.fakes import FakeDriver, FakeEngine, ref
from tests.gateway.residency.test_lifecycle import START, lifecycle, until_a_load_waits
from tests.redis_server import RedisServer

LONG_WINDOW = ResidencyConfig(use_flush_interval_s=2.5, slot_wait_timeout_s=3.0)


class Bus:
    """What Redis pub/sub does for the signals of the gateways in a test; counts what was published."""

    def __init__(self) -> None:
        self.signals: list[SlotSignal] = []
        self.published: list[dict[str, Any]] = []
        self.lose: Callable[[dict[str, Any]], bool] = lambda message: False  # messages that never arrive

    def signal(self, clock: Clock | None = None, metrics: GatewayMetrics | None = None) -> SlotSignal:
        signal = SlotSignal(self._publish, metrics or GatewayMetrics(), clock=clock or time.monotonic)
        self.signals.append(signal)
        signal.subscribed(True)
        return signal

    async def _publish(self, body: str) -> None:
        message = json.loads(body)
        self.published.append(message)
        if self.lose(message):
            return
        loop = asyncio.get_running_loop()
        for signal in self.signals:
            if signal.listening:
                loop.call_soon(signal.heard, body)


def releases(life: PoolResidency, direction: str) -> float:
    value = life.metrics.registry.get_sample_value(
        "tenantgate_adapter_slot_releases_total", {"pool": "llama", "direction": direction}
    )
    return value or 0.0


def waited(life: PoolResidency) -> float:
    """How many times a load of the gateway's started (or went back to) waiting for a slot on r0."""
    labels = {"pool": "llama", "replica": "r0", "outcome": "waited"}
    return life.metrics.registry.get_sample_value("tenantgate_adapter_slot_waits_total", labels) or 0.0


def gateway(store: ResidencyStore, engine: FakeEngine, bus: Bus, config: ResidencyConfig = LONG_WINDOW, *,
            max_adapters: int = 1) -> PoolResidency:  # fmt: skip
    """A gateway's lifecycle sharing ``store`` and ``engine``, with its own signal on ``bus`` (and its metrics)."""
    metrics = GatewayMetrics()
    signal = bus.signal(metrics=metrics)
    return lifecycle(store, engine, time.time, shared=True, config=config, max_adapters=max_adapters, signal=signal,
                     metrics=metrics)  # fmt: skip


async def until_it_hears_the_wait(life: PoolResidency) -> None:
    signal = life.signal
    assert isinstance(signal, SlotSignal)
    for _ in range(5_000):  # a bounded poll
        if signal.remote_waiting("llama", "r0"):
            return
        await asyncio.sleep(0.001)
    raise AssertionError("the wait on r0 was not heard")


async def until(condition: Callable[[], bool], failure: Callable[[], str]) -> None:
    """A bounded poll (5 s): messages are published from tasks of their own, and acted on in others."""
    for _ in range(5_000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(failure())


async def until_held(bus: Bus, adapters: list[str]) -> None:
    await until(
        lambda: [m["a"] for m in bus.published if m["t"] == "held"] == [adapters],
        lambda: f"no held set {adapters} was published: {bus.published}",
    )


async def test_a_slot_another_gateway_frees_ends_the_wait_long_before_the_in_use_window(
    store: ResidencyStore,
) -> None:
    """Gateway A's request holds r0's one slot; B's load waits for it. When A's request ends, A says so (B waits
    there) and B loads at once: without the release B would give up at 3 s, the mark still in its 10 s window."""
    engine, bus = FakeEngine(), Bus()
    a, b = gateway(store, engine, bus), gateway(store, engine, bus)
    await a.ensure("r0", ref("x"))
    a.begin_use("r0", "x")
    await a.flush_uses()
    waiting = asyncio.create_task(b.ensure("r0", ref("y")))
    await until_a_load_waits(b)
    await until_it_hears_the_wait(a)
    await until_held(bus, ["x"])  # A answered the announcement
    a.end_use("r0", "x")
    await waiting  # AdapterCacheFull at 3 s without the release
    assert engine.loaded["r0"] == {"y"} and b.slot_waiters["r0"] == 0
    assert releases(a, "published") == 1 and releases(b, "received") == 1


async def test_an_adapter_a_third_gateway_holds_stays_though_it_is_the_least_recently_used(
    store: ResidencyStore,
) -> None:
    """r0 holds old (C's request in flight, loaded first) and x (A's). A's release frees x, not old: the held sets
    say C still uses old, though its mark is the oldest and neither is past the window."""
    engine, bus = FakeEngine(), Bus()
    a, b, c = (gateway(store, engine, bus, max_adapters=2) for _ in "abc")
    await c.ensure("r0", ref("old"))
    c.begin_use("r0", "old")
    await a.ensure("r0", ref("x"))
    a.begin_use("r0", "x")
    waiting = asyncio.create_task(b.ensure("r0", ref("y")))
    await until_a_load_waits(b)
    await until_it_hears_the_wait(a)
    await until_it_hears_the_wait(c)
    a.end_use("r0", "x")
    await waiting
    assert engine.loaded["r0"] == {"old", "y"} and engine.unloads == [("r0", "x")]
    assert c.views["r0"].in_flight == {"old": 1}


async def test_with_the_subscription_down_a_wait_falls_back_on_the_in_use_window(store: ResidencyStore) -> None:
    """B does not hear A's release: it is served once A's mark leaves the window (1 s here) if its wait lasts that
    long, and answered Retry-After at its timeout if not; nothing else fails."""
    engine, bus = FakeEngine(), Bus()
    short = ResidencyConfig(use_flush_interval_s=0.05, slot_wait_timeout_s=3.0)
    a, b = gateway(store, engine, bus, short), gateway(store, engine, bus, short)
    assert isinstance(b.signal, SlotSignal)
    b.signal.subscribed(False)
    assert b.metrics.registry.get_sample_value("tenantgate_adapter_slot_signal_up") == 0
    await a.ensure("r0", ref("x"))
    a.begin_use("r0", "x")
    waiting = asyncio.create_task(b.ensure("r0", ref("y")))
    await until_a_load_waits(b)
    await until_it_hears_the_wait(a)  # A hears B's announcement and says when it frees x: B does not hear it
    a.end_use("r0", "x")
    await waiting  # after the window, within the timeout
    assert engine.loaded["r0"] == {"y"} and releases(a, "published") == 1 and releases(b, "received") == 0

    c, d = gateway(store, engine, bus), gateway(store, engine, bus)  # the long window, the 3 s wait
    assert isinstance(d.signal, SlotSignal)
    d.signal.subscribed(False)
    await c.ensure("r1", ref("x"))
    c.begin_use("r1", "x")
    c.end_use("r1", "x")  # idle, but within the window
    with pytest.raises(AdapterCacheFull):
        await d.ensure("r1", ref("y"))
    assert engine.loaded["r1"] == {"x"} and d.slot_waiters["r1"] == 0


async def test_no_gateway_publishes_anything_while_none_waits() -> None:
    """Uses on a replica no gateway waits for publish nothing; a remote wait that is not renewed is forgotten."""
    bus, clock = Bus(), Clock(100.0)
    signal = bus.signal(clock)
    for _ in range(3):
        signal.changed("llama", "r0", freed=False)
        signal.changed("llama", "r0", freed=True)
    await asyncio.sleep(0)
    assert bus.published == []
    signal.heard(json.dumps({"t": "wait", "g": "other", "p": "llama", "r": "r0", "n": 1}))  # holds nothing: silent
    assert signal.remote_waiting("llama", "r0") and not signal.remote_waiting("llama", "r1")
    signal.changed("llama", "r0", freed=True)  # said
    clock.advance(REMOTE_TTL_S + 0.1)  # the other gateway stopped waiting and said nothing more
    signal.renew()
    signal.changed("llama", "r0", freed=True)  # not said
    await asyncio.sleep(0)
    assert [(m["t"], m["freed"]) for m in bus.published] == [("held", True)]


class Holding:
    """A pool's lifecycle holding ``held`` on every replica, as the signal sees it."""

    def __init__(self, held: frozenset[str] = frozenset()) -> None:
        self.held = held

    def held_here(self, replica_id: str) -> frozenset[str]:
        return self.held

    def remote_release(self, replica_id: str) -> None:
        pass

    def remote_set_changed(self, replica_id: str) -> None:
        pass

    def remote_unlocked(self, replica_id: str) -> None:
        pass

    def flying(self) -> Iterator[tuple[str, frozenset[str], int]]:
        return iter([("r0", self.held, len(self.held))] if self.held else [])

    def remote_used(self, replica_id: str, adapters: Collection[str]) -> None:
        pass


async def test_only_gateways_that_hold_something_answer_a_wait_and_once_more_after_they_let_go() -> None:
    """Silence is an empty held set: of 6 gateways hearing a wait, only the one holding an adapter there answers,
    so a renewal costs messages in proportion to the holders, not to every gateway. Once it holds nothing it answers
    one more renewal (empty: a release that went missing is made good), then is silent too."""
    bus = Bus()
    holder = Holding(frozenset({"x"}))
    gateways = [bus.signal() for _ in range(6)]
    gateways[0].attach("llama", holder)
    for signal in gateways[1:]:
        signal.attach("llama", Holding())

    async def renewal() -> list[list[str]]:
        bus.published.clear()
        for signal in gateways:
            signal.heard(json.dumps({"t": "wait", "g": "waiter", "p": "llama", "r": "r0", "n": 1}))
        await asyncio.sleep(0)
        return [m["a"] for m in bus.published if m["t"] == "held"]

    assert await renewal() == [["x"]]
    assert await renewal() == [["x"]]
    holder.held = frozenset()
    assert await renewal() == [[]]  # once more, empty
    assert await renewal() == []


async def test_held_sets_count_only_the_newest_message_of_each_gateway() -> None:
    """Publishes run concurrently and may reach Redis out of order: an older held set never replaces a newer one.
    Until the announcement has settled the waiter does not judge by held sets at all."""
    bus = Bus()
    signal = bus.signal()
    with signal.waiting("llama", "r0"):
        assert signal.remote_holds("llama", "r0") is None  # not settled: judge by the window
        for _ in range(1_000):  # a bounded poll: announced, then settled
            if signal.remote_holds("llama", "r0") is not None:
                break
            await asyncio.sleep(0.005)
        assert signal.remote_holds("llama", "r0") == frozenset()
        newer = {"t": "held", "g": "other", "p": "llama", "r": "r0", "a": ["x"], "freed": False, "n": 2}
        older = {**newer, "a": ["x", "z"], "n": 1}
        signal.heard(json.dumps(newer))
        signal.heard(json.dumps(older))
        signal.heard("not json")
        for sender in (["x"], {"x": 1}, None):  # another's or an attacker's message: dropped, never raised (the
            signal.heard(json.dumps({**newer, "g": sender, "n": 3}))  # subscription would be dropped and redone)
        assert signal.remote_holds("llama", "r0") == frozenset({"x"})
        signal.subscribed(False)
        assert signal.remote_holds("llama", "r0") is None


async def test_a_wait_left_and_taken_again_is_announced_again_once_its_announcement_is_old() -> None:
    """A load leaves its wait to look again under the lock and comes back: within RENEW_S that is the same wait
    (announced once); after, the others may have forgotten it, so it is announced again (found by the benchmark:
    short waits in a row, each between two renewals, were never renewed and the others stopped answering)."""
    bus, clock = Bus(), Clock(100.0)
    signal = bus.signal(clock)
    for _ in range(3):
        with signal.waiting("llama", "r0"):
            clock.advance(RENEW_S / 4)
    clock.advance(RENEW_S)
    with signal.waiting("llama", "r0"):
        pass
    await asyncio.sleep(0)
    assert [m["t"] for m in bus.published] == ["wait", "wait"]


async def test_a_lost_release_is_made_good_by_the_answer_to_the_next_renewal(store: ResidencyStore) -> None:
    """Pub/sub delivers at most once: A's release never reaches B. At B's next renewal A answers with what it holds
    now (nothing), and B, whose copy of A's held set loses x, looks again and loads."""
    engine, bus = FakeEngine(), Bus()
    a, b = gateway(store, engine, bus), gateway(store, engine, bus)
    await a.ensure("r0", ref("x"))
    a.begin_use("r0", "x")
    waiting = asyncio.create_task(b.ensure("r0", ref("y")))
    await until_a_load_waits(b)
    await until_it_hears_the_wait(a)
    await until_held(bus, ["x"])
    for _ in range(5_000):  # a bounded poll: B's wait settled, looked again (A holds x) and waits on
        if waited(b) >= 2:
            break
        await asyncio.sleep(0.001)
    else:
        raise AssertionError("B's wait did not settle")
    bus.lose = lambda message: bool(message.get("freed"))
    a.end_use("r0", "x")
    for _ in range(5_000):  # a bounded poll: said (from a task of its own), and lost
        if any(m.get("freed") for m in bus.published):
            break
        await asyncio.sleep(0.001)
    else:
        raise AssertionError("A did not say it freed x")
    bus.lose = lambda message: False
    assert isinstance(b.signal, SlotSignal)
    b.signal.renew()  # the transport does this every RENEW_S
    await waiting  # AdapterCacheFull at 3 s if B believed A's held set until it expired
    assert engine.loaded["r0"] == {"y"} and releases(b, "received") == 0


class Woken(Holding):
    """A pool's lifecycle as the signal sees it: holds nothing, notes each wake."""

    def __init__(self) -> None:
        super().__init__()
        self.woken: list[str] = []

    def remote_release(self, replica_id: str) -> None:
        self.woken.append(replica_id)


async def test_the_held_set_of_a_gateway_that_stopped_answering_is_dropped_and_the_wait_looks_again() -> None:
    bus, clock, lifecycle_ = Bus(), Clock(100.0), Woken()
    signal = bus.signal(clock)
    signal.attach("llama", lifecycle_)
    with signal.waiting("llama", "r0"):
        for _ in range(5_000):  # a bounded poll: announced, and woken once settled (SETTLE_S on the loop's clock)
            if lifecycle_.woken:
                break
            await asyncio.sleep(0.001)
        clock.advance(SETTLE_S)
        signal.heard(json.dumps({"t": "held", "g": "other", "p": "llama", "r": "r0", "a": ["x"], "n": 1}))
        assert signal.remote_holds("llama", "r0") == frozenset({"x"}) and lifecycle_.woken == ["r0"]
        clock.advance(REMOTE_TTL_S)  # "other" answered none of the renewals since
        signal.renew()
        assert signal.remote_holds("llama", "r0") == frozenset() and lifecycle_.woken == ["r0", "r0"]


class LooksLate(MemoryStore):
    """A shared store where, once armed, the next look under a replica's lock runs ``during_look`` after the
    record is read, and giving the lock back takes a moment, as a Redis round trip does."""

    def __init__(self) -> None:
        super().__init__()
        self.during_look: Callable[[], None] | None = None
        self._slow_release = False

    async def record(self, pool: str, replica: str) -> ReplicaRecord:
        record = await super().record(pool, replica)
        if self.during_look is not None:
            self.during_look()
            self.during_look, self._slow_release = None, True
        return record

    async def release(self, pool: str, replica: str, holder: str) -> None:
        await super().release(pool, replica, holder)
        if self._slow_release:
            self._slow_release = False
            await asyncio.sleep(0.05)


async def test_a_release_heard_while_the_waiter_looks_under_the_lock_is_not_missed() -> None:
    """B's wait settles and B looks again (A holds x); A's request ends while B looks, and the release reaches B
    after B judged but before it waits again (found by the benchmark: such a wait ran to the in-use window)."""
    engine, bus, store = FakeEngine(), Bus(), LooksLate()
    a, b = gateway(store, engine, bus), gateway(store, engine, bus)
    await a.ensure("r0", ref("x"))
    a.begin_use("r0", "x")
    waiting = asyncio.create_task(b.ensure("r0", ref("y")))
    await until_a_load_waits(b)
    await until_it_hears_the_wait(a)
    store.during_look = lambda: a.end_use("r0", "x")  # B's next look: when its wait settles
    await waiting  # AdapterCacheFull at 3 s when the release was missed
    assert engine.loaded["r0"] == {"y"} and releases(b, "received") == 1


async def until_resident(life: PoolResidency, replica: str, adapters: set[str]) -> None:
    await until(
        lambda: set(life.views[replica].resident) == adapters,
        lambda: f"{replica}'s view is {sorted(life.views[replica].resident)}, not {sorted(adapters)}",
    )


async def test_another_gateways_load_and_unload_reach_this_gateways_view_without_a_sync(
    store: ResidencyStore,
) -> None:
    """A loads x on r0, then unloads it: B's view (the one its routing reads) follows each change at once, where
    without the news it would wait for its next residency sync (2 s by default; never, in this test)."""
    engine, bus = FakeEngine(), Bus()
    a, b = gateway(store, engine, bus, max_adapters=2), gateway(store, engine, bus, max_adapters=2)
    await a.ensure("r0", ref("x"))
    await until_resident(b, "r0", {"x"})
    assert b.resident_on("x") == frozenset({"r0"})  # routing's memo is refreshed too
    # The load's news, then (the load's lock let go) its release: another gateway's load waiting there tries now.
    assert [m["t"] for m in bus.published] == ["set", "unlocked"]
    await a.unload_everywhere("x")
    await until_resident(b, "r0", set())
    assert b.resident_on("x") == frozenset()
    assert engine.loaded["r0"] == set()


async def test_a_gateway_reads_a_replica_once_for_news_that_arrive_together(store: ResidencyStore) -> None:
    engine, bus = FakeEngine(), Bus()
    reads: list[str] = []
    b = gateway(store, engine, bus)
    real_record = b.store.record

    async def counted(pool: str, replica: str) -> ReplicaRecord:
        reads.append(replica)
        return await real_record(pool, replica)

    b.store.record = counted  # type: ignore[method-assign]
    for _ in range(5):
        b.remote_set_changed("r0")
    b.remote_set_changed("nowhere")  # a replica this gateway does not have: ignored
    pending = list(b._rereads.values())
    assert len(pending) == 1
    await pending[0]
    assert reads == ["r0"]


# --- in-flight adapters shared between gateways (``share``, ``flying_elsewhere``) ------------------------------------


def flying(bus: Bus) -> list[dict[str, dict[str, list[str]]]]:
    return [m["h"] for m in bus.published if m["t"] == "flying"]


async def test_an_adapter_in_flight_on_one_gateway_is_in_flight_there_for_the_others() -> None:
    """A request one gateway placed (its adapter's load may be under way) is seen by another gateway's
    ``likely_on_gpu`` once shared, and no longer once it ended and that was shared."""
    bus, store, engine = Bus(), MemoryStore(), FakeEngine()
    a, b = gateway(store, engine, bus), gateway(store, engine, bus)
    a.begin_use("r1", "x")
    assert not b.likely_on_gpu("r1", "x", 1)
    assert isinstance(a.signal, SlotSignal)
    a.signal.share()
    await until(lambda: b.likely_on_gpu("r1", "x", 1), lambda: f"B never heard: {bus.published}")
    assert not b.likely_on_gpu("r0", "x", 1) and not b.likely_on_gpu("r1", "y", 1)
    a.end_use("r1", "x")
    a.signal.share()
    await until(lambda: not b.likely_on_gpu("r1", "x", 1), lambda: f"B still counts x: {bus.published}")


async def test_in_flight_adapters_are_shared_in_batches_never_per_request() -> None:
    """Requests publish nothing while no gateway waits; ``share`` (every SHARE_S) publishes all of a gateway's
    in-flight adapters in one message if they changed, again every RENEW_S while it holds any, once empty after it
    let go, then nothing."""
    bus, clock = Bus(), Clock(100.0)
    signal, holder = bus.signal(clock), Holding()
    signal.attach("llama", holder)
    holder.held = frozenset({"x", "y"})
    for _ in range(50):  # requests beginning and ending: no message
        signal.changed("llama", "r0", freed=False)
        signal.changed("llama", "r0", freed=True)
    await asyncio.sleep(0)
    assert flying(bus) == []
    signal.share()
    signal.share()  # nothing changed since
    clock.advance(RENEW_S / 2)
    signal.share()
    await asyncio.sleep(0)
    assert flying(bus) == [{"llama": {"r0": ["x", "y"]}}]
    clock.advance(RENEW_S / 2)
    signal.share()  # repeated while it holds something: a gateway that hears it late, or lost it, learns it
    holder.held = frozenset()
    signal.changed("llama", "r0", freed=True)
    signal.share()  # said once, empty
    clock.advance(10 * RENEW_S)
    signal.share()
    signal.changed("llama", "r0", freed=True)
    signal.share()  # nothing held, and said so already
    await asyncio.sleep(0)
    assert flying(bus) == [{"llama": {"r0": ["x", "y"]}}, {"llama": {"r0": ["x", "y"]}}, {}]


async def test_the_share_timer_sleeps_while_nothing_is_in_flight_and_wakes_when_a_request_or_a_load_starts() -> None:
    """``share`` says whether it may have something to say at its next call: an idle gateway's transport then waits
    in ``until_flying`` rather than calling it every SHARE_S, until an adapter's first request begins on a replica
    (``changed``) or a load starts (``loading``)."""
    bus, clock = Bus(), Clock(100.0)
    signal, holder = bus.signal(clock), Holding()
    signal.attach("llama", holder)
    assert not signal.share()  # idle from the start: nothing to say
    quiet = asyncio.ensure_future(signal.until_flying())
    await asyncio.sleep(0)
    assert not quiet.done()
    holder.held = frozenset({"x"})
    signal.changed("llama", "r0", freed=False)  # a request began
    await asyncio.sleep(0)
    assert quiet.done()
    assert signal.share() and signal.share()  # said, then renewals are due while it holds it
    holder.held = frozenset()
    signal.changed("llama", "r0", freed=True)
    assert signal.share()  # said once, empty
    assert not signal.share()
    quiet = asyncio.ensure_future(signal.until_flying())
    await asyncio.sleep(0)
    signal.loading("llama", "r0", (1, None))  # a load queued: shared with the in-flight adapters
    await asyncio.sleep(0)
    assert quiet.done() and signal.share()
    await asyncio.sleep(0)
    assert flying(bus) == [{"llama": {"r0": ["x"]}}, {}, {}]


async def test_a_gateway_that_stops_sharing_is_forgotten_and_an_older_message_never_replaces_a_newer_one() -> None:
    clock = Clock(100.0)
    signal = Bus().signal(clock)

    def heard(number: int, adapters: list[str]) -> None:
        held = {"llama": {"r0": adapters}}
        signal.heard(json.dumps({"t": "flying", "g": "other", "n": number, "h": held}))

    heard(2, ["x"])
    heard(1, ["y"])  # published before the other, arrived after it
    assert signal.flying_elsewhere("llama", "r0", "x") and not signal.flying_elsewhere("llama", "r0", "y")
    clock.advance(REMOTE_TTL_S / 2)
    signal.renew()
    assert signal.flying_elsewhere("llama", "r0", "x")
    clock.advance(REMOTE_TTL_S / 2)  # not heard again within REMOTE_TTL_S: gone
    signal.renew()
    assert not signal.flying_elsewhere("llama", "r0", "x")


async def test_with_the_subscription_down_other_gateways_in_flight_adapters_are_forgotten() -> None:
    """docs/operations.md (tenantgate_adapter_slot_signal_up 0): what was said before the subscription dropped may
    be stale by the time it is back, so routing stops counting the others' in-flight adapters and requests."""
    signal = Bus().signal()
    held, counts = {"llama": {"r0": ["x"]}}, {"llama": {"r0": 2}}
    signal.heard(json.dumps({"t": "flying", "g": "other", "n": 1, "h": held, "c": counts}))
    assert signal.flying_elsewhere("llama", "r0", "x") and signal.load_elsewhere("llama") == {"r0": 2}
    signal.subscribed(False)
    assert not signal.flying_elsewhere("llama", "r0", "x") and not signal.load_elsewhere("llama")


async def test_unreadable_in_flight_messages_are_left_out_and_never_break_the_subscriber() -> None:
    signal = Bus().signal()
    junk: list[object] = [
        [1, 2],
        {"llama": ["x"]},
        {"llama": {"r0": "x"}},
        {"llama": {"r0": [1, {"a": 1}, None]}},
        {"llama": {"r0": ["x", 3], "r1": None}, "other": 7},
    ]
    for number, held in enumerate(junk, 1):
        signal.heard(json.dumps({"t": "flying", "g": "other", "n": number, "h": held}))
    signal.heard(json.dumps({"t": "flying", "g": "other", "n": "9", "h": {"llama": {"r2": ["z"]}}}))
    counts = {"llama": {"r0": -1, "r1": "3", "r2": 2**40, "r3": 2, "r4": None}, "other": []}
    signal.heard(json.dumps({"t": "flying", "g": "counter", "n": 1, "h": {}, "c": counts}))
    signal.heard(json.dumps({"t": "flying", "g": "junk", "n": 1, "h": {}, "c": [1]}))
    assert signal.load_elsewhere("llama") == {"r3": 2} and signal.load_elsewhere("other") == {}
    signal.heard(json.dumps({"t": "flying", "g": ["not", "a", "string"], "n": 10, "h": {}}))
    assert signal.flying_elsewhere("llama", "r0", "x")  # the one readable entry of the last readable message
    assert not signal.flying_elsewhere("llama", "r1", "x") and not signal.flying_elsewhere("llama", "r2", "z")


async def test_a_message_nested_past_the_parsers_depth_is_unreadable_not_the_end_of_the_subscription() -> None:
    """A message nested deeper than the JSON parser recurses (another gateway's bug, or anyone with Redis access):
    heard() raised RecursionError, which the channel reads as a lost subscription (gateway/residency/signal_redis.py:
    subscribe again, the waits fall back on the in-use window and every other gateway's in-flight sets forgotten),
    once per such message. It is an unreadable message like any other."""
    signal = Bus().signal()
    signal.heard(json.dumps({"t": "flying", "g": "other", "n": 1, "h": {"llama": {"r0": ["x"]}}}))
    signal.heard('{"t": "flying", "g": "other", "n": 2, "h": ' + "[" * 100_000)
    assert signal.listening and signal.flying_elsewhere("llama", "r0", "x")


async def test_a_message_names_at_most_max_shared_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    """However much a gateway has in flight, its message is bounded (and so is what a receiver takes from one)."""
    monkeypatch.setattr(signal_module, "MAX_SHARED_PAIRS", 3)  # r0's two adapters and its count fit, no more
    bus = Bus()
    sender, receiver = bus.signal(), bus.signal()

    class Busy(Holding):
        def flying(self) -> Iterator[tuple[str, frozenset[str], int]]:
            return iter([("r0", frozenset({"a", "b"}), 2), ("r1", frozenset({"c", "d"}), 2), ("r2", frozenset("e"), 1)])

    sender.attach("llama", Busy())
    sender.changed("llama", "r0", freed=False)
    sender.share()
    await until(lambda: receiver.flying_elsewhere("llama", "r0", "a"), lambda: "never heard")
    assert flying(bus) == [{"llama": {"r0": ["a", "b"]}}]  # a replica counts its adapters and its request count
    big = {"llama": {f"r{i}": ["a", "b"] for i in range(3)}}
    receiver.heard(json.dumps({"t": "flying", "g": "other", "n": 1, "h": big}))
    assert [receiver.flying_elsewhere("llama", f"r{i}", "a") for i in range(3)] == [True, False, False]  # 2 fit


async def test_requests_in_flight_per_replica_are_shared_with_the_adapters_and_add_up_over_gateways() -> None:
    """What ``routing.load_view: shared`` counts: every other gateway's requests in flight per replica, as each
    last shared them (batched like the adapters), forgotten with the gateway."""
    bus, store, engine, clock = Bus(), MemoryStore(), FakeEngine(), Clock(100.0)
    a, c = gateway(store, engine, bus), gateway(store, engine, bus)
    b_signal = bus.signal(clock)
    for replica, adapter in (("r1", "x"), ("r1", "x"), ("r1", "y"), ("r0", "y")):
        a.begin_use(replica, adapter)
    c.begin_use("r1", "z")
    for life in (a, c):
        assert isinstance(life.signal, SlotSignal)
        life.signal.share()
    await until(lambda: b_signal.load_elsewhere("llama") == {"r0": 1, "r1": 4}, lambda: str(bus.published))
    a.end_use("r1", "x")
    assert isinstance(a.signal, SlotSignal)
    a.signal.share()  # one request fewer: the set is the same, the count is not
    await until(lambda: b_signal.load_elsewhere("llama") == {"r0": 1, "r1": 3}, lambda: str(bus.published))
    clock.advance(REMOTE_TTL_S)  # neither renewed (this test's clock is B's alone): both forgotten
    b_signal.renew()
    assert b_signal.load_elsewhere("llama") == {}


def over(life: PoolResidency) -> float:
    """How many loads of the gateway's went over max_adapters on r0 (every slot in use)."""
    labels = {"pool": "llama", "replica": "r0", "outcome": "over"}
    return life.metrics.registry.get_sample_value("tenantgate_adapter_slot_waits_total", labels) or 0.0


def vllm_gateway(store: ResidencyStore, engine: FakeEngine, bus: Bus, clock: Clock) -> PoolResidency:
    """A gateway's lifecycle on an engine that queues for slots (vLLM): the default in-use window (1 s), two slots."""
    metrics = GatewayMetrics()
    return lifecycle(store, engine, clock, shared=True, overcommit=True, signal=bus.signal(metrics=metrics),
                     metrics=metrics)  # fmt: skip


async def shared(life: PoolResidency, heard: Callable[[], bool]) -> None:
    """``life`` shares its in-flight adapters (as every SHARE_S), until ``heard`` says the others have it."""
    assert isinstance(life.signal, SlotSignal)
    life.signal.share()
    await until(heard, lambda: "the flying message was not heard")


async def test_on_vllm_a_load_evicts_what_no_gateway_has_in_flight_though_every_adapter_was_used_within_the_window(
    store: ResidencyStore,
) -> None:
    """docs/benchmarks.md, "Three gateways": with every adapter of a busy replica used within the in-use window (a
    second) by some gateway, loads ran the set over max_adapters, and the engine's own host cache then dropped an
    adapter the record still held (its next request paid a cold load routing had not priced). Listening to the other
    gateways' in-flight adapters, a load evicts the least recently used one no gateway has in flight; not listening,
    it falls back on the window."""
    engine, bus, clock = FakeEngine(), Bus(), Clock(START)
    a, b = vllm_gateway(store, engine, bus, clock), vllm_gateway(store, engine, bus, clock)
    await a.ensure("r0", ref("x"))
    await a.ensure("r0", ref("y"))
    for name in ("x", "y"):
        a.begin_use("r0", name)
        a.end_use("r0", name)
    b.begin_use("r0", "x")  # B's request for x, in flight
    assert isinstance(a.signal, SlotSignal)
    await shared(b, lambda: a.signal.flying_at("llama", "r0") == frozenset({"x"}))
    clock.advance(5 * FLYING_GRACE_S)  # within the window (1 s), past the grace
    await a.ensure("r0", ref("z"))
    assert engine.loaded["r0"] == {"x", "z"} and engine.unloads == [("r0", "y")] and engine.peak["r0"] == 2
    assert set((await store.record("llama", "r0")).resident) == {"x", "z"}

    a.begin_use("r0", "z")
    a.end_use("r0", "z")
    a.signal.subscribed(False)  # it may miss what the others hold: every adapter used within the window is in use
    assert a.signal.flying_at("llama", "r0") is None
    assert over(a) == 0
    await a.ensure("r0", ref("w"))
    assert engine.loaded["r0"] == {"x", "z", "w"}  # over the bound, as before: vLLM queues for the slot
    assert over(a) == 1  # docs/operations.md: what a gateway not listening does more often


async def test_an_adapter_used_within_the_grace_is_in_use_on_vllm(store: ResidencyStore) -> None:
    """A request another gateway began since its last message is not in it yet: an adapter used within
    FLYING_GRACE_S is kept, here by loading over the bound."""
    engine, bus, clock = FakeEngine(), Bus(), Clock(START)
    a = vllm_gateway(store, engine, bus, clock)  # listening: no other gateway holds anything
    await a.ensure("r0", ref("x"))
    await a.ensure("r0", ref("y"))
    clock.advance(FLYING_GRACE_S / 2)
    await a.ensure("r0", ref("z"))
    assert engine.loaded["r0"] == {"x", "y", "z"} and engine.unloads == []


async def test_another_gateways_uses_order_this_gateways_evictions_as_soon_as_it_shares_them(
    store: ResidencyStore,
) -> None:
    """B's use of x reaches the store only at its next flush (0.25 s), but A hears it within SHARE_S: in flight,
    then let go. A's next load then evicts y, used longer ago, as the engine's own least-recently-used cache would,
    not x (the oldest by the store's marks)."""
    engine, bus, clock = FakeEngine(), Bus(), Clock(START)
    a, b = vllm_gateway(store, engine, bus, clock), vllm_gateway(store, engine, bus, clock)
    await a.ensure("r0", ref("x"))
    clock.advance(1)
    await a.ensure("r0", ref("y"))
    clock.advance(5)
    b.begin_use("r0", "x")
    assert isinstance(a.signal, SlotSignal)
    await shared(b, lambda: a.signal.flying_at("llama", "r0") == frozenset({"x"}))
    b.end_use("r0", "x")
    await shared(b, lambda: a.signal.flying_at("llama", "r0") == frozenset())
    assert (await store.record("llama", "r0")).resident["x"] == START  # B has not flushed its use
    clock.advance(2)  # past the window: only the order decides
    await a.ensure("r0", ref("z"))
    assert engine.unloads == [("r0", "y")] and engine.loaded["r0"] == {"x", "z"}


async def test_flying_at_is_what_the_other_gateways_hold_on_the_replica_and_their_uses_reach_the_lifecycle() -> None:
    """Every adapter a flying message names, or that its sender's previous message named (let go since), is used
    now for the receiving lifecycles (``remote_used``)."""
    signal = Bus().signal()

    class Recorder(Holding):
        def __init__(self) -> None:
            super().__init__()
            self.used: list[tuple[str, set[str]]] = []

        def remote_used(self, replica_id: str, adapters: Collection[str]) -> None:
            self.used.append((replica_id, set(adapters)))

    recorder = Recorder()
    signal.attach("llama", recorder)

    def heard(sender: str, number: int, held: dict[str, list[str]]) -> None:
        signal.heard(json.dumps({"t": "flying", "g": sender, "n": number, "h": {"llama": held}}))

    heard("one", 1, {"r0": ["x"], "r1": ["y"]})
    heard("two", 1, {"r0": ["y"]})
    assert signal.flying_at("llama", "r0") == frozenset({"x", "y"}) and signal.flying_at("llama", "r2") == frozenset()
    assert recorder.used == [("r0", {"x"}), ("r1", {"y"}), ("r0", {"y"})]
    recorder.used.clear()
    heard("one", 2, {"r0": ["z"]})  # let go of x on r0 and y on r1
    assert signal.flying_at("llama", "r0") == frozenset({"y", "z"}) and signal.flying_at("llama", "r1") == frozenset()
    assert sorted(recorder.used) == [("r0", {"x", "z"}), ("r1", {"y"})]
    signal.subscribed(False)
    assert signal.flying_at("llama", "r0") is None


async def test_a_set_run_over_its_bound_drops_what_no_gateway_has_in_flight_though_it_was_used_within_the_grace(
    store: ResidencyStore,
) -> None:
    """The engine dropped its least recently used idle adapter when the load went over: the trim forgets the least
    recently used adapter that no gateway has in flight (another gateway's, as it last said), the grace aside."""
    engine, bus, clock = FakeEngine(), Bus(), Clock(START)
    a, b = vllm_gateway(store, engine, bus, clock), vllm_gateway(store, engine, bus, clock)
    for name in ("x", "y", "z"):
        a.begin_use("r0", name)
        await a.ensure("r0", ref(name))  # z over the bound: x and y in flight here
    b.begin_use("r0", "x")
    assert isinstance(a.signal, SlotSignal)
    await shared(b, lambda: a.signal.flying_at("llama", "r0") == frozenset({"x"}))
    for name in ("x", "y", "z"):
        a.end_use("r0", name)
        clock.advance(FLYING_GRACE_S / 10)
    await a.trim_over_bound(lambda replica: True)
    assert engine.unloads == [("r0", "y")] and engine.loaded["r0"] == {"x", "z"}


async def test_after_its_subscription_comes_back_a_gateway_evicts_nothing_another_has_in_flight_unheard(
    store: ResidencyStore,
) -> None:
    """What the others hold was forgotten while the subscription was down, and each says it again only within
    RENEW_S (while it holds something): for REMOTE_TTL_S after the subscription came back, an empty picture is no
    proof that no gateway has an adapter in flight, so evictions judge by the in-use window. Trusted at once, A
    evicted x, which B still had a request in flight for (its next request then paid a cold load)."""
    engine, bus, clock = FakeEngine(), Bus(), Clock(START)
    a, b = vllm_gateway(store, engine, bus, clock), vllm_gateway(store, engine, bus, clock)
    await a.ensure("r0", ref("x"))
    await a.ensure("r0", ref("y"))
    b.begin_use("r0", "x")  # B's request for x, in flight throughout
    assert isinstance(a.signal, SlotSignal)
    a.signal.subscribed(False)
    a.signal.subscribed(True)  # B's next renewal has not come yet
    assert a.signal.flying_at("llama", "r0") is None
    clock.advance(5 * FLYING_GRACE_S)  # within the window (1 s), past the grace
    await a.ensure("r0", ref("z"))
    assert "x" in engine.loaded["r0"] and ("r0", "x") not in engine.unloads


# --- a replica's lock and loads across gateways (the churn trace's three-gateway tail) -------------------------------


class Gate:
    """Holds a gateway's loads of some adapters in its engine (under the replica's lock) until the test opens
    them; ``entered``: the loads that reached the engine. ``refuse``: the engine refuses them once opened."""

    def __init__(self, life: PoolResidency, *names: str, refuse: bool = False) -> None:
        self.opened = {name: asyncio.Event() for name in names}
        self.entered: set[str] = set()
        self.refuse = refuse
        driver = life.driver
        assert isinstance(driver, FakeDriver)
        driver.before_load = self._before_load

    async def _before_load(self, replica: Endpoint, adapter: AdapterRef) -> None:
        name = adapter.engine_name
        if name in self.opened:
            self.entered.add(name)
            await self.opened[name].wait()
            if self.refuse:
                raise AdapterLoadFailed(name, 400, "the engine refused the adapter")

    async def until_entered(self, name: str) -> None:
        await until(lambda: name in self.entered, lambda: f"no load of {name} reached the engine")


async def until_loading(life: PoolResidency, name: str) -> None:
    await until(lambda: ("r0", name) in life.loading, lambda: f"no load of {name} on r0 began: {life.loading}")


async def test_a_load_of_an_adapter_another_gateway_is_loading_there_waits_for_that_load_not_for_the_lock(
    store: ResidencyStore,
) -> None:
    """docs/benchmarks.md, "Three gateways: the churn tail": A loads x on r0 (it holds r0's lock for x) and has
    another load, of z, queued behind it there. B's load of x, waiting for the lock, ends once A's load of x brought
    it (A's news), as a second request of one gateway joins its first's load, though r0's lock stays taken by the
    load of z. Before, it waited for the lock behind every load there and found x loaded once it got in (churn trace,
    3 gateways: 12-17 requests a run, up to 1.25 s each). No second load of x."""
    engine, bus = FakeEngine(), Bus()
    a, b = gateway(store, engine, bus, max_adapters=4), gateway(store, engine, bus, max_adapters=4)
    held = Gate(a, "x", "z")
    first = asyncio.create_task(a.ensure("r0", ref("x")))
    await held.until_entered("x")
    second = asyncio.create_task(a.ensure("r0", ref("z")))
    joined = asyncio.create_task(b.ensure("r0", ref("x")))
    await until_loading(b, "x")
    await asyncio.sleep(0.05)  # B's load waits meanwhile (for the lock, without the join)
    held.opened["x"].set()
    await first
    await asyncio.wait_for(joined, 5)  # until z's load ends without the join: never, here
    assert not second.done() and b.is_resident("r0", "x")
    assert engine.loads[("r0", "x")] == 1 and engine.duplicate_loads == 0
    held.opened["z"].set()
    await second


async def test_a_load_another_gateway_failed_is_made_by_this_gateway(store: ResidencyStore) -> None:
    """A's load of x on r0 fails (the engine refused it): B's request, waiting for that load, loads x itself."""
    engine, bus = FakeEngine(), Bus()
    a, b = gateway(store, engine, bus, max_adapters=4), gateway(store, engine, bus, max_adapters=4)
    refused = Gate(a, "x", refuse=True)
    failing = asyncio.create_task(a.ensure("r0", ref("x")))
    await refused.until_entered("x")
    joined = asyncio.create_task(b.ensure("r0", ref("x")))
    await until_loading(b, "x")
    refused.opened["x"].set()
    with pytest.raises(AdapterLoadFailed):
        await failing
    await asyncio.wait_for(joined, 5)
    assert engine.loads[("r0", "x")] == 1 and b.is_resident("r0", "x")


async def test_gateways_whose_requests_for_an_adapter_arrive_together_do_not_wait_for_each_other(
    store: ResidencyStore,
) -> None:
    """A and B each have a request for x in flight on r0 and each heard the other's: neither waits for a load the
    other has not begun. One loads x under the replica's lock, the other finds it loaded."""
    engine, bus = FakeEngine(), Bus()
    a, b = gateway(store, engine, bus, max_adapters=4), gateway(store, engine, bus, max_adapters=4)
    a.begin_use("r0", "x")
    b.begin_use("r0", "x")
    await shared(a, lambda: b.signal.flying_elsewhere("llama", "r0", "x"))
    await shared(b, lambda: a.signal.flying_elsewhere("llama", "r0", "x"))
    await asyncio.wait_for(asyncio.gather(a.ensure("r0", ref("x")), b.ensure("r0", ref("x"))), 5)
    assert engine.loads[("r0", "x")] == 1 and engine.duplicate_loads == 0


# --- adapter loads under way, shared for routing's load_ahead term (``loading``, ``loading_elsewhere``) -------------


async def test_a_gateways_loads_under_way_reach_the_others_in_its_in_flight_message(store: ResidencyStore) -> None:
    """A cold load queues behind every load under way on its replica, this gateway's or another's (the replica's
    lock). A says which of its loads run and which are queued, per replica, in its batched ``flying`` message (no
    message of its own), and B's routing reads them (``loading_elsewhere``) until A says they ended. A's measured
    load time teaches its expected one (``load_ms``)."""
    engine, bus = FakeEngine(), Bus()
    a, b = gateway(store, engine, bus, max_adapters=4), gateway(store, engine, bus, max_adapters=4)
    assert isinstance(a.signal, SlotSignal) and isinstance(b.signal, SlotSignal)
    held = Gate(a, "x", "z")
    running = asyncio.create_task(a.ensure("r0", ref("x")))
    await held.until_entered("x")
    queued = asyncio.create_task(a.ensure("r0", ref("z")))
    await until_loading(a, "z")
    assert a.loading_here["r0"][0] == 1 and a.loading_here["r0"][1] is not None
    before = a.load_ms
    a.signal.share()
    await until(lambda: "r0" in b.signal.loading_elsewhere("llama"), lambda: f"B never heard: {bus.published}")
    queued_there, running_since = b.signal.loading_elsewhere("llama")["r0"]
    assert queued_there == 1 and running_since is not None and running_since <= time.monotonic()
    assert [m for m in bus.published if m["t"] == "flying"][-1]["l"]["llama"]["r0"][0] == 1
    held.opened["x"].set()
    held.opened["z"].set()
    await asyncio.gather(running, queued)
    assert a.loading_here == {} and a.load_ms < before  # the fake engine loads at once: well under the prior
    a.signal.share()
    await until(lambda: not b.signal.loading_elsewhere("llama"), lambda: f"B still counts them: {bus.published}")


async def test_unreadable_loads_under_way_are_left_out() -> None:
    signal = Bus().signal()
    loads = {"llama": {"r0": [1, None], "r1": [0, 120.5], "r2": ["1", None], "r3": [1], "r4": [-1, 5], "r5": [0, -3],
                       "r6": None}, "other": 7}  # fmt: skip
    signal.heard(json.dumps({"t": "flying", "g": "other", "n": 1, "h": {}, "l": loads}))
    seen = signal.loading_elsewhere("llama")
    assert set(seen) == {"r0", "r1"} and seen["r0"] == (1, None) and seen["r1"][0] == 0
    signal.subscribed(False)  # what was said before the subscription dropped is forgotten
    assert not signal.loading_elsewhere("llama")


async def test_the_redis_transports_share_timer_sleeps_while_idle(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/benchmarks.md (the slot signal's timer asleep while idle): the transport itself, not only ``share``'s
    answer. RedisSlotChannel._share with nothing in flight calls ``share`` once and then sleeps (at a 1 ms SHARE_S,
    50 ms idle would be ~50 calls if it polled); a request that begins wakes it, and it shares again."""
    monkeypatch.setattr(signal_redis, "SHARE_S", 0.001)
    channel = RedisSlotChannel(redis_server.url, GatewayMetrics(), operation_timeout_s=2.0, prefix="test-share")
    holder = Holding()
    channel.signal.attach("llama", holder)
    calls: list[bool] = []
    share = channel.signal.share

    def counted() -> bool:
        calls.append(said := share())
        return said

    monkeypatch.setattr(channel.signal, "share", counted)
    timer = asyncio.create_task(channel._share())
    try:
        await asyncio.sleep(0.05)
        assert calls == [False]  # said nothing, then asleep
        holder.held = frozenset({"x"})
        channel.signal.changed("llama", "r0", freed=False)  # a request began
        for _ in range(500):  # bounded poll: the timer wakes and shares again
            if len(calls) > 1:
                break
            await asyncio.sleep(0.01)
        assert calls[1] is True
    finally:
        await cancel_and_wait([timer])
        await channel.close()
