"""Instructions per request, noise-free: each setup's server process runs under valgrind's callgrind with
instrumentation off, and on only while one client sends it ``--requests`` non-streaming completions (after a
warm-up), one at a time on one kept-alive connection, to one simulated replica at zero delay. What CPU time per
request cannot give on this shared 2-core machine (make bench-overhead's figures move by 10% and more run to run),
instruction counts give to a few thousand: the way to compare a change to the request path, or a server of another
kind, before spending benchmark time on it. The count includes whatever the process did meanwhile, on every thread
(its timers, probes and scrapes run at wall-clock intervals, and callgrind runs the process about 50x slower, so
they weigh more than at full speed; the access log's writer thread); user-space instructions only, not the
kernel's system calls, and one client, not the realistic load.

Setups: the bare proxy on aiohttp's server with tenantgate's engine client (``bare-http1``), the same proxy on an
asyncio protocol with httptools (``bare-fast``), and tenantgate with one tenant on that one replica, access log off
(``tenantgate-nolog``) and on (``tenantgate``).

With ``--realistic`` the load is bench_overhead's realistic one in shape: 32 tenants with an adapter each over 4
simulated replicas (8 adapters a replica), tenantgate with its default config (the access log on; ``-nolog`` off),
the requests cycling through the tenants, and the gateway's probes and scrapes slowed (``QUIET_CLOCK``). It counts
what the default costs per request where users run it, which the light config's one tenant and one replica do not
(one candidate, one label series, no adapter to look up among many). Concurrency stays low: under callgrind the
server runs about 50x slower, so 64 clients would only queue. One client by default (``--clients``): with several,
how many requests one turn of the event loop finds ready depends on the threads' timing, which moves the count
by tens of thousands of instructions from run to run; with one it holds to a few thousand.

With ``--idle`` each setup also runs, after its requests, an idle window as long as they took: the process's
clock-driven work (tenantgate's is about 60 k instructions per request's worth of wall time, under callgrind), which
at full speed is spread over about 50x more requests. The count net of it is what the requests themselves cost,
and what a change to the request path moves; the window's own count moves with the machine's load.

    python -m loadtests.bench_instructions [--requests 300] [--only bare-http1,bare-fast] [--idle]
    python -m loadtests.bench_instructions --realistic [--clients 4] [--only tenantgate,tenantgate-nolog] [--idle]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from loadtests.bench_overhead import REPLICAS, TENANTS, _body, _preload
from loadtests.fleet import ADMIN_TOKEN, api_key, gateway_config, simulated_replicas, write_adapters
from loadtests.processes import free_port, running

SETUPS = ("bare-http1", "bare-fast", "tenantgate-nolog", "tenantgate")
ADAPTER = "bench-lora"
WARM_UP = 30


@dataclass(frozen=True)
class Load:
    """What the measured requests meet: the replicas, the tenants (each with its adapters), each replica's adapter
    slots, and how many clients send at once (each on a kept-alive connection of its own)."""

    replicas: dict[str, str]
    tenants: dict[str, list[str]]
    adapters: dict[str, str]
    max_adapters: int = 2
    clients: int = 1
    # The gateway's clock-driven work slowed (``QUIET_CLOCK``): its probes and scrapes, which callgrind's slowdown
    # makes weigh about 50x what they do per request at full speed, out of the count, the request path unchanged.
    quiet_clock: bool = False


# Probes every 30 s instead of 0.5, the engines' load scraped every 60 s instead of 0.5 (predicted_ttft reads it:
# a scrape stays fresh for three intervals, so every decision still sees a fresh one), their metrics every 60 s
# instead of 5 (stalls judged over 120 s, as the config asks: longer than a scrape's interval); the residency's
# flushes, syncs, reconciliations and eviction timer, the traffic's folds and the homes' placement once an hour or
# so. Each ran at its wall-clock interval in the measured window, which callgrind's slowdown stretches about 50x:
# the eviction timer alone (every 30 s, each replica brought to max_adapters - headroom, so the next request of an
# adapter it unloaded loads it again) moved a run's count by tens of thousands of instructions a request. The
# request path reads what these leave (verdicts, figures, the record), not how often they run.
QUIET_CLOCK: dict[str, dict[str, float]] = {
    "residency": {"use_flush_interval_s": 60, "sync_interval_s": 600, "reconcile_interval_s": 3600,
                  "evict_interval_s": 3600},
    "traffic": {"interval_s": 600, "window_s": 600},
    "placement": {"interval_s": 3600},
}  # fmt: skip
HEALTH_INTERVAL_S, SCRAPE_INTERVAL_S, STALL_AFTER_S = 30.0, 60.0, 120.0


def light(replica: str, adapters: dict[str, str]) -> Load:
    """One tenant with one adapter on one replica, one client: the light config."""
    return Load({"r0": replica}, {"acme": [ADAPTER]}, adapters)


def callgrind_available() -> bool:
    return shutil.which("valgrind") is not None and shutil.which("callgrind_control") is not None


def total_instructions(out: Path) -> int:
    """The instructions counted in ``out``'s dumps: the last ``totals:`` line of each part file."""
    total = 0
    for part in sorted(out.parent.glob(out.name + "*")):
        totals = [line for line in part.read_text().splitlines() if line.startswith("totals:")]
        if totals:
            total += int(totals[-1].split()[1])
    return total


def _command(setup: str, load: Load, port: int, root: Path) -> tuple[list[str], str]:
    """The setup's server command and its health path."""
    if setup.startswith("bare-"):
        server = "fast" if setup == "bare-fast" else "aiohttp"
        cmd = ["-m", "loadtests.bare_proxy", "--port", str(port), "--client", "http1", "--server", server]
        return [*cmd, *load.replicas.values()], "/health"
    extra: dict[str, Any] = {"telemetry": {"access_log": setup == "tenantgate"}}
    names = {name for adapters in load.tenants.values() for name in adapters}
    adapters = {name: path for name, path in load.adapters.items() if name in names}
    config = gateway_config(
        load.replicas, load.tenants, adapters, port=port, max_adapters=load.max_adapters, extra=extra
    )  # fmt: skip
    if load.quiet_clock:
        config["telemetry"]["engine_scrape_interval_s"] = SCRAPE_INTERVAL_S
        config["routing"]["load_scrape_interval_s"] = SCRAPE_INTERVAL_S
        for pool in config["pools"]:
            pool["health"]["interval_s"] = HEALTH_INTERVAL_S
            pool.setdefault("outlier", {})["stall_after_s"] = STALL_AFTER_S
        for section, values in QUIET_CLOCK.items():
            config.setdefault(section, {}).update(values)
    path = root / f"{setup}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return ["-m", "gateway.cli", "serve", "--config", str(path)], "/readyz"


Request = tuple[dict[str, str], bytes]  # headers, body


def _requests(setup: str, load: Load) -> list[Request]:
    """One request per tenant (its first adapter), as the benchmarks' clients send them."""
    requests = []
    for tenant, adapters in load.tenants.items():
        headers = {"Content-Type": "application/json"}
        if setup.startswith("bare-"):
            headers["x-tenant-id"] = tenant
        else:
            headers["Authorization"] = f"Bearer {api_key(tenant)}"
        requests.append((headers, _body(adapters[0])))
    return requests


def _send(connections: list[http.client.HTTPConnection], requests: list[Request], count: int) -> None:
    """``count`` completions over the clients' kept-alive connections, each client sending one at a time, the
    requests cycling through ``requests`` (the tenants)."""
    numbers = iter(range(count))
    lock = threading.Lock()
    failures: list[str] = []

    def client(connection: http.client.HTTPConnection) -> None:
        while not failures:
            with lock:
                number = next(numbers, None)
            if number is None:
                return
            headers, body = requests[number % len(requests)]
            connection.request("POST", "/v1/completions", body, headers)
            answer = connection.getresponse()
            answer.read()
            if answer.status != 200:
                failures.append(f"the setup answered {answer.status}")

    if len(connections) == 1:
        client(connections[0])
    else:
        threads = [threading.Thread(target=client, args=(connection,)) for connection in connections]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if failures:
        raise RuntimeError(failures[0])


@contextlib.contextmanager
def _under_callgrind(cmd: list[str], url: str, health: str, out: Path, log: Path) -> Iterator[int]:
    valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]
    env = {"TENANTGATE_ADMIN_TOKEN": ADMIN_TOKEN}
    with running([*valgrind, sys.executable, *cmd], url, log, env=env, start_timeout_s=900, health_path=health) as p:
        yield p.pid
        subprocess.run(["callgrind_control", "--dump", str(p.pid)], check=True, capture_output=True)


def measure(setup: str, replica: str, root: Path, adapters: dict[str, str], requests: int) -> float:
    """Thousands of instructions per request of ``setup``'s server process, on the light config."""
    return measure_with_idle(setup, light(replica, adapters), root, requests, idle=False)[0]


def measure_with_idle(setup: str, load: Load, root: Path, requests: int, idle: bool) -> tuple[float, float]:
    """Thousands of instructions per request of ``setup``'s server process, and (``idle``, else 0) what the same
    process ran in an idle window as long as the requests took, per request: its clock-driven work (probes,
    scrapes, timers, the log writer's wake-ups), which callgrind's slowdown makes weigh about 50x what it does
    per request at full speed, and which moves with the machine's load."""
    port = free_port()
    cmd, health = _command(setup, load, port, root)
    url = f"http://127.0.0.1:{port}"
    to_send = _requests(setup, load)
    out = root / f"{setup}.callgrind"
    with _under_callgrind(cmd, url, health, out, root / f"{setup}.log") as pid:
        connections = [http.client.HTTPConnection("127.0.0.1", port, timeout=300) for _ in range(load.clients)]
        try:
            # Every tenant's adapter loaded and every connection open before counting.
            _send(connections, to_send, max(WARM_UP, 4 * len(to_send)))
            subprocess.run(["callgrind_control", "--instr=on", str(pid)], check=True, capture_output=True)
            began = time.monotonic()
            _send(connections, to_send, requests)
            took = time.monotonic() - began
            subprocess.run(["callgrind_control", "--instr=off", str(pid)], check=True, capture_output=True)
            if idle:
                subprocess.run(["callgrind_control", "--dump=busy", str(pid)], check=True, capture_output=True)
                subprocess.run(["callgrind_control", "--instr=on", str(pid)], check=True, capture_output=True)
                time.sleep(took)
                subprocess.run(["callgrind_control", "--instr=off", str(pid)], check=True, capture_output=True)
                subprocess.run(["callgrind_control", "--dump=idle", str(pid)], check=True, capture_output=True)
        finally:
            for connection in connections:
                connection.close()
    if not idle:
        return total_instructions(out) / requests / 1000, 0.0
    parts = part_totals(out)  # the busy window's dump, the idle window's, then the final (empty) one
    return parts[0] / requests / 1000, parts[1] / requests / 1000


def part_totals(out: Path) -> list[int]:
    """Each of ``out``'s dumps' totals, in the order they were dumped (``out.1``, ``out.2``, ...)."""
    totals = []
    for part in sorted(out.parent.glob(out.name + ".*"), key=lambda p: int(p.name.rsplit(".", 1)[1])):
        lines = [line for line in part.read_text().splitlines() if line.startswith("totals:")]
        totals.append(int(lines[-1].split()[1]) if lines else 0)
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300, help="measured per setup, after a warm-up")
    parser.add_argument("--only", help="comma-separated setup names (default: all): " + ",".join(SETUPS))
    parser.add_argument(
        "--idle",
        action="store_true",
        help="also count an idle window as long as the requests took (the process's clock-driven work) and print "
        "the count net of it: what the requests themselves cost",
    )
    parser.add_argument(
        "--realistic",
        action="store_true",
        help="bench_overhead's realistic load in shape: 32 tenants on 4 replicas (8 adapters each), --clients at once",
    )
    parser.add_argument("--clients", type=int, default=1, help="with --realistic: clients sending at once")
    parser.add_argument("--keep", type=Path, help="copy each setup's callgrind dumps here (for callgrind_annotate)")
    args = parser.parse_args(argv)
    if not callgrind_available():
        print("valgrind (callgrind) is not installed")
        return 1
    setups = [s for s in SETUPS if not args.only or s in args.only.split(",")]
    count_ = REPLICAS if args.realistic else 1
    sim = ("--time-scale", "0", *(("--max-loras", "8", "--max-cpu-loras", "64") if args.realistic else ()))
    with tempfile.TemporaryDirectory() as tmp, simulated_replicas(Path(tmp), count_, *sim) as urls:
        root = Path(tmp)
        if args.realistic:
            adapters = write_adapters(root, [name for names in TENANTS.values() for name in names])
            load = Load(urls, TENANTS, adapters, max_adapters=8, clients=args.clients, quiet_clock=True)
        else:
            adapters = write_adapters(root, [ADAPTER])
            load = light(urls["r0"], adapters)
        print(f"load: {'realistic' if args.realistic else 'light'}, {len(load.tenants)} tenants on "
              f"{len(load.replicas)} replicas, {load.clients} clients", flush=True)  # fmt: skip
        for setup in setups:
            # Every adapter on every replica: the bare proxies load none, and each gateway starts from the same
            # state whatever the one before it left (it trims each replica to its max_adapters at start-up).
            _preload(list(urls.values()), adapters)
            count, background = measure_with_idle(setup, load, root, args.requests, args.idle)
            line = f"{setup:18} {count:8.0f} k instructions per request ({args.requests} requests)"
            if args.idle:
                line += f"; idle window {background:.0f} k, net {count - background:.0f} k"
            print(line, flush=True)
            if args.keep:
                args.keep.mkdir(parents=True, exist_ok=True)
                for part in root.glob(f"{setup}.callgrind*"):
                    shutil.copy(part, args.keep / part.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
