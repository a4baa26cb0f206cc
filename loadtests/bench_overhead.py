"""What a router costs: the same non-streaming requests to one simulated replica at zero delay, directly and
through tenantgate (metrics on; and again with tracing to the console exporter and the access log), vllm-router and
sglang-router (when `make peers` installed them). Prints requests/s, added latency p50/p99 and each router
process's CPU time per request (from /proc). tenantgate runs one process (it has no multi-worker mode yet).

    python -m loadtests.bench_overhead [--requests 3000] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from loadtests.bench_gateway import _line, _phase
from loadtests.bench_routing import PEERS
from loadtests.fleet import api_key, gateway_config, gateway_process, process_cpu_s, simulated_replicas, write_adapters
from loadtests.processes import free_port

TENANTS = {"bench": ["bench-lora"]}


@contextlib.contextmanager
def peer(router: str, replica: str, root: Path) -> Iterator[tuple[str, int]]:
    port = free_port()
    if router == "vllm-router":
        cmd = [str(PEERS / "vllm-router/bin/vllm-router"), "--policy", "consistent_hash"]
    else:
        cmd = [str(PEERS / "sglang-router/bin/python"), "-m", "sglang_router.launch_router", "--policy", "round_robin"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", replica,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]  # fmt: skip
    with (root / f"{router}.log").open("wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "RUST_LOG": "warn"})  # fmt: skip
    try:
        yield f"http://127.0.0.1:{port}", process.pid
    finally:
        process.terminate()
        process.wait(timeout=15)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args(argv)
    print(f"{args.requests} non-streaming completions, concurrency {args.concurrency}, one replica at time-scale 0")
    with tempfile.TemporaryDirectory() as tmp, simulated_replicas(Path(tmp), 1, "--time-scale", "0") as replicas:
        root, replica = Path(tmp), replicas["r0"]
        adapters = write_adapters(root, ["bench-lora"])
        load = {"lora_name": "bench-lora", "lora_path": adapters["bench-lora"]}
        urllib.request.urlopen(urllib.request.Request(
            replica + "/v1/load_lora_adapter", json.dumps(load).encode(), {"Content-Type": "application/json"}
        ), timeout=10).close()  # fmt: skip
        asyncio.run(_phase(replica, {}, 200, args.concurrency))
        direct = _line("direct", *asyncio.run(_phase(replica, {}, args.requests, args.concurrency)))
        key = {"Authorization": f"Bearer {api_key('bench')}"}
        setups: list[tuple[str, contextlib.AbstractContextManager[tuple[str, int]], dict[str, str]]] = []
        for label, telemetry in (
            ("tenantgate", {"tracing": {"exporter": "none"}, "access_log": False}),
            ("tenantgate+trace", {"tracing": {"exporter": "console"}, "access_log": True}),
        ):
            config = gateway_config(replicas, TENANTS, adapters, port=free_port(), extra={"telemetry": telemetry})
            setups.append((label, gateway_process(root, config, label.replace("+", "-")), key))
        for router in ("vllm-router", "sglang-router"):
            if (PEERS / router / "bin").exists():
                setups.append((router, peer(router, replica, root), {"x-tenant-id": "bench"}))
            else:
                print(f"{router}: not installed (make peers)")
        for name, starting, headers in setups:
            with starting as (url, pid):
                for _ in range(100):  # bounded: until it routes (peers start asynchronously)
                    try:
                        asyncio.run(_phase(url, headers, 200, args.concurrency))
                        break
                    except Exception:
                        time.sleep(0.1)
                else:
                    raise RuntimeError(f"{name} never answered at {url}")
                cpu_before = process_cpu_s(pid)
                through = asyncio.run(_phase(url, headers, args.requests, args.concurrency))
                cpu_us = 1e6 * (process_cpu_s(pid) - cpu_before) / args.requests
            p50, p99 = _line(name, *through)
            print(
                f"{'':16} added p50={p50 - direct[0]:5.2f} ms  p99={p99 - direct[1]:5.2f} ms"
                f"  CPU per request {cpu_us:.0f} us"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
