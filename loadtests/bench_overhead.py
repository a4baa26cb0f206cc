"""What a router costs, measured honestly: the same non-streaming completions sent directly to simulated replicas at
zero delay and through each router, in one run.

Two loads:
- realistic (what a user's default config meets): 32 tenants, each with its own adapter, spread over 4 replicas
  (8 adapters each), 64 concurrent clients; tenantgate with its default config (access log on, predicted_ttft),
  again with the access log off, and with ``--workers 2`` (a redis-server of its own, counted with it); a bare
  aiohttp proxy of a few lines (loadtests/bare_proxy.py: the floor this stack can reach), and the same proxy with
  the engine client tenantgate sends with (``bare-http1``: backends/http1.py) and with an asyncio protocol and
  httptools' parser in place of aiohttp's server too (``bare-fast``: the floor a server of that kind reaches);
  vllm-router (``consistent_hash`` on ``x-tenant-id``) and sglang-router (``round_robin``: it has no header hash) when
  ``make peers`` installed them. Every setup also runs at concurrency 1, for the latency it adds to one request.
- light (the previous figure): 1 tenant, 1 replica, 16 concurrent clients, tenantgate with the access log off.

For each setup and concurrency: requests/s, p50/p90/p99 latency and what it adds to the direct run's (at one client,
to that of direct requests sent in turns with the setup's, to replicas of their own: ``PAIRED_TURNS``), and CPU time
per request summed over every process of the router (a supervisor and its workers; Redis for --workers), from
/proc. The client and the replicas share the machine's cores with the router, so figures compare within a run.
With py-spy installed (make peers), tenantgate's default run (or ``--profile SETUP``'s) is profiled in an extra
phase (not the measured one, sampling only the thread holding the GIL: the CPU its Python code takes, not its
waits; a thread that holds the GIL while the kernel runs another process, as in a socket write that wakes the
replica, is sampled there too): the functions with the most samples are printed and the raw stacks written to
--out. ``--only`` runs some setups (``direct`` always runs: the others' added latency is measured against it; the light
load only when ``tenantgate`` is among them).

    python -m loadtests.bench_overhead [--requests 6000] [--requests-c1 600] [--out bench-results]
    python -m loadtests.bench_overhead --only tenantgate,tenantgate-nolog,bare-http1 --profile tenantgate
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from loadtests.bench_routing import PEERS
from loadtests.fleet import ADMIN_TOKEN, api_key, gateway_config, process_cpu_s, simulated_replicas, write_adapters
from loadtests.processes import free_port, running, stop

REPLICAS = 4
TENANTS = {f"t{i:02d}": [f"lora-t{i:02d}"] for i in range(32)}
LIGHT_TENANTS = {"bench": ["bench-lora"]}
PY_SPY = PEERS / "py-spy" / "bin" / "py-spy"
Target = tuple[str, dict[str, str], bytes]  # url, headers, body


@dataclass
class Running:
    """A router serving: where each tenant's request goes, and the processes whose CPU it costs."""

    target: Callable[[str, str], Target]  # (tenant, adapter) -> what to send
    pids: list[int] = field(default_factory=list)
    profiled: int | None = None  # the process py-spy samples: the router's own, or one of --workers' workers

    def profiled_pid(self) -> int:
        return self.profiled if self.profiled is not None else self.pids[0]


def _body(adapter: str) -> bytes:
    return json.dumps({"model": adapter, "prompt": "how fast is the gateway", "max_tokens": 4}).encode()


def tree_cpu_s(pids: list[int]) -> float:
    """CPU seconds used so far by these processes and all their descendants (a process gone since counts 0)."""
    total, seen, todo = 0.0, set(), list(pids)
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        with contextlib.suppress(OSError):
            total += process_cpu_s(pid)
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += [int(child) for child in (task / "children").read_text().split()]
    return total


async def _phase(targets: list[Target], requests: int, concurrency: int) -> tuple[list[float], float]:
    latencies: list[float] = []
    remaining = iter(range(requests))
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar()) as session:

        async def worker() -> None:
            for number in remaining:
                url, headers, body = targets[number % len(targets)]
                started = time.perf_counter()
                async with session.post(url, data=body, headers=headers) as response:
                    await response.read()
                    response.raise_for_status()
                latencies.append(time.perf_counter() - started)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return sorted(latencies), time.perf_counter() - started


@dataclass
class Result:
    setup: str
    load: str
    concurrency: int
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    cpu_us: float
    added_p50_ms: float = 0.0
    added_p99_ms: float = 0.0
    p90_ms: float = 0.0
    # At one client: the direct run's p50 and p99 from requests sent in turns with this setup's (PAIRED_TURNS), to
    # which its added latency is measured; None where the setup is measured alone (the direct run's row then).
    paired_p50_ms: float | None = None
    paired_p99_ms: float | None = None


# At one client the added latency is a fraction of a millisecond, and on a shared machine the direct run's own p50
# moves by more than that from minute to minute: each setup's requests at one client go in turns with direct ones
# (to replicas of their own, which no router trims), and its added latency is measured against those.
PAIRED_TURNS = 6


def _measure(
    name: str,
    load: str,
    running_: Running,
    tenants: dict[str, list[str]],
    requests: int,
    concurrency: int,
    paired: Running | None = None,
) -> Result:
    targets = [running_.target(tenant, adapters[0]) for tenant, adapters in tenants.items()]
    asyncio.run(_phase(targets, max(200, len(targets) * 4), concurrency))  # warm: adapters loaded, connections open
    if paired is None:
        cpu_before = tree_cpu_s(running_.pids)
        latencies, elapsed = asyncio.run(_phase(targets, requests, concurrency))
        cpu_us = 1e6 * (tree_cpu_s(running_.pids) - cpu_before) / requests if running_.pids else 0.0
        return _result(name, load, concurrency, requests / elapsed, latencies, cpu_us)
    direct_targets = [paired.target(tenant, adapters[0]) for tenant, adapters in tenants.items()]
    asyncio.run(_phase(direct_targets, max(200, len(targets) * 4), concurrency))
    turn = max(1, requests // PAIRED_TURNS)
    latencies, direct_latencies, elapsed, cpu_s = [], [], 0.0, 0.0
    for _ in range(PAIRED_TURNS):
        cpu_before = tree_cpu_s(running_.pids)
        some, took = asyncio.run(_phase(targets, turn, concurrency))
        cpu_s += tree_cpu_s(running_.pids) - cpu_before if running_.pids else 0.0
        latencies, elapsed = latencies + some, elapsed + took
        direct_latencies += asyncio.run(_phase(direct_targets, turn, concurrency))[0]
    latencies.sort()
    direct_ = _result("direct", load, concurrency, 0.0, sorted(direct_latencies), 0.0)
    result = _result(name, load, concurrency, len(latencies) / elapsed, latencies, 1e6 * cpu_s / len(latencies))
    result.paired_p50_ms, result.paired_p99_ms = direct_.p50_ms, direct_.p99_ms
    return result


def _result(name: str, load: str, concurrency: int, rate: float, latencies: list[float], cpu_us: float) -> Result:
    """From sorted latencies in seconds."""
    p50, p99 = 1000 * statistics.median(latencies), 1000 * latencies[int(0.99 * (len(latencies) - 1))]
    p90 = 1000 * latencies[int(0.9 * (len(latencies) - 1))]
    return Result(name, load, concurrency, rate, p50, p99, cpu_us, p90_ms=p90)


def _ready(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@contextlib.contextmanager
def _process(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        process = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **(env or {})}
        )
    try:
        yield process
    finally:
        stop(process)


@contextlib.contextmanager
def direct(replicas: list[str]) -> Iterator[Running]:
    order = {tenant: index for index, tenant in enumerate(sorted(TENANTS))}

    def target(tenant: str, adapter: str) -> Target:
        replica = replicas[order.get(tenant, 0) % len(replicas)]
        return replica + "/v1/completions", {"Content-Type": "application/json"}, _body(adapter)

    yield Running(target)


def _header_target(url: str) -> Callable[[str, str], Target]:
    def target(tenant: str, adapter: str) -> Target:
        headers = {"Content-Type": "application/json", "x-tenant-id": tenant}
        return url + "/v1/completions", headers, _body(adapter)

    return target


@contextlib.contextmanager
def bare_proxy(replicas: list[str], root: Path, client: str = "aiohttp", server: str = "aiohttp") -> Iterator[Running]:
    port = free_port()
    cmd = [sys.executable, "-m", "loadtests.bare_proxy", "--port", str(port), "--client", client, "--server", server]
    url = f"http://127.0.0.1:{port}"
    with running([*cmd, *replicas], url, root / f"bare-proxy-{client}-{server}.log", start_timeout_s=30) as process:
        yield Running(_header_target(url), [process.pid])


@contextlib.contextmanager
def peer(router: str, replicas: list[str], root: Path, adapters: dict[str, str]) -> Iterator[Running]:
    # Every adapter loaded again: the peers route without loading adapters, and tenantgate's runs before trim each
    # replica's set back to its max_adapters (the residency's over-bound trim), which leaves the peers' requests
    # a 404 for the adapters it unloaded.
    _preload(replicas, adapters)
    port = free_port()
    if router == "vllm-router":
        cmd = [str(PEERS / "vllm-router/bin/vllm-router"), "--policy", "consistent_hash"]
    else:
        cmd = [str(PEERS / "sglang-router/bin/python"), "-m", "sglang_router.launch_router", "--policy", "round_robin"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *replicas,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with _process(cmd, root / f"{router}.log", {"RUST_LOG": "warn"}) as process:
        target = _header_target(url)
        for _ in range(300):  # bounded: until it routes (peers find their workers asynchronously)
            try:
                asyncio.run(_phase([target("t00", "lora-t00")], 20, 1))
                break
            except Exception:
                time.sleep(0.2)
        else:
            raise RuntimeError(f"{router} never answered at {url}")
        yield Running(target, [process.pid])


@contextlib.contextmanager
def redis_server(root: Path) -> Iterator[tuple[str, int]]:
    port = free_port()
    cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    with _process(cmd, root / "redis.log") as process:
        deadline = time.monotonic() + 10
        while subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True).stdout.strip() != b"PONG":
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.1)
        yield f"redis://127.0.0.1:{port}/0", process.pid


@contextlib.contextmanager
def tenantgate(
    root: Path, name: str, config: dict[str, Any], workers: int = 1, extra_pids: list[int] | None = None
) -> Iterator[Running]:
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    url = f"http://127.0.0.1:{config['listen']['port']}"
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--workers", str(workers)]
    env = {"TENANTGATE_ADMIN_TOKEN": ADMIN_TOKEN}
    with running(cmd, url, root / f"{name}.log", env=env, start_timeout_s=60, health_path="/readyz") as process:
        time.sleep(0.5 * (workers - 1))  # the other workers' start-up (their connections queue meanwhile)

        def target(tenant: str, adapter: str) -> Target:
            headers = {"Content-Type": "application/json", "Authorization": f"Bearer {api_key(tenant)}"}
            return url + "/v1/completions", headers, _body(adapter)

        # Under --workers, the supervisor only keeps the workers running: a profile samples the first worker.
        workers_ = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split() if workers > 1 else []
        profiled = int(workers_[0]) if workers_ else None
        yield Running(target, [process.pid, *(extra_pids or [])], profiled)


def _preload(replicas: list[str], adapters: dict[str, str]) -> None:
    """Every adapter on every replica: the peers route without loading adapters (tenantgate finds them there)."""
    for replica in replicas:
        for name, path in adapters.items():
            request = urllib.request.Request(
                replica + "/v1/load_lora_adapter", json.dumps({"lora_name": name, "lora_path": path}).encode(),
                {"Content-Type": "application/json"},
            )  # fmt: skip
            with contextlib.suppress(urllib.error.HTTPError):  # already loaded
                urllib.request.urlopen(request, timeout=10).close()


def _profile(running_: Running, tenants: dict[str, list[str]], requests: int, out: Path) -> list[str]:
    """py-spy over one more phase of tenantgate's default run: the raw stacks to ``out``, the top functions."""
    raw = out / "overhead-profile.txt"
    duration_s = 8
    spy = subprocess.Popen(
        [str(PY_SPY), "record", "--pid", str(running_.profiled_pid()), "--format", "raw", "--output", str(raw),
         "--duration", str(duration_s), "--rate", "250", "--nonblocking", "--gil"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    targets = [running_.target(tenant, adapters[0]) for tenant, adapters in tenants.items()]
    deadline = time.monotonic() + duration_s
    while time.monotonic() < deadline and spy.poll() is None:
        asyncio.run(_phase(targets, requests // 4, 64))
    spy.wait(timeout=60)
    return _top_functions(raw)


def _top_functions(raw: Path, count: int = 25) -> list[str]:
    """From py-spy's collapsed stacks: each function's share of samples as the innermost frame (self) and on the
    stack (total)."""
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    samples = 0
    for line in raw.read_text().splitlines():
        stack, _, number = line.rpartition(" ")
        frames = [frame.split(" (")[0] + " (" + frame.split(" (")[-1] for frame in stack.split(";")]
        weight = int(number)
        samples += weight
        own[frames[-1]] += weight
        for frame in set(frames):
            total[frame] += weight
    lines = [f"{samples} samples; self% total% function (file:line)"]
    for frame, weight in own.most_common(count):
        lines.append(f"{100 * weight / samples:5.1f} {100 * total[frame] / samples:5.1f}  {frame}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=6000, help="per setup at concurrency 64 (16 for light)")
    parser.add_argument("--requests-c1", type=int, default=600, help="per setup at concurrency 1")
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--only", help="comma-separated setup names (default: all), e.g. tenantgate,bare-http1")
    parser.add_argument("--profile", default="tenantgate", help="the setup py-spy profiles (default: tenantgate)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    only = set(args.only.split(",")) if args.only else None
    results: list[Result] = []
    profile: list[str] = []
    sim = ("--time-scale", "0", "--max-loras", "8", "--max-cpu-loras", "64")
    with (
        tempfile.TemporaryDirectory() as tmp,
        simulated_replicas(Path(tmp), REPLICAS, *sim) as replica_urls,
        tempfile.TemporaryDirectory() as paired_tmp,
        simulated_replicas(Path(paired_tmp), REPLICAS, *sim) as paired_urls,
    ):
        root = Path(tmp)
        adapters = write_adapters(root, [a for names in {**TENANTS, **LIGHT_TENANTS}.values() for a in names])
        replicas = [replica_urls[f"r{i}"] for i in range(REPLICAS)]
        _preload(replicas, adapters)
        # The direct requests sent in turns with each setup's at one client: replicas of their own (every adapter
        # on each, and no router to unload one), idle the rest of the time.
        paired_replicas = [paired_urls[f"r{i}"] for i in range(REPLICAS)]
        _preload(paired_replicas, adapters)
        realistic = {name: adapters[name] for names in TENANTS.values() for name in names}
        telemetry_off = {"telemetry": {"access_log": False}}

        def config(extra: dict[str, Any] | None = None) -> dict[str, Any]:
            return gateway_config(
                replica_urls, TENANTS, realistic, port=free_port(), max_adapters=8, extra=extra
            )  # fmt: skip

        setups: list[tuple[str, Callable[[], contextlib.AbstractContextManager[Running]]]] = [
            ("direct", lambda: direct(replicas)),
            ("bare-aiohttp", lambda: bare_proxy(replicas, root)),
            ("bare-http1", lambda: bare_proxy(replicas, root, "http1")),
            ("bare-fast", lambda: bare_proxy(replicas, root, "http1", "fast")),
            ("tenantgate", lambda: tenantgate(root, "tenantgate", config())),
            ("tenantgate-nolog", lambda: tenantgate(root, "tenantgate-nolog", config(telemetry_off))),
            ("tenantgate-w2", lambda: _with_redis(root, config)),
        ]
        for router in ("vllm-router", "sglang-router"):
            if (PEERS / router / "bin").exists():
                setups.append((router, lambda router=router: peer(router, replicas, root, adapters)))  # type: ignore[misc]
            else:
                print(f"{router}: not installed (make peers)")
        for name, start in setups:
            if only and name not in only and name != "direct":
                continue
            with start() as serving, direct(paired_replicas) as paired:
                for concurrency, requests in ((64, args.requests), (1, args.requests_c1)):
                    in_turns = paired if concurrency == 1 and name != "direct" else None
                    results.append(_measure(name, "realistic", serving, TENANTS, requests, concurrency, in_turns))
                    print(_row(results[-1]), flush=True)
                if name == args.profile and PY_SPY.exists():
                    profile = _profile(serving, TENANTS, args.requests, args.out)
        # The light adapter loaded again: a realistic run may have unloaded it (its replica trimmed back to
        # max_adapters), and the light load's direct requests go first.
        _preload(replicas[:1], {"bench-lora": adapters["bench-lora"]})
        light = gateway_config(
            {"r0": replicas[0]}, LIGHT_TENANTS, {"bench-lora": adapters["bench-lora"]}, port=free_port(),
            extra=telemetry_off,
        )  # fmt: skip
        for name, start in (
            ("direct", lambda: direct(replicas[:1])),
            ("tenantgate", lambda: tenantgate(root, "tenantgate-light", light)),
        ):
            if only and "tenantgate" not in only:
                break  # the light load only with its tenantgate
            with start() as serving:
                results.append(_measure(name, "light", serving, LIGHT_TENANTS, args.requests // 2, 16))
                print(_row(results[-1]), flush=True)
    _added(results)
    print()
    print(f"{'setup':18} {'load':9} {'conc':>4} {'req/s':>7} {'p50 ms':>7} {'p90 ms':>7} {'p99 ms':>7} {'+p50 ms':>7} "
          f"{'+p99 ms':>7} {'CPU us/req':>10} {'direct p50':>9}")  # fmt: skip
    print(
        "(+p50/+p99 at 1 client: against direct requests sent in turns with the setup's, whose p50 is the last column)"
    )
    for result in results:
        print(_row(result))
    if profile:
        print(f"\n{args.profile} (realistic load) under py-spy, by own samples:")
        print("\n".join(profile))
    elif not PY_SPY.exists():
        print("\npy-spy: not installed (make peers): no profile")
    (args.out / "overhead.json").write_text(json.dumps([vars(r) for r in results], indent=1))
    return 0


@contextlib.contextmanager
def _with_redis(root: Path, config: Callable[[dict[str, Any] | None], dict[str, Any]]) -> Iterator[Running]:
    with (
        redis_server(root) as (url, pid),
        tenantgate(root, "tenantgate-w2", config({"state": {"redis_url": url}}), 2, [pid]) as serving,
    ):
        yield serving


def _added(results: list[Result]) -> None:
    """Against the direct requests sent in turns with the setup's where there are some, else the direct run's."""
    base = {(r.load, r.concurrency): r for r in results if r.setup == "direct"}
    for result in results:
        if result.paired_p50_ms is not None and result.paired_p99_ms is not None:
            result.added_p50_ms = result.p50_ms - result.paired_p50_ms
            result.added_p99_ms = result.p99_ms - result.paired_p99_ms
        elif (direct_ := base.get((result.load, result.concurrency))) is not None:
            result.added_p50_ms = result.p50_ms - direct_.p50_ms
            result.added_p99_ms = result.p99_ms - direct_.p99_ms


def _row(r: Result) -> str:
    paired = f"{r.paired_p50_ms:9.2f}" if r.paired_p50_ms is not None else f"{'':9}"
    return (
        f"{r.setup:18} {r.load:9} {r.concurrency:4d} {r.requests_per_s:7.0f} {r.p50_ms:7.2f} {r.p90_ms:7.2f} "
        f"{r.p99_ms:7.2f} {r.added_p50_ms:7.2f} {r.added_p99_ms:7.2f} {r.cpu_us:10.0f} {paired}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
