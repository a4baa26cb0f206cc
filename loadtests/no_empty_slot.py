"""No empty slot, measured: 16 tenants on 4 simulated vLLM replicas of 4 adapter slots at a GPU-like time scale,
the gateway ready and idle for 10 s, then 10 streamed requests per tenant (all tenants at once). Prints the loads
made before traffic, the cold loads on the request path (the replicas' own counters) and TTFT p50/p99, as the
README quotes them, once per repeat (the machine's load moves the tail: read the spread). The clients are set up
(and have spoken to the gateway once) before any request is timed. The defaults are the gateway's own (the fill and
its warm-up on, the default routing policy). Then the same traffic goes straight to the replicas that hold each
adapter, no router between: on a shared 2-core machine the client's and engines' own tail moves with the load, and
that run says how much of the tail through the gateway was there without it.

    python -m loadtests.no_empty_slot --repeats 3
    python -m loadtests.no_empty_slot --warm-up off --gpu-slots 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import openai

from loadtests.collector import collector_held
from loadtests.fleet import api_key, fleet_with_gateway, sim_stats

TENANTS = {f"t{i:02d}": [f"adapter-t{i:02d}"] for i in range(16)}


async def traffic(base_urls: dict[str, str], api_keys: dict[str, str], requests: int) -> list[float]:
    """Each tenant's ``requests`` streamed requests to its base URL, every tenant at once; their TTFTs, timed with
    this process's garbage collector held off (``collector_held``)."""
    clients = {}
    for name in TENANTS:
        clients[name] = openai.AsyncOpenAI(base_url=base_urls[name] + "/v1", api_key=api_keys[name], max_retries=0)
        await clients[name].models.list()  # the client's own set-up, outside the timings
    ttfts: list[float] = []

    async def tenant(name: str) -> None:
        for i in range(requests):
            started = time.perf_counter()
            stream = await clients[name].completions.create(
                model=f"adapter-{name}", prompt=f"q{i}", max_tokens=8, stream=True
            )
            async for _ in stream:
                ttfts.append(time.perf_counter() - started)
                break
            async for _ in stream:
                pass
            await asyncio.sleep(0.2)

    try:
        with collector_held():
            await asyncio.gather(*(tenant(name) for name in TENANTS))
    finally:
        await asyncio.gather(*(client.close() for client in clients.values()))
    return ttfts


def holders(replica_urls: dict[str, str]) -> dict[str, str]:
    """Per tenant, the URL of a replica its adapter is registered on (the engines' own /v1/models)."""
    where = {}
    for url in replica_urls.values():
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as response:
            for model in json.load(response)["data"]:
                for tenant, adapters in TENANTS.items():
                    if model["id"] in adapters:
                        where[tenant] = url
    return where


@dataclass(frozen=True)
class Run:
    loads_before: int
    cold_loads: int
    ttfts: list[float]
    direct_ttfts: list[float]  # the same traffic straight to the engines afterwards: no router, adapters resident

    @staticmethod
    def figures(ttfts: list[float]) -> tuple[float, float]:
        return statistics.median(ttfts), statistics.quantiles(ttfts, n=100)[98]


def measure(fill: bool, warm_up: bool, gpu_slots: int, policy: str, idle_s: float, requests: int) -> Run:
    sim = ["--time-scale", "1.0", "--max-loras", str(gpu_slots), "--max-cpu-loras", "4"]
    extra = {"residency": {"fill_free_slots": fill, "fill_warm_up": warm_up}}
    with (
        tempfile.TemporaryDirectory() as root,
        fleet_with_gateway(Path(root), TENANTS, 4, sim, max_adapters=4, extra=extra, policy=policy) as fleet,
    ):
        time.sleep(idle_s)
        ready = {r: sim_stats(url)["cold_loads"] for r, url in fleet.replica_urls.items()}
        keys = {name: api_key(name) for name in TENANTS}
        ttfts = asyncio.run(traffic(dict.fromkeys(TENANTS, fleet.gateway_url), keys, requests))
        after = {r: sim_stats(url)["cold_loads"] for r, url in fleet.replica_urls.items()}
        # The floor the engines and this client reach on this machine now: the tail that is not the router's.
        direct = asyncio.run(traffic(holders(fleet.replica_urls), dict.fromkeys(TENANTS, "none"), requests))
    return Run(sum(ready.values()), sum(after[r] - ready[r] for r in after), ttfts, direct)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fill", choices=["on", "off"], default="on")
    parser.add_argument("--warm-up", choices=["on", "off"], default="on")
    parser.add_argument("--gpu-slots", type=int, default=4)
    parser.add_argument("--policy", default="predicted_ttft")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--idle-s", type=float, default=10.0)
    parser.add_argument("--requests", type=int, default=10)
    args = parser.parse_args()
    ratios: list[float] = []
    direct_ratios: list[float] = []
    for _ in range(args.repeats):
        run = measure(args.fill == "on", args.warm_up == "on", args.gpu_slots, args.policy, args.idle_s, args.requests)
        p50, p99 = Run.figures(run.ttfts)
        direct_p50, direct_p99 = Run.figures(run.direct_ttfts)
        print(
            f"fill={args.fill} warm_up={args.warm_up} gpu_slots={args.gpu_slots} policy={args.policy}: loads before "
            f"traffic {run.loads_before}, cold loads on the request path {run.cold_loads}, TTFT p50 {1000 * p50:.0f} "
            f"ms, p99 {1000 * p99:.0f} ms ({p99 / p50:.2f}x the p50) over {len(run.ttfts)} requests; straight to the "
            f"engines after it {1000 * direct_p50:.0f} / {1000 * direct_p99:.0f} ms ({direct_p99 / direct_p50:.2f}x)",
            flush=True,
        )
        ratios.append(p99 / p50)
        direct_ratios.append(direct_p99 / direct_p50)
    if len(ratios) > 1:
        # As make bench aggregates its seeds: the mean over the runs, and the worst run beside it.
        print(
            f"TTFT p99 / p50 over {len(ratios)} runs: through the gateway mean {statistics.mean(ratios):.2f}x, worst "
            f"{max(ratios):.2f}x; straight to the engines mean {statistics.mean(direct_ratios):.2f}x, worst "
            f"{max(direct_ratios):.2f}x"
        )


if __name__ == "__main__":
    main()
