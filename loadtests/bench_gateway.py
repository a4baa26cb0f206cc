"""The gateway's added latency and its throughput: the same requests to a replica directly and through it.

One simulated replica at zero simulated delay (`--time-scale 0`), so what is measured is HTTP, the gateway and
the client. Each phase sends the same number of non-streaming completions at a fixed concurrency from one
aiohttp client, then prints p50/p99 latency and requests/s; the gateway runs twice, with tracing and the access
log off and on, and its CPU time per request is read from /proc. On a 2-core machine client, gateway and replica
share the cores, so compare the two lines, not the absolute figures.

    python -m loadtests.bench_gateway [--requests 3000] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

from loadtests.fleet import (
    api_key,
    gateway_config,
    gateway_process,
    process_cpu_s,
    simulated_replicas,
    simulated_triton_replicas,
    triton_pool,
    write_adapters,
)
from loadtests.peft_files import write_peft_adapter
from loadtests.processes import free_port

TENANTS = {"bench": ["bench-lora"]}


async def _phase(
    url: str, headers: dict[str, str], requests: int, concurrency: int, stream: bool = False
) -> tuple[list[float], float]:
    latencies: list[float] = []
    body = {"model": "bench-lora", "prompt": "how fast is the gateway", "max_tokens": 4, "stream": stream}
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


TELEMETRY = {
    "telemetry off": {"tracing": {"exporter": "none"}, "access_log": False},
    "telemetry on": {"tracing": {"exporter": "console"}, "access_log": True},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    print(f"{args.requests} non-streaming completions, concurrency {args.concurrency}, replica at time-scale 0")
    print(
        "metrics are always on; 'telemetry on' adds a span tree per request (console exporter) and the JSON access log"
    )
    with tempfile.TemporaryDirectory() as tmp, simulated_replicas(Path(tmp), 1, "--time-scale", "0") as replicas:
        replica = replicas["r0"]
        adapters = write_adapters(Path(tmp), ["bench-lora"])
        load = {"lora_name": "bench-lora", "lora_path": adapters["bench-lora"]}
        urllib.request.urlopen(urllib.request.Request(  # the gateways find it loaded: "already loaded" is fine
            replica + "/v1/load_lora_adapter", json.dumps(load).encode(), {"Content-Type": "application/json"}
        ), timeout=10).close()  # fmt: skip
        asyncio.run(_phase(replica, {}, 200, args.concurrency))
        direct = _line("direct", *asyncio.run(_phase(replica, {}, args.requests, args.concurrency)))
        headers = {"Authorization": f"Bearer {api_key('bench')}"}
        for label, telemetry in TELEMETRY.items():
            config = gateway_config(replicas, TENANTS, adapters, port=free_port(), extra={"telemetry": telemetry})
            with gateway_process(Path(tmp), config, label.replace(" ", "-")) as (gateway_url, pid):
                # Warm-up: the gateway loads the adapter on the replica and opens its connections.
                asyncio.run(_phase(gateway_url, headers, 200, args.concurrency))
                cpu_before = process_cpu_s(pid)
                through = asyncio.run(_phase(gateway_url, headers, args.requests, args.concurrency))
                cpu_per_request_us = 1e6 * (process_cpu_s(pid) - cpu_before) / args.requests
            gateway = _line(label, *through)
            print(
                f"{'':16} added p50={gateway[0] - direct[0]:5.2f} ms  p99={gateway[1] - direct[1]:5.2f} ms  "
                f"gateway CPU per request: {cpu_per_request_us:.0f} us (user + system, from /proc)"
            )
        _triton_pool(Path(tmp), args.requests, args.concurrency)


def _triton_pool(root: Path, requests: int, concurrency: int) -> None:
    """The same requests through a Triton pool (OpenAI translation, LoRA by task id), then the same streamed: the
    driver sends non-streaming requests over gRPC and streaming ones over HTTP (backends/triton_http.py)."""
    model = "tensorrt_llm_bls"
    adapter = str(write_peft_adapter(root / "triton-adapter", 8))
    with simulated_triton_replicas(root, 1, model, "--time-scale", "0") as replicas:
        config = gateway_config({}, TENANTS, {}, port=free_port(), extra={"telemetry": TELEMETRY["telemetry off"]})
        config["pools"] = [triton_pool(replicas, model, "tiny-llama")]
        config["adapters"] = [{"name": "bench-lora", "pool": "trt", "source": adapter}]
        headers = {"Authorization": f"Bearer {api_key('bench')}"}
        with gateway_process(root, config, "triton") as (gateway_url, pid):
            for label, stream in (("triton pool", False), ("triton streamed", True)):
                asyncio.run(_phase(gateway_url, headers, 200, concurrency, stream))
                cpu_before = process_cpu_s(pid)
                through = asyncio.run(_phase(gateway_url, headers, requests, concurrency, stream))
                cpu_per_request_us = 1e6 * (process_cpu_s(pid) - cpu_before) / requests
                _line(label, *through)
                print(f"{'':16} gateway CPU per request: {cpu_per_request_us:.0f} us (telemetry off)")
        print(f"{'':16} (no direct line: the gateway translates OpenAI to Triton's protocol, so there is no")
        print(f"{'':16} like-for-like direct request)")


if __name__ == "__main__":
    main()
