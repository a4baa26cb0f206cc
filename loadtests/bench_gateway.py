"""The gateway's added latency and its throughput: the same requests to a replica directly and through it.

One simulated replica at zero simulated delay (`--time-scale 0`), so what is measured is HTTP, the gateway and
the client. Each phase sends the same number of non-streaming completions at a fixed concurrency from one
aiohttp client, then prints p50/p99 latency and requests/s. On a 2-core machine client, gateway and replica
share the cores, so compare the two lines, not the absolute figures.

    python -m loadtests.bench_gateway [--requests 3000] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from loadtests.fleet import api_key, fleet_with_gateway

TENANTS = {"bench": ["bench-lora"]}


async def _phase(url: str, headers: dict[str, str], requests: int, concurrency: int) -> tuple[list[float], float]:
    latencies: list[float] = []
    body = {"model": "bench-lora", "prompt": "how fast is the gateway", "max_tokens": 4}
    remaining = iter(range(requests))
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar()) as session:

        async def worker() -> None:
            for _ in remaining:
                started = time.perf_counter()
                async with session.post(url + "/v1/completions", json=body, headers=headers) as response:
                    await response.read()
                    response.raise_for_status()
                latencies.append(time.perf_counter() - started)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return sorted(latencies), time.perf_counter() - started


def _line(label: str, latencies: list[float], elapsed: float) -> tuple[float, float]:
    p50 = 1000 * statistics.median(latencies)
    p99 = 1000 * latencies[int(0.99 * (len(latencies) - 1))]
    print(f"{label:16} p50={p50:6.2f} ms  p99={p99:6.2f} ms  {len(latencies) / elapsed:7.0f} requests/s")
    return p50, p99


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory() as tmp,
        fleet_with_gateway(Path(tmp), TENANTS, 1, ["--time-scale", "0"]) as fleet,
    ):
        replica = next(iter(fleet.replica_urls.values()))
        gateway_headers = {"Authorization": f"Bearer {api_key('bench')}"}
        # Warm-up through the gateway: it loads the adapter on the replica and opens its connections.
        asyncio.run(_phase(fleet.gateway_url, gateway_headers, 200, args.concurrency))
        asyncio.run(_phase(replica, {}, 200, args.concurrency))
        print(f"{args.requests} non-streaming completions, concurrency {args.concurrency}, replica at time-scale 0")
        direct = _line("direct", *asyncio.run(_phase(replica, {}, args.requests, args.concurrency)))
        cpu_before = fleet.gateway_cpu_s()
        through = asyncio.run(_phase(fleet.gateway_url, gateway_headers, args.requests, args.concurrency))
        cpu_per_request_us = 1e6 * (fleet.gateway_cpu_s() - cpu_before) / args.requests
        gateway = _line("through gateway", *through)
        print(f"{'added':16} p50={gateway[0] - direct[0]:6.2f} ms  p99={gateway[1] - direct[1]:6.2f} ms")
        print(f"gateway CPU per request: {cpu_per_request_us:.0f} us (user + system, from /proc)")


if __name__ == "__main__":
    main()
