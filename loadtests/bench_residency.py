"""What residency-aware routing saves: one multi-tenant trace replayed under each routing policy.

The trace is seeded: tenants with one adapter each, Zipf popularity, Poisson arrivals, more adapters than the
fleet's host slots. It is replayed open-loop (each request at its own offset, whatever the answers do) through
the gateway in front of a fresh simulated fleet per policy, so every policy sees the same demand. Printed per
policy: cold adapter loads in the engines (disk reads; the compulsory minimum is the number of distinct adapters),
evictions (the engines' own and the gateway's unloads), TTFT p50/p99 and requests/s.

    python -m loadtests.bench_residency [--rate 60] [--seconds 10] [--namings 4] [--variant NAME ...]
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
Tenants = dict[str, list[str]]


def named_tenants(naming: str = "") -> Tenants:
    """The trace's tenants, one adapter each. Another ``naming`` places them elsewhere on the ring: a ring is one
    draw, so ``--namings`` repeats the run over several."""
    return {f"{naming}tenant-{i:02d}": [f"{naming}lora-{i:02d}"] for i in range(ADAPTERS)}


TENANTS = named_tenants()

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


async def replay(gateway_url: str, trace: list[Arrival], tenants: Tenants) -> tuple[list[float], int, float]:
    """Send each request at its offset (streaming); return times to first token, failures and elapsed seconds."""
    clients = {
        t: openai.AsyncOpenAI(base_url=gateway_url + "/v1", api_key=api_key(t), max_retries=0, timeout=60)
        for t in tenants
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
                model=tenants[arrival.tenant][0], prompt=f"{arrival.tenant} asks {index}", max_tokens=8, stream=True
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
    tenants: Tenants = TENANTS,
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
            Path(tmp), tenants, REPLICAS, SIM_ARGS, policy=policy, max_adapters=MAX_CPU_LORAS, extra=routing
        ) as fleet,
    ):
        ttft, failures, elapsed = asyncio.run(replay(fleet.gateway_url, trace, tenants))
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
    parser.add_argument("--namings", type=int, default=1, help="repeat over this many tenant namings (ring draws)")
    parser.add_argument("--variant", action="append", default=[], help="run only this variant (repeatable)")
    args = parser.parse_args(argv)
    wanted = args.variant or list(VARIANTS)
    unknown = sorted(set(wanted) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {'; '.join(VARIANTS)}")
    namings = [""] + [f"n{index}-" for index in range(1, args.namings)]
    trace = make_trace(args.rate, args.seconds)
    distinct = len({a.tenant for a in trace})
    print(
        f"trace: {len(trace)} requests over {args.seconds:.0f} s, {distinct} distinct adapters (Zipf), "
        f"{REPLICAS} replicas x {MAX_LORAS} GPU / {MAX_CPU_LORAS} host adapter slots, gateway max_adapters "
        f"{MAX_CPU_LORAS}" + (f", {len(namings)} tenant namings" if len(namings) > 1 else "")
    )
    print(
        f"{'routing':22} {'cold loads':>10} {'engine evict':>12} {'gw unloads':>10} {'TTFT p50':>9} {'p99':>8}"
        f" {'req/s':>6} {'failed':>6}"
    )
    cold: dict[str, list[int]] = {name: [] for name in wanted}
    for naming in namings:
        tenants = named_tenants(naming)
        # The same arrivals, renamed: only where the ring puts each tenant changes.
        renamed = [Arrival(a.offset_s, naming + a.tenant) for a in trace]
        for name in wanted:
            row = run_variant(renamed, tenants, **VARIANTS[name])
            cold[name].append(row["cold"])
            label = f"{naming}{name}" if len(namings) > 1 else name
            print(
                f"{label:22} {row['cold']:10d} {row['engine_evictions']:12d} {row['gateway_unloads']:10d} "
                f"{row['p50']:7.1f}ms {row['p99']:6.1f}ms {row['rps']:6.1f} {row['failures']:6d}",
                flush=True,
            )
    if len(namings) > 1:
        print("cold loads over the namings:")
        for name, loads in cold.items():
            print(f"  {name:22} mean {statistics.mean(loads):6.1f}  min {min(loads):4d}  max {max(loads):4d}  {loads}")
    print(f"compulsory minimum of cold loads: {distinct} (each adapter read from disk once)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
