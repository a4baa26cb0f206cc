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


def test_the_tails_requests_are_split_by_what_they_waited_for() -> None:
    """``tail_regimes``: the slowest 1% of requests, each split by the engines' timelines into its own adapter's
    load, other adapters' loads on its replica, swap-ins, its wait for a step (by the reason it waited), its first
    step and the gateway's time before the engine saw it; the largest part names it."""
    from loadtests.bench_routing import Observed, tail_regimes
    from loadtests.sim.timeline import prompt_digest

    fast = [0.05] * 98
    observed = Observed(
        ttft=[*fast, 0.9, 0.6], tenants=["t01"] * 98 + ["t01", HOT], sent=[0.0] * 98 + [10.0, 20.0],
        digests=[prompt_digest(f"p{i}") for i in range(98)] + [prompt_digest("own"), prompt_digest("queued")],
        started=0.0,
    )  # fmt: skip
    timelines = {
        # t01's request: the gateway loaded its adapter on the request path (0.4 s, before the engine saw the request),
        # then another adapter's load (0.3 s) stalled the replica while it waited for a step.
        "r0": {
            "stalls": [[10.05, 10.45, "load", "lora-t01"], [10.5, 10.8, "load", "lora-t02"]],
            "requests": [{"adapter": "lora-t01", "digest": prompt_digest("own"), "arrived": 10.46, "admitted": 10.85,
                          "first_token": 10.9, "waited_for": []}],
        },
        # The hot tenant's: 0.5 s waiting for a seat, a swap-in of 25 ms in its first step.
        "r1": {
            "stalls": [[20.52, 20.545, "swap", f"lora-{HOT}"]],
            "requests": [{"adapter": f"lora-{HOT}", "digest": prompt_digest("queued"), "arrived": 20.01,
                          "admitted": 20.51, "first_token": 20.6, "waited_for": ["batch", "lora_slot"]}],
        },
    }  # fmt: skip
    tail = tail_regimes(observed, timelines, {HOT})
    own, queued = tail["requests"]
    assert (own["tenant"], own["replica"], own["part"], own["at_s"]) == ("t01", "r0", "own load", 10.0)
    assert own["own load"] == pytest.approx(400, abs=1) and own["others' loads"] == pytest.approx(300, abs=1)
    assert own["gateway"] == pytest.approx(60, abs=1)  # 0.46 s before the engine saw it, 0.4 s of it the load
    assert own["wait for a step"] == pytest.approx(90, abs=1) and own["first step"] == pytest.approx(50, abs=1)
    assert (queued["tenant"], queued["heavy"], queued["part"]) == (HOT, True, "wait for a seat")
    assert queued["wait for a seat"] == pytest.approx(500, abs=1) and queued["swap-ins"] == pytest.approx(25, abs=1)
    assert queued["first step"] == pytest.approx(65, abs=1)
    assert tail["by_part"] == {"own load": {"heavy": 0, "light": 1}, "wait for a seat": {"heavy": 1, "light": 0}}
