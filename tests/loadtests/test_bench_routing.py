"""The routing benchmark's collide trace: its heavy tenants are the ones the gateway's count-balanced homes put on
one replica (the trace computes them as the gateway does), and they carry the trace's heavy share."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from gateway.config import GatewayConfig
from gateway.fleet.fleet import Fleet
from loadtests.bench_routing import (
    HOT,
    LOAD_S,
    REPLICAS,
    TRACES,
    cold_load_events,
    cold_load_sources,
    colliding,
    hot_spills,
    make_trace,
)
from loadtests.fleet import gateway_config, write_adapters


async def test_the_collide_traces_heavy_tenants_share_a_balanced_home_in_the_gateway(tmp_path: Path) -> None:
    spec = TRACES["collide"]
    heavy = colliding(spec.tenant_ids, spec.collide)
    adapters = write_adapters(tmp_path, [f"lora-{t}" for t in spec.tenant_ids])
    replicas = {f"r{i}": f"http://127.0.0.1:{9 + i}" for i in range(REPLICAS)}
    tenants = {t: [f"lora-{t}"] for t in spec.tenant_ids}
    fleet = Fleet(GatewayConfig.model_validate(gateway_config(replicas, tenants, adapters, port=0, max_adapters=4)))
    try:
        ring = fleet.pools["llama"].ring
        assert len(heavy) == 2 and ring.home(heavy[0]) == ring.home(heavy[1])
    finally:
        await fleet.close()
    trace = make_trace(20, spec.rate, 17, spec)
    counts = Counter(arrival.tenant for arrival in trace)
    share = sum(counts[t] for t in heavy) / len(trace)
    assert abs(share - spec.heavy_share) < 0.08, share


def test_cold_load_sources_count_first_sights_causes_and_regretted_evictions() -> None:
    events = cold_load_events(
        {"r0": {"cold_load_log": [[1.0, "a9", "load", []]]}, "r1": {"cold_load_log": []}},
        {
            "r0": {
                "cold_load_log": [[1.0, "a9", "load", []], [2.0, "a1", "load", ["a2"]], [5.0, "a2", "load", ["a3"]]]
            },
            "r1": {"cold_load_log": [[3.0, "a2", "request", []], [30.0, "a3", "load", []]]},
        },
        started=2.0,
    )
    # Only what happened after the first snapshot, oldest first, timed from the trace's start.
    assert [(t, replica, adapter) for t, replica, adapter, _, _ in events] == [
        (0.0, "r0", "a1"), (1.0, "r1", "a2"), (3.0, "r0", "a2"), (28.0, "r1", "a3"),
    ]  # fmt: skip
    sources = cold_load_sources(events)
    assert sources["cold_loads_by_replica"] == {"r0": 2, "r1": 2}
    assert sources["cold_loads_by_cause"] == {"load": 3, "request": 1}
    assert sources["cold_loads_first_sight"] == 3
    # a2, evicted from r0 at 0 s, was loaded there again 3 s later; a3 was evicted from r0, not from r1.
    assert sources["cold_loads_regretted"] == 1


def test_the_hot_tenants_cold_spills_count_from_its_second_homes_warm_moment() -> None:
    """The hot tenant's first cold load in the trace (r1 at 15 s) is its second home, warm once the load ended
    (LOAD_S later); a cold stream on a replica whose loads of it all began before then waited for the spill's first
    moments and is not counted (r2's, whose load began at 15.1 s); every other one is: r3's (loaded at 18 s) and
    r0's (its home, loaded again after an eviction), and a request whose adapter the engine had dropped since."""
    hot = f"lora-{HOT}"
    events: list[tuple[float, str, str, str, list[str]]] = [
        (15.0, "r1", hot, "load", []),
        (15.1, "r2", hot, "load", []),
        (16.0, "r1", "lora-t01", "load", [hot]),
        (17.0, "r1", hot, "request", []),
        (18.0, "r3", hot, "load", []),
        (19.0, "r0", hot, "load", []),
    ]
    regimes = Counter({("r1", "cold"): 3, ("r2", "cold"): 2, ("r3", "cold"): 1, ("r0", "cold"): 1, ("r1", "warm"): 9})
    spills = hot_spills(regimes, events)
    assert spills["second_home"] == "r1" and spills["second_home_warm_s"] == pytest.approx(15.0 + LOAD_S, abs=0.01)
    assert spills["by_regime"] == {"cold": 7, "warm": 9}
    # r1's cold streams count: the adapter was loaded there again after its second home was warm (the request's).
    assert spills["engine_dropped"] == 1 and spills["cold_after_warm"] == 3 + 1 + 1 + 1
    assert hot_spills(regimes, events[:2])["cold_after_warm"] == 1 + 1  # r3's and r0's only
    assert hot_spills(Counter({("r0", "warm"): 5}), [])["cold_after_warm"] == 0


def test_the_tenant_split_shows_the_heavy_tenants_tail_apart_from_the_light_ones() -> None:
    from loadtests.bench_routing import Observed, heavy_tenants, tenant_split

    collide, hot, fits = TRACES["collide"], TRACES["hot"], TRACES["fits"]
    assert heavy_tenants(collide) == set(colliding(collide.tenant_ids, collide.collide))
    assert heavy_tenants(hot) == {HOT}
    assert heavy_tenants(fits) == set()
    observed = Observed(ttft=[0.010] * 99 + [0.500, 2.0], tenants=["t01"] * 99 + ["t01", HOT])
    split = tenant_split(observed, {HOT})
    assert split == {"heavy_ttft_p99_ms": 2000.0, "light_ttft_p99_ms": 10.0}
    assert tenant_split(observed, set()) == {"heavy_ttft_p99_ms": None, "light_ttft_p99_ms": None}
