"""``tenantgate demo``: a simulated fleet, the gateway in front, skewed multi-tenant traffic, and what happened.

Four simulated vLLM replicas (2 GPU adapter slots, 4 in host memory each) and the gateway on its embedded
default (no Redis). Sixteen tenants, one adapter each, send Zipf-skewed traffic through the openai SDK. The same
traffic runs twice, on a fresh fleet each time: under the default policy (predicted_ttft: the lowest predicted
time to first token under a bounded-load cap, homes by tenant) and under round robin, and a table per tenant shows
where requests went and what the engines paid.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
import openai

from loadtests.fleet import ADMIN_TOKEN, RunningFleet, api_key, fleet_with_gateway, sim_stats

TENANTS = {f"tenant-{i:02d}": [f"lora-{i:02d}"] for i in range(16)}
REQUESTS = 480
CONCURRENCY = 16
SIM_ARGS = ["--time-scale", "0.1", "--max-loras", "2", "--max-cpu-loras", "4"]


def zipf_traffic(seed: int = 7, exponent: float = 1.1) -> list[str]:
    tenants = sorted(TENANTS)
    weights = [1 / (rank + 1) ** exponent for rank in range(len(tenants))]
    return random.Random(seed).choices(tenants, weights, k=REQUESTS)


def progress(completed: int, total: int, *, done: bool = False) -> None:
    """A progress line on a terminal (rewritten in place); nothing in a log."""
    if sys.stdout.isatty() and (done or completed % 24 == 0):
        print(f"\r  {completed}/{total} requests", end="\n" if done else "", flush=True)


async def _drive(fleet: RunningFleet, traffic: list[str]) -> dict[str, list[float]]:
    """Send every request (streaming), CONCURRENCY at a time; return each tenant's times to first token."""
    ttft: dict[str, list[float]] = defaultdict(list)
    queue: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
    for item in enumerate(traffic):
        queue.put_nowait(item)
    clients = {t: openai.AsyncOpenAI(base_url=fleet.gateway_url + "/v1", api_key=api_key(t)) for t in TENANTS}

    async def worker() -> None:
        while not queue.empty():
            index, tenant = queue.get_nowait()
            started = time.monotonic()
            stream = await clients[tenant].completions.create(
                model=TENANTS[tenant][0], prompt=f"{tenant} question {index}", max_tokens=8, stream=True
            )
            first = None
            async for _ in stream:
                first = first or time.monotonic()
            ttft[tenant].append((first or time.monotonic()) - started)
            progress(sum(len(times) for times in ttft.values()), len(traffic))

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    progress(len(traffic), len(traffic), done=True)
    for client in clients.values():
        await client.close()
    return ttft


def _run(policy: str, traffic: list[str]) -> dict[str, dict[str, Any]]:
    with (
        tempfile.TemporaryDirectory() as tmp,
        fleet_with_gateway(Path(tmp), TENANTS, 4, SIM_ARGS, policy=policy, max_adapters=2) as fleet,
    ):
        started = time.monotonic()
        ttft = asyncio.run(_drive(fleet, traffic))
        elapsed = time.monotonic() - started
        stats = {replica: sim_stats(url) for replica, url in fleet.replica_urls.items()}
        auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        homes = {
            t: httpx.get(f"{fleet.gateway_url}/admin/route?tenant={t}", headers=auth).json()["home"] for t in TENANTS
        }
    print(f"  {policy}: {len(traffic)} requests in {elapsed:.1f} s")
    rows: dict[str, dict[str, Any]] = {}
    for tenant, (adapter,) in TENANTS.items():
        served = {r: s["requests_by_model"].get(adapter, 0) for r, s in stats.items()}
        times = sorted(ttft[tenant])
        rows[tenant] = {
            "requests": sum(served.values()),
            "home": homes[tenant],
            "at_home": served[homes[tenant]] / max(1, sum(served.values())),
            "cold_loads": sum(s["cold_loads_by_adapter"].get(adapter, 0) for s in stats.values()),
            "p50": 1000 * statistics.median(times) if times else 0.0,
            "p99": 1000 * times[int(0.99 * (len(times) - 1))] if times else 0.0,
        }
    return rows


def run() -> int:
    traffic = zipf_traffic()
    print(f"16 tenants, Zipf-skewed traffic, {REQUESTS} streaming requests, {CONCURRENCY} at a time")
    print("fleet: 4 simulated vLLM replicas, 2 GPU adapter slots + 4 in host memory each, time scale 0.1\n")
    bounded = _run("predicted_ttft", traffic)
    robin = _run("round_robin", traffic)
    print()
    print(f"{'':10} {'':>5} | {'predicted_ttft (default)':^40} | {'round robin':^26}")
    print(
        f"{'tenant':10} {'reqs':>5} | {'home':>4} {'at home':>8} {'cold':>5} {'TTFT p50':>9} {'p99':>8}"
        f" | {'cold':>5} {'TTFT p50':>9} {'p99':>8}"
    )
    for tenant in sorted(TENANTS):
        b, r = bounded[tenant], robin[tenant]
        print(
            f"{tenant:10} {b['requests']:5d} | {b['home']:>4} {b['at_home']:8.0%} {b['cold_loads']:5d} "
            f"{b['p50']:7.1f}ms {b['p99']:6.1f}ms | {r['cold_loads']:5d} {r['p50']:7.1f}ms {r['p99']:6.1f}ms"
        )
    total = {name: sum(row["cold_loads"] for row in rows.values()) for name, rows in (("b", bounded), ("r", robin))}
    print(
        f"\ncold adapter loads: {total['b']} with tenant affinity, {total['r']} with round robin "
        f"(16 is the minimum: each adapter loaded once)"
    )
    return 0
