"""The traffic meter (gateway/observe/traffic.py): a moving average per key, bounded in keys, and the merge of
several gateways' figures; the figures' wire form (gateway/placement/exchange.py). Pure: a fake clock, no I/O."""

from __future__ import annotations

import math

import pytest

from gateway.observe.traffic import PoolTraffic, Rate, TrafficMeter, merge
from gateway.placement.collector import TrafficCollector
from gateway.placement.exchange import FleetTraffic, decode, encode
from tests.clock import Clock


def meter(clock: Clock, window_s: float = 10.0, max_keys: int = 100, per_interval: int = 1000) -> TrafficMeter:
    return TrafficMeter(window_s, max_keys, per_interval, clock=clock)


def test_one_interval_moves_the_average_by_its_weight() -> None:
    clock = Clock(0.0)
    m = meter(clock)
    for _ in range(20):
        m.record("llama", "acme", 50)
    clock.advance(10)  # one window: the new rates weigh 1 - e^-1
    acme = m.fold()["llama"].keys["acme"]
    weight = 1 - math.exp(-1)
    assert acme.requests_per_s == pytest.approx(2.0 * weight)
    assert acme.tokens_per_s == pytest.approx(100.0 * weight)
    assert m.view()["llama"].total == acme  # one key: the pool's total is its rate


def test_spills_are_averaged_beside_the_requests_they_are_part_of() -> None:
    clock = Clock(0.0)
    m = meter(clock)
    for index in range(20):
        m.record("llama", "acme", 50, spilled=index % 4 == 0)  # 5 of 20 left the key's set for demand
    clock.advance(10)
    acme = m.fold()["llama"].keys["acme"]
    assert acme.spills_per_s == pytest.approx(0.5 * (1 - math.exp(-1)))
    assert acme.spills_per_s / acme.requests_per_s == pytest.approx(0.25)


def test_a_steady_rate_is_what_the_average_converges_to_and_a_silent_key_is_forgotten() -> None:
    clock = Clock(0.0)
    m = meter(clock, window_s=30.0)
    for _ in range(60):  # 5 minutes at 3 requests per second, folded every 5 s
        for _ in range(15):
            m.record("llama", "acme", 10)
        clock.advance(5)
        m.fold()
    assert m.view()["llama"].keys["acme"].requests_per_s == pytest.approx(3.0, rel=0.01)
    clock.advance(30)
    assert m.fold()["llama"].keys["acme"].requests_per_s == pytest.approx(3.0 * math.exp(-1), rel=0.01)
    clock.advance(30 * 15)  # e^-16 of 3/s is below one an hour
    assert "acme" not in m.fold()["llama"].keys


def test_keys_are_bounded_per_interval_and_after_each_fold_and_totals_stay_exact() -> None:
    clock = Clock(0.0)
    m = meter(clock, window_s=1.0, max_keys=3, per_interval=5)
    for i in range(8):  # eight session keys, key i sending i + 1 requests
        for _ in range(i + 1):
            m.record("llama", f"s{i}", 1)
    assert m.dropped_keys == 6 + 7 + 8  # s5, s6 and s7 came past the fifth distinct key: totals only
    clock.advance(1)
    view = m.fold()["llama"]
    assert set(view.keys) == {"s2", "s3", "s4"}  # the busiest three of the five counted
    assert view.total.requests_per_s == pytest.approx(36 * (1 - math.exp(-1)))  # every request, 1 + ... + 8


def test_merge_adds_every_gateways_rates_and_keeps_the_busiest_keys() -> None:
    a = {"llama": PoolTraffic(Rate(3, 30), {"acme": Rate(2, 20), "globex": Rate(1, 10)})}
    b = {
        "llama": PoolTraffic(Rate(2, 20), {"acme": Rate(1, 10), "initech": Rate(1, 10)}),
        "mistral": PoolTraffic(Rate(5, 5), {"sql": Rate(5, 5)}),
    }
    fleet = merge([a, b], max_keys=3)
    assert fleet["llama"].total == Rate(5, 50) and fleet["mistral"].total == Rate(5, 5)
    assert fleet["llama"].keys == {"acme": Rate(3, 30), "globex": Rate(1, 10)}  # initech ties globex, loses by name
    assert fleet["mistral"].keys == {"sql": Rate(5, 5)}


def test_figures_survive_their_wire_form_to_four_significant_digits() -> None:
    traffic = {"llama": PoolTraffic(Rate(1 / 3, 1234.5678), {"acme": Rate(1 / 3, 1234.5678), "a/b c": Rate(0, 0)})}
    back = decode(encode(traffic))
    assert back["llama"].total.requests_per_s == pytest.approx(1 / 3, rel=1e-3)
    assert back["llama"].keys["acme"].tokens_per_s == pytest.approx(1234.5678, rel=1e-3)
    assert back["llama"].keys["a/b c"] == Rate(0, 0)
    spilling = decode(encode({"llama": PoolTraffic(Rate(4, 40), {"acme": Rate(4, 40, 1.5)})}))
    assert spilling["llama"].keys["acme"] == Rate(4, 40, 1.5)
    # A gateway of the version before spills writes two figures per key: read as no spills.
    assert decode('{"llama": [4, 40, {"acme": [4, 40]}]}')["llama"].keys["acme"] == Rate(4, 40, 0.0)
    # Requests in flight come fourth, after the spills (0 where it has none).
    busy = decode(encode({"llama": PoolTraffic(Rate(4, 40), {"acme": Rate(4, 40, 0.0, 2.5)})}))
    assert busy["llama"].keys["acme"] == Rate(4, 40, 0.0, 2.5)


def test_a_keys_requests_in_flight_are_the_seconds_its_requests_held_per_second() -> None:
    clock = Clock(0.0)
    m = meter(clock, window_s=1e-9)  # the average is the last interval's figure
    for _ in range(10):
        m.record("llama", "acme", 1, busy_s=0.3)  # ten requests of 0.3 s in a second: 3 in flight on average
    clock.advance(1)
    assert m.fold()["llama"].keys["acme"].in_flight == pytest.approx(3.0)


def test_a_request_counts_when_it_is_placed_not_when_it_ends() -> None:
    """A request that waits in an engine's queue past a fold counts in the interval it was placed: counted at its
    end, collide's heavy tenants read 1.4-4.1 of their 7.2 requests per second while they queued."""
    clock = Clock(0.0)
    m = meter(clock, window_s=1e-9)  # the average is the last interval's figure
    for _ in range(7):
        m.placed("llama", "acme")  # seven placed this second, none ended yet: they queue
    clock.advance(1)
    acme = m.fold()["llama"].keys["acme"]
    assert acme.requests_per_s == pytest.approx(7.0)
    assert m.view()["llama"].total.requests_per_s == pytest.approx(7.0)
    for _ in range(7):  # they end in the next second: what they used and held counts then, not them again
        m.ended("llama", "acme", 10, spilled=True, busy_s=0.5)
    m.placed("llama", "acme")  # and one more arrives
    clock.advance(1)
    acme = m.fold()["llama"].keys["acme"]
    assert acme.requests_per_s == pytest.approx(1.0)
    # In flight: one placed per second, each holding a seat for 0.5 s (Little's law).
    assert (acme.tokens_per_s, acme.spills_per_s, acme.in_flight) == pytest.approx((70.0, 7.0, 0.5))


def test_a_queued_keys_requests_in_flight_are_its_demand_not_the_seats_it_got() -> None:
    """Ten requests a second, each holding a seat for a second, on a replica that runs four at once: four end a
    second and the key holds four seats, but its demand is ten in flight (the plan sizes its set by that: a key
    whose demand passes a replica's seats cannot be served there)."""
    clock = Clock(0.0)
    m = meter(clock, window_s=1e-9)
    for _ in range(10):
        m.placed("llama", "acme")
    for _ in range(4):
        m.ended("llama", "acme", 1, busy_s=1.0)
    clock.advance(1)
    assert m.fold()["llama"].keys["acme"].in_flight == pytest.approx(10.0)


def test_the_window_counts_from_the_first_request_not_from_the_start() -> None:
    """A gateway idle before its traffic comes has measured nothing: the window a table needs before it confines
    spills (placement) counts from the first request."""
    clock = Clock(0.0)
    m = meter(clock, window_s=4.0)
    clock.advance(60)  # up and idle for a minute
    m.fold()
    assert m.measured_s() == 0.0
    m.placed("llama", "acme")
    clock.advance(3)
    assert m.measured_s() == pytest.approx(3.0)


@pytest.mark.parametrize(
    "text",
    [
        "[]",
        "{}x",
        '{"llama": 3}',
        '{"llama": [1, 2]}',
        '{"llama": [1, 2, {"k": [1]}]}',
        '{"llama": [1, "x", {}]}',
        '{"llama": [1, 2, []]}',
        '{"llama": [1, 2, {"k": [1, 2, 3, 4, 5]}]}',
    ],
    ids=["list", "junk", "number", "short", "short-key", "not-a-number", "keys-not-an-object", "long-key"],
)
def test_unreadable_figures_raise_value_or_type_errors(text: str) -> None:
    with pytest.raises((ValueError, TypeError)):
        decode(text)


def test_two_thousand_keys_most_of_them_sessions_encode_to_under_100_kb() -> None:
    """The size the README states for one swap's write: what Redis carries per gateway per interval."""
    tenants = [f"tenant-{i:04d}" for i in range(500)]
    sessions = [f"{tenants[i % 500]}/{i:024x}" for i in range(1500)]  # as directory.affinity_key writes them
    keys = {key: Rate(123.456789, 98765.4321) for key in tenants + sessions}
    size = len(encode({"llama": PoolTraffic(Rate(1e4, 1e7), keys)}))
    assert 60_000 < size < 100_000, size


def test_per_key_series_are_only_the_metric_keys_busiest_of_each_pool() -> None:
    """README and docs/operations.md: the `key` label (a session digest under session affinity: unbounded in number)
    has a series for each pool's traffic.metric_keys busiest keys only; the pool's figures count every key."""
    traffic = FleetTraffic(meter(Clock(0.0)), "g", max_keys=100)
    traffic.fleet = {
        pool: PoolTraffic(Rate(465.0, 0.0), {f"acme/{n:024x}": Rate(float(n), 0.0) for n in range(1, 31)})
        for pool in ("llama", "mistral")
    }
    families = {family.name: family for family in TrafficCollector(traffic, metric_keys=5).collect()}
    keyed = families["tenantgate_traffic_key_requests_per_second"].samples
    for pool in ("llama", "mistral"):
        rates = sorted(sample.value for sample in keyed if sample.labels["pool"] == pool)
        assert rates == [26.0, 27.0, 28.0, 29.0, 30.0]
    assert [sample.value for sample in families["tenantgate_traffic_keys"].samples] == [30.0, 30.0]
