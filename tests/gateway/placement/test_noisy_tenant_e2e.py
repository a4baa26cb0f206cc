"""A noisy tenant does not push its quiet neighbours' adapters out (homes from traffic, one `tenantgate serve`, four
simulated replicas whose 4 adapter slots each the 16 tenants' adapters fill exactly).

Before the slot budget and the spills kept on the plan, the noisy tenant's requests, predicted faster elsewhere,
put its adapter on every replica within seconds (the plan grew its set to 3 replicas, and ordinary spills took the
fourth), and each copy pushed out a quiet tenant's adapter that tenant was still using: its next request paid a
cold load, and its load pushed out another (loadtests/noisy_tenant.py measures what it costs)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from loadtests.fleet import api_key, gateway_config, gateway_process, sim_stats, simulated_replicas, write_adapters
from loadtests.processes import free_port

pytestmark = pytest.mark.timeout(240)

TENANTS = {f"t{i:02d}": [f"lora-t{i:02d}"] for i in range(16)}
NOISY = "t00"
QUIET = [t for t in TENANTS if t != NOISY]


def cold_loads(stats: dict[str, dict[str, Any]], since: float) -> list[tuple[str, str]]:
    """(replica, adapter) of every cold load the simulators logged since ``since`` (their monotonic clock)."""
    return [(r, event[1]) for r, s in stats.items() for event in s["cold_load_log"] if event[0] >= since]


def test_a_noisy_tenant_does_not_push_the_quiet_tenants_adapters_out(tmp_path: Path) -> None:
    adapters = write_adapters(tmp_path, [name for names in TENANTS.values() for name in names])
    extra = {
        "traffic": {"interval_s": 0.3, "window_s": 1.5},
        "placement": {"interval_s": 0.5},
        "telemetry": {"access_log": False},
    }
    sim_args = ("--time-scale", "0.2", "--max-loras", "2", "--max-cpu-loras", "4")
    with simulated_replicas(tmp_path, 4, *sim_args) as urls:
        config = gateway_config(urls, TENANTS, adapters, port=free_port(), max_adapters=4, extra=extra)
        config["routing"]["home_placement"] = "traffic"
        with gateway_process(tmp_path, config) as (url, _):

            async def run() -> float:
                clients = {
                    t: openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key(t), max_retries=0, timeout=60)
                    for t in TENANTS
                }
                stop = time.monotonic() + 1e9

                async def quiet(tenant: str) -> None:
                    i = 0
                    while time.monotonic() < stop:
                        i += 1
                        await clients[tenant].completions.create(model=f"lora-{tenant}", prompt=f"q{i}", max_tokens=4)
                        await asyncio.sleep(0.2)

                async def noisy(stream: int) -> None:
                    i = 0
                    while time.monotonic() < stop:
                        i += 1
                        prompt = f"n{stream}-{i}"
                        await clients[NOISY].completions.create(model=f"lora-{NOISY}", prompt=prompt, max_tokens=16)

                quiet_tasks = [asyncio.create_task(quiet(t)) for t in QUIET]
                await asyncio.sleep(3.0)  # the quiet tenants are active and measured; every adapter is resident
                noisy_from = time.monotonic()
                stop = noisy_from + 8.0
                await asyncio.gather(*(noisy(s) for s in range(32)), *quiet_tasks)
                for client in clients.values():
                    await client.close()
                return noisy_from

            noisy_from = asyncio.run(run())
            stats = {r: sim_stats(u) for r, u in urls.items()}
    loads = cold_loads(stats, noisy_from)
    quiet_loads = [(r, a) for r, a in loads if a != f"lora-{NOISY}"]
    assert sum(s["requests_by_model"].get(f"lora-{NOISY}", 0) for s in stats.values()) > 100  # it was noisy
    assert quiet_loads == [], loads
