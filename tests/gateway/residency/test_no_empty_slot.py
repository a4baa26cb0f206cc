"""No empty slot, end to end: a `tenantgate serve` process in front of simulated vLLM replicas at a GPU-like time
scale (a cold load costs 0.2-0.4 s, as on a data-centre GPU). Every adapter fits (16 tenants, 4 replicas of 4
slots), so once the gateway says it is ready no tenant's request, the first included, may pay a cold load. With
``residency.fill_warm_up`` each filled adapter has had one token too (into the engine's GPU slots).

What happened is read from the replicas' own counters (/sim/stats), not from the gateway's word.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

import openai
import pytest

from loadtests.fleet import api_key, fleet_with_gateway, sim_stats
from tests.gateway.residency.test_residency_e2e import admin_get

pytestmark = pytest.mark.timeout(180)

TENANTS = {f"t{i:02d}": [f"adapter-t{i:02d}"] for i in range(16)}
GPU_LIKE = ["--time-scale", "1.0", "--max-loras", "2", "--max-cpu-loras", "4"]


def test_homed_tenants_pay_no_cold_load_after_ready_the_first_request_included(tmp_path: Path) -> None:
    extra = {"residency": {"fill_warm_up": True}}
    with fleet_with_gateway(tmp_path, TENANTS, 4, GPU_LIKE, max_adapters=4, extra=extra) as fleet:
        # fleet_with_gateway returned once /readyz said ready; no tenant has sent anything yet.
        homes = {t: admin_get(fleet.gateway_url, f"/admin/route?tenant={t}")["home"] for t in TENANTS}
        ready = {replica: sim_stats(url) for replica, url in fleet.replica_urls.items()}
        for replica, stats in ready.items():  # each replica holds the adapters of the tenants homed there
            homed = sorted(f"adapter-{t}" for t, home in homes.items() if home == replica)
            assert sorted(stats["registered"]) == homed
            assert stats["requests_by_model"] == dict.fromkeys(homed, 1)  # each warmed with one token
        ttfts: list[float] = []

        async def tenant(name: str) -> None:
            client = openai.AsyncOpenAI(base_url=fleet.gateway_url + "/v1", api_key=api_key(name), max_retries=0)
            for i in range(3):
                started = time.perf_counter()
                stream = await client.completions.create(
                    model=f"adapter-{name}", prompt=f"q{i}", max_tokens=4, stream=True
                )
                async for _ in stream:
                    ttfts.append(time.perf_counter() - started)
                    break
                async for _ in stream:
                    pass

        async def traffic() -> None:
            await asyncio.gather(*(tenant(name) for name in TENANTS))

        asyncio.run(traffic())
        after = {replica: sim_stats(url) for replica, url in fleet.replica_urls.items()}

    cold_after_ready = sum(after[r]["cold_loads"] - ready[r]["cold_loads"] for r in after)
    assert cold_after_ready == 0, {r: after[r]["cold_loads"] - ready[r]["cold_loads"] for r in after}
    for name in TENANTS:  # and every request went to its home, where its adapter waited
        served = {r for r, stats in after.items() if stats["requests_by_model"].get(f"adapter-{name}")}
        assert served == {homes[name]}, name
    # A figure for the README, not an assertion (timing on a shared machine): TTFT p50 and max, in ms.
    ordered = sorted(ttfts)
    print(f"TTFT p50 {1000 * statistics.median(ordered):.0f} ms, max {1000 * ordered[-1]:.0f} ms over {len(ordered)}")
