"""What residency-aware routing saves: one multi-tenant trace replayed under each routing policy.

The trace is seeded: tenants with one adapter each, Zipf popularity, Poisson arrivals, more adapters than the
fleet's host slots. It is replayed open-loop (each request at its own offset, whatever the answers do) through
the gateway in front of a fresh simulated fleet per policy, so every policy sees the same demand. Printed per
policy: cold adapter loads in the engines (disk reads; the compulsory minimum is the number of distinct adapters),
evictions (the engines' own and the gateway's unloads), TTFT p50/p99 and requests/s.

    python -m loadtests.bench_residency [--rate 60] [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

from loadtests.fleet import api_key, fleet_with_gateway, sim_stats

ADAPTERS = 32
REPLICAS = 4
MAX_LORAS, MAX_CPU_LORAS = 2, 4  # per replica: 8 GPU slots and 16 host slots in the fleet, for 32 adapters
SIM_ARGS = ["--time-scale", "0.1", "--max-loras", str(MAX_LORAS), "--max-cpu-loras", str(MAX_CPU_LORAS)]
TENANTS = {f"tenant-{i:02d}": [f"lora-{i:02d}"] for i in range(ADAPTERS)}

VARIANTS: dict[str, dict[str, Any]] = {
    "round_robin": {"policy": "round_robin"},
    "least_loaded": {"policy": "least_loaded"},
    "consistent_hash": {"policy": "consistent_hash"},
    "bounded, ring homes": {"home_placement": "ring"},
    "bounded, ring spill": {"prefer_resident": False},
    "bounded + residency": {"prefer_resident": True},
}


@dataclass(frozen=True)
class Arrival:
    offset_s: float
    tenant: str


def make_trace(rate: float, seconds: float, seed: int = 11, exponent: float = 1.1) -> list[Arrival]:
    rng = random.Random(seed)
    tenants = sorted(TENANTS)
    weights = [1 / (rank + 1) ** exponent for rank in range(len(tenants))]
    trace: list[Arrival] = []
    now = 0.0
    while True:
        now += rng.expovariate(rate)
        if now >= seconds:
            return trace
        trace.append(Arrival(now, rng.choices(tenants, weights)[0]))


async def replay(gateway_url: str, trace: list[Arrival]) -> tuple[list[float], int, float]:
    """Send each request at its offset (streaming); return times to first token, failures and elapsed seconds."""
    clients = {
        t: openai.AsyncOpenAI(base_url=gateway_url + "/v1", api_key=api_key(t), max_retries=0, timeout=60)
        for t in TENANTS
    }
    ttft: list[float] = []
    failures = 0
    started = time.monotonic()

    async def one(index: int, arrival: Arrival) -> None:
        nonlocal failures
        await asyncio.sleep(max(0.0, started + arrival.offset_s - time.monotonic()))
        sent = time.monotonic()
        try:
            stream = await clients[arrival.tenant].completions.create(
                model=TENANTS[arrival.tenant][0], prompt=f"{arrival.tenant} asks {index}", max_tokens=8, stream=True
            )
            first = None
            async for _ in stream:
                first = first or time.monotonic()
            ttft.append((first or time.monotonic()) - sent)
        except openai.APIError:
            failures += 1

    await asyncio.gather(*(one(i, a) for i, a in enumerate(trace)))
    elapsed = time.monotonic() - started
    for client in clients.values():
        await client.close()
    return ttft, failures, elapsed


def run_variant(
    trace: list[Arrival],
    policy: str = "bounded_consistent_hash",
    prefer_resident: bool = True,
    home_placement: str = "balanced",
) -> dict[str, Any]:
    routing = {
        "routing": {
            "affinity": "tenant",
            "balance_factor": 1.25,
            "prefer_resident": prefer_resident,
            "home_placement": home_placement,
        }
    }
    with (
        tempfile.TemporaryDirectory() as tmp,
        fleet_with_gateway(
            Path(tmp), TENANTS, REPLICAS, SIM_ARGS, policy=policy, max_adapters=MAX_CPU_LORAS, extra=routing
        ) as fleet,
    ):
        ttft, failures, elapsed = asyncio.run(replay(fleet.gateway_url, trace))
        stats = [sim_stats(url) for url in fleet.replica_urls.values()]
    times = sorted(ttft)
    return {
        "cold": sum(s["cold_loads"] for s in stats),
        "engine_evictions": sum(s["host_evictions"] for s in stats),
        "gateway_unloads": sum(s["unregistrations"] for s in stats),
        "p50": 1000 * statistics.median(times),
        "p99": 1000 * times[int(0.99 * (len(times) - 1))],
        "rps": len(trace) / elapsed,
        "failures": failures,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=60.0, help="mean arrivals per second (Poisson)")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of the trace")
    args = parser.parse_args(argv)
    trace = make_trace(args.rate, args.seconds)
    distinct = len({a.tenant for a in trace})
    print(
        f"trace: {len(trace)} requests over {args.seconds:.0f} s, {distinct} distinct adapters (Zipf), "
        f"{REPLICAS} replicas x {MAX_LORAS} GPU / {MAX_CPU_LORAS} host adapter slots, gateway max_adapters "
        f"{MAX_CPU_LORAS}"
    )
    print(
        f"{'routing':22} {'cold loads':>10} {'engine evict':>12} {'gw unloads':>10} {'TTFT p50':>9} {'p99':>8}"
        f" {'req/s':>6} {'failed':>6}"
    )
    for name, variant in VARIANTS.items():
        row = run_variant(trace, **variant)
        print(
            f"{name:22} {row['cold']:10d} {row['engine_evictions']:12d} {row['gateway_unloads']:10d} "
            f"{row['p50']:7.1f}ms {row['p99']:6.1f}ms {row['rps']:6.1f} {row['failures']:6d}"
        )
    print(f"compulsory minimum of cold loads: {distinct} (each adapter read from disk once)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
