"""Two gateways' traffic merged through a real redis-server: two in-process FleetTraffic instances (the merging
component each gateway runs), each with its own meter and id. One Redis call per gateway per interval, none per
request; both read the same fleet-wide figure; a gateway that stops writing leaves it; without Redis each places by
its own figures."""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import redis.asyncio

from gateway.observe.traffic import TrafficMeter, merge
from gateway.placement.exchange import MAX_RATE, FleetTraffic, TrafficExchange, decode
from gateway.placement.plan import PlanInput, PlanSettings, plan
from tests.clock import Clock
from tests.redis_server import RedisServer

pytestmark = pytest.mark.timeout(60)


def gateway(url: str, prefix: str, name: str, clock: Clock, stale_after_s: float = 60.0) -> FleetTraffic:
    exchange = TrafficExchange(url, operation_timeout_s=2.0, stale_after_s=stale_after_s, prefix=prefix)
    return FleetTraffic(TrafficMeter(10.0, 100, 1000, clock=clock), name, 100, exchange)


@pytest.fixture
async def probe(redis_server: RedisServer) -> AsyncIterator[redis.asyncio.Redis]:
    client = redis.asyncio.Redis.from_url(redis_server.url, decode_responses=True)
    yield client
    await client.aclose()


@dataclass
class Measured:
    """Two gateways sharing a prefix, each having measured one tenant for a window: acme through a, globex through
    b (the merged figure holds both, once each has ticked)."""

    prefix: str
    a: FleetTraffic
    b: FleetTraffic

    @property
    def figures_key(self) -> str:
        return f"{self.prefix}:{{traffic}}:by_gateway"

    def a_merged_both(self) -> bool:
        return self.a.gateways == 2 and set(self.a.fleet["llama"].keys) == {"acme", "globex"}


@pytest.fixture
async def measured(redis_server: RedisServer) -> AsyncIterator[Measured]:
    prefix, clock = f"test-{uuid.uuid4().hex}", Clock(0.0)
    a, b = gateway(redis_server.url, prefix, "gw-a", clock), gateway(redis_server.url, prefix, "gw-b", clock)
    a.meter.record("llama", "acme", 10)
    b.meter.record("llama", "globex", 10)
    clock.advance(10)
    yield Measured(prefix, a, b)
    await a.close()
    await b.close()


async def script_calls(client: redis.asyncio.Redis) -> int:
    """Scripts run by the server so far (EVAL and EVALSHA): what the exchange sends."""
    stats = await client.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("eval", "evalsha"))


async def test_two_gateways_read_the_same_fleet_figure_with_one_call_per_interval_each(
    redis_server: RedisServer, probe: redis.asyncio.Redis
) -> None:
    clock, prefix = Clock(0.0), f"test-{uuid.uuid4().hex}"
    a, b = gateway(redis_server.url, prefix, "gw-a", clock), gateway(redis_server.url, prefix, "gw-b", clock)
    try:
        await a.tick()  # both join (with nothing measured yet); the script is loaded into Redis' cache once
        await b.tick()
        before = await script_calls(probe)
        for _ in range(100):  # 10 s at 10/s for acme through a, 3/s through b; globex only through b
            a.meter.record("llama", "acme", 20)
        for _ in range(30):
            b.meter.record("llama", "acme", 20)
        for _ in range(50):
            b.meter.record("llama", "globex", 100)
        assert await script_calls(probe) == before  # counting is local: nothing reached Redis
        clock.advance(10)
        await a.tick()  # b has not written what it counted yet
        assert a.gateways == 2 and a.fleet["llama"].keys.keys() == {"acme"}
        await b.tick()
        await a.tick()  # now a reads b's figures too (its own fold, at no new time, changes nothing)
        assert await script_calls(probe) == before + 3  # one call per tick
        assert a.gateways == b.gateways == 2
        weight = 1 - math.exp(-1)  # one window of 10 s
        for fleet in (a.fleet, b.fleet):
            assert fleet["llama"].keys["acme"].requests_per_s == pytest.approx(13 * weight, rel=1e-3)
            assert fleet["llama"].keys["globex"].requests_per_s == pytest.approx(5 * weight, rel=1e-3)
            assert fleet["llama"].keys["globex"].tokens_per_s == pytest.approx(500 * weight, rel=1e-3)
            assert fleet["llama"].total.requests_per_s == pytest.approx(18 * weight, rel=1e-3)
        assert a.bytes_written > 0 and a.bytes_read > a.bytes_written  # it read both gateways' figures
    finally:
        await a.close()
        await b.close()


async def test_a_gateway_that_stops_writing_leaves_the_fleet_figure(
    redis_server: RedisServer, probe: redis.asyncio.Redis
) -> None:
    clock, prefix = Clock(0.0), f"test-{uuid.uuid4().hex}"
    a = gateway(redis_server.url, prefix, "gw-a", clock, stale_after_s=0.2)
    b = gateway(redis_server.url, prefix, "gw-b", clock, stale_after_s=0.2)
    try:
        b.meter.record("llama", "globex", 1)
        clock.advance(1)
        await b.tick()
        await a.tick()
        assert a.gateways == 2 and "globex" in a.fleet["llama"].keys
        for _ in range(200):  # b is gone: a bounded poll until its entry ages out on Redis' clock (0.2 s)
            await asyncio.sleep(0.02)
            await a.tick()
            if a.gateways == 1:
                break
        assert a.gateways == 1 and "llama" not in a.fleet  # a itself measured nothing
        assert a.exchange is not None and await probe.hkeys(a.exchange.key) == ["gw-a"]
    finally:
        await a.close()
        await b.close()


async def test_without_redis_a_gateway_places_by_its_own_figures() -> None:
    server = RedisServer().start()
    clock = Clock(0.0)
    a = gateway(server.url, f"test-{uuid.uuid4().hex}", "gw-a", clock)
    try:
        server.stop()
        a.meter.record("llama", "acme", 10)
        clock.advance(10)
        await a.tick()  # the swap fails: its own figures, said once
        assert not a.exchange_up and a.gateways == 1
        assert a.fleet["llama"].keys["acme"].requests_per_s > 0
        server.start()
        await a.tick()
        assert a.exchange_up and a.gateways == 1
    finally:
        await a.close()
        server.stop()


@pytest.mark.parametrize("bad", ["Infinity", "1e999", "NaN", "-5"])
def test_figures_that_are_no_rate_leave_the_gateway_out(bad: str) -> None:
    """One infinite key rate (another gateway's bug, or anyone with Redis access) made the leader's plan swap keys
    back and forth every interval, each swap a cold load; NaN and negative rates hide load. Such figures are
    unreadable, so the gateway that wrote them is left out of the fleet's figure (and said once)."""
    for text in (
        f'{{"llama": [1, 1, {{"acme": [{bad}, 1]}}]}}',
        f'{{"llama": [1, 1, {{"acme": [1, {bad}]}}]}}',
        f'{{"llama": [1, 1, {{"acme": [1, 1, {bad}]}}]}}',
        f'{{"llama": [{bad}, 1, {{}}]}}',
    ):
        with pytest.raises(ValueError):
            decode(text)
    assert decode('{"llama": [1, 2, {"acme": [0.5, 3, 0.1]}]}')["llama"].keys["acme"].spills_per_s == 0.1


def test_figures_that_only_sum_to_infinity_leave_the_gateway_out() -> None:
    """Each finite, two gateways' 1e308 requests a second for one key summed to infinity in the fleet's figure, and
    the leader's plan swapped keys back and forth every interval as for an infinite rate (each swap a cold load).
    A figure above MAX_RATE (a billion a second) is no measurement: unreadable; a thousand gateways' largest
    readable figures still sum to a finite one, which the plan places once and then leaves."""
    with pytest.raises(ValueError):
        decode('{"llama": [1, 1, {"acme": [1e308, 1]}]}')
    top = decode(f'{{"llama": [{MAX_RATE}, {MAX_RATE}, {{"t0": [{MAX_RATE}, {MAX_RATE}, {MAX_RATE}]}}]}}')
    fleet = merge([top] * 1000 + [decode('{"llama": [1, 1, {"t5": [1e9, 1]}]}')], 10)["llama"]
    rates = [fleet.total, *fleet.keys.values()]
    assert all(math.isfinite(f) for r in rates for f in (r.requests_per_s, r.tokens_per_s, r.spills_per_s))
    loads = {f"t{i}": 0.5 for i in range(16)} | {key: rate.requests_per_s for key, rate in fleet.keys.items()}
    replicas = ["r0", "r1", "r2", "r3"]
    current: dict[str, tuple[str, ...]] = {}
    changes: list[int] = []
    for _ in range(4):
        home = {key: replicas[int(key[1:]) // 4] for key in loads}
        result = plan(PlanInput(replicas, loads, current, home.__getitem__, known=list(home)), PlanSettings())
        current, changes = dict(result.homes), [*changes, len(result.changes)]
    assert changes[-2:] == [0, 0], changes


def test_figures_nested_past_the_parsers_depth_are_unreadable() -> None:
    """Nested deeper than the JSON parser recurses (anyone with Redis access): unreadable, as any other noise (a
    RecursionError went past the exchange's handling, and failed the traffic read)."""
    with pytest.raises(ValueError):
        decode('{"llama": ' + "[" * 100_000)


MALFORMED = [
    pytest.param('{"llama": [1' + "0" * 400 + ", 1, {}]}", id="an integer past a double: OverflowError"),
    pytest.param('{"llama": [1, 1, {"acme": [1' + "0" * 400 + ", 1]}]}", id="a key's integer past a double"),
    pytest.param('{"llama": {"a": 1, "b": 2, "c": 3}}', id="a pool of three fields"),
    pytest.param('{"llama": "abc"}', id="a pool of three characters"),
    pytest.param('{"llama": null}', id="a pool of null"),
    pytest.param('{"llama": [1, 1, {"acme": {"a": 1, "b": 2}}]}', id="a key of an object"),
    pytest.param('{"llama": [[1], 1, {}]}', id="a figure of a list"),
    pytest.param("", id="nothing"),
]


@pytest.mark.parametrize("text", MALFORMED)
async def test_a_malformed_entry_of_another_gateway_is_left_out_and_the_others_merge(
    measured: Measured, probe: redis.asyncio.Redis, text: str
) -> None:
    """Another gateway's entry (another version's, or anyone's with Redis access) that is not figures: left out
    alone, the fleet's figure still merged from every other gateway's. An integer past a double (valid JSON) raised
    OverflowError out of float(), past the tick's handling: every gateway's traffic tick failed while the entry was
    fresh, so the fleet's figure, which placement and the fill read, stayed as it was."""
    await measured.b.tick()
    seconds, _ = await probe.time()  # stamped now: read, not dropped as stale
    await probe.hset(measured.figures_key, "gw-junk", f"{seconds * 1000} {text}")
    await measured.a.tick()
    assert measured.a_merged_both()


async def test_an_entry_stamped_in_redis_future_is_dropped_as_stale(
    redis_server: RedisServer, probe: redis.asyncio.Redis
) -> None:
    """Entries are stamped by Redis' clock and dropped once older than three intervals; one stamped ahead of it (a
    Redis whose clock was set back, a failover to a host behind, or any writer) was never older, so a gateway gone
    since stayed in the fleet's figure until Redis' clock caught up with the stamp, placement moving keys by its
    ghost traffic. An entry stamped more than the staleness ahead of Redis' clock counts as stale too."""
    prefix, clock = f"test-{uuid.uuid4().hex}", Clock(0.0)
    a = gateway(redis_server.url, prefix, "gw-a", clock)
    try:
        a.meter.record("llama", "acme", 10)
        clock.advance(10)
        seconds, micros = await probe.time()
        ahead_ms = seconds * 1000 + micros // 1000 + 3_600_000  # an hour ahead
        ghost = '{"llama": [50, 500, {"ghost": [50, 500]}]}'
        await probe.hset(f"{prefix}:{{traffic}}:by_gateway", "gw-gone", f"{ahead_ms} {ghost}")
        await a.tick()
        assert a.gateways == 1 and "ghost" not in a.fleet["llama"].keys
        assert not await probe.hexists(f"{prefix}:{{traffic}}:by_gateway", "gw-gone")
    finally:
        await a.close()


async def test_an_entry_larger_than_any_gateways_figures_is_not_read(
    measured: Measured, probe: redis.asyncio.Redis
) -> None:
    """Every gateway reads every entry each interval and decodes it on its event loop: one entry of tens of MB (any
    writer's; Redis takes 512 MB) cost each gateway its transfer, its memory and its parse every interval, for as
    long as it was rewritten. An entry larger than this gateway's own figures can be at its traffic.max_keys (256
    bytes a key, at least 1 MiB) is left out by the script, not sent, and said once."""
    await measured.b.tick()
    keys = ",".join(f'"k{i}": [1, 1]' for i in range(150_000))  # ~2.4 MB of readable figures
    seconds, _ = await probe.time()
    await probe.hset(measured.figures_key, "gw-huge", f"{seconds * 1000} " + '{"llama": [1, 1, {' + keys + "}]}")
    await measured.a.tick()
    assert measured.a_merged_both()
    assert measured.a.bytes_read < 1 << 20


async def test_a_figures_key_of_another_type_is_replaced_not_the_exchange_down(
    measured: Measured, probe: redis.asyncio.Redis
) -> None:
    """Someone SETs a string where the figures' hash lives: every gateway's swap raised WRONGTYPE (StoreUnavailable)
    at every interval, and each placed by its own figures alone for good. The gateway owns the key: one of another
    type is deleted and written again."""
    await probe.set(measured.figures_key, "not a hash")
    await measured.b.tick()
    await measured.a.tick()
    assert measured.a.exchange_up and measured.a_merged_both()
