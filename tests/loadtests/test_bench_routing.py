"""The routing benchmark's collide trace: its heavy tenants are the ones the gateway's count-balanced homes put on
one replica (the trace computes them as the gateway does), and they carry the trace's heavy share."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from gateway.config import GatewayConfig
from gateway.fleet.fleet import Fleet
from loadtests.bench_routing import REPLICAS, TRACES, colliding, make_trace
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
