"""How many requests per second one simulated replica sustains on this machine.

Later benchmarks put a gateway between clients and simulated replicas; this tells them at what load the fleet
itself, not the gateway, becomes the bottleneck. It starts `tenantgate sim` as its own process (as a replica
runs), drives it with 64 concurrent streaming clients for a fixed time, and prints the figures.

    python -m loadtests.bench_sim [--seconds 10] [--streams 64] [--time-scale 0.01]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from loadtests.processes import free_port, running, sim_command

ADAPTERS = ("b1", "b2", "b3", "b4")


def _write_adapters(root: Path) -> list[str]:
    modules = []
    for name in ADAPTERS:
        directory = root / name
        directory.mkdir()
        (directory / "adapter_config.json").write_text('{"r": 8}')
        modules.append(f"{name}={directory}")
    return modules


async def _client(
    session: aiohttp.ClientSession, url: str, worker: int, deadline: float, latencies: list[float]
) -> int:
    tokens = 0
    sent = 0
    while time.monotonic() < deadline:
        body = {
            "model": ADAPTERS[(worker + sent) % len(ADAPTERS)],
            "prompt": f"worker {worker} request {sent} asks a short question",
            "max_tokens": 16,
            "stream": True,
        }
        started = time.monotonic()
        async with session.post(url + "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.content:
                tokens += line.startswith(b"data: {")
        latencies.append(time.monotonic() - started)
        sent += 1
    return tokens


async def _drive(url: str, streams: int, seconds: float) -> None:
    latencies: list[float] = []
    connector = aiohttp.TCPConnector(limit=streams)
    async with aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar()) as session:
        started = time.monotonic()
        deadline = started + seconds
        tokens = await asyncio.gather(*(_client(session, url, w, deadline, latencies) for w in range(streams)))
        elapsed = time.monotonic() - started
    latencies.sort()
    print(f"streams={streams} seconds={elapsed:.1f} requests={len(latencies)}")
    print(f"requests/s={len(latencies) / elapsed:.0f} tokens/s={sum(tokens) / elapsed:.0f}")
    print(
        f"latency_ms p50={1000 * statistics.median(latencies):.1f} "
        f"p99={1000 * latencies[int(0.99 * (len(latencies) - 1))]:.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--time-scale", type=float, default=0.01)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = sim_command(
            port, "--time-scale", str(args.time_scale), "--max-num-seqs", "256", "--max-loras", "4",
            "--lora-modules", *_write_adapters(Path(tmp)),
        )  # fmt: skip
        with running(cmd, url, Path(tmp) / "sim.log", start_timeout_s=30):
            print(f"simulated replica at time-scale {args.time_scale}, {len(ADAPTERS)} adapters resident")
            asyncio.run(_drive(url, args.streams, args.seconds))


if __name__ == "__main__":
    main()
