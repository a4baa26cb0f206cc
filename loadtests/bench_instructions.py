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

With ``--idle`` each setup also runs, after its requests, an idle window as long as they took: the process's
clock-driven work (tenantgate's is about 60 k instructions per request's worth of wall time, under callgrind), which
at full speed is spread over about 50x more requests. The count net of it is what the requests themselves cost,
and what a change to the request path moves; the window's own count moves with the machine's load.

    python -m loadtests.bench_instructions [--requests 300] [--only bare-http1,bare-fast] [--idle]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from loadtests.bench_overhead import _body, _preload
from loadtests.fleet import ADMIN_TOKEN, api_key, gateway_config, simulated_replicas, write_adapters
from loadtests.processes import free_port, running

SETUPS = ("bare-http1", "bare-fast", "tenantgate-nolog", "tenantgate")
ADAPTER = "bench-lora"
WARM_UP = 30


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


def _command(setup: str, replica: str, port: int, root: Path, adapters: dict[str, str]) -> tuple[list[str], str]:
    """The setup's server command and its health path."""
    if setup.startswith("bare-"):
        server = "fast" if setup == "bare-fast" else "aiohttp"
        cmd = ["-m", "loadtests.bare_proxy", "--port", str(port), "--client", "http1", "--server", server, replica]
        return cmd, "/health"
    extra: dict[str, Any] = {"telemetry": {"access_log": setup == "tenantgate"}}
    config = gateway_config({"r0": replica}, {"acme": [ADAPTER]}, adapters, port=port, extra=extra)
    path = root / f"{setup}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return ["-m", "gateway.cli", "serve", "--config", str(path)], "/readyz"


def _send(connection: http.client.HTTPConnection, headers: dict[str, str], count: int) -> None:
    """``count`` completions on one kept-alive connection, as the benchmarks' clients send them."""
    body = _body(ADAPTER)
    for _ in range(count):
        connection.request("POST", "/v1/completions", body, headers)
        answer = connection.getresponse()
        answer.read()
        if answer.status != 200:
            raise RuntimeError(f"the setup answered {answer.status}")


@contextlib.contextmanager
def _under_callgrind(cmd: list[str], url: str, health: str, out: Path, log: Path) -> Iterator[int]:
    valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]
    env = {"TENANTGATE_ADMIN_TOKEN": ADMIN_TOKEN}
    with running([*valgrind, sys.executable, *cmd], url, log, env=env, start_timeout_s=900, health_path=health) as p:
        yield p.pid
        subprocess.run(["callgrind_control", "--dump", str(p.pid)], check=True, capture_output=True)


def measure(setup: str, replica: str, root: Path, adapters: dict[str, str], requests: int) -> float:
    """Thousands of instructions per request of ``setup``'s server process."""
    return measure_with_idle(setup, replica, root, adapters, requests, idle=False)[0]


def measure_with_idle(
    setup: str, replica: str, root: Path, adapters: dict[str, str], requests: int, idle: bool
) -> tuple[float, float]:
    """Thousands of instructions per request of ``setup``'s server process, and (``idle``, else 0) what the same
    process ran in an idle window as long as the requests took, per request: its clock-driven work (probes,
    scrapes, timers, the log writer's wake-ups), which callgrind's slowdown makes weigh about 50x what it does
    per request at full speed, and which moves with the machine's load."""
    port = free_port()
    cmd, health = _command(setup, replica, port, root, adapters)
    url = f"http://127.0.0.1:{port}"
    headers = {"Content-Type": "application/json"}
    if setup.startswith("bare-"):
        headers["x-tenant-id"] = "acme"
    else:
        headers["Authorization"] = f"Bearer {api_key('acme')}"
    out = root / f"{setup}.callgrind"
    with _under_callgrind(cmd, url, health, out, root / f"{setup}.log") as pid:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        try:
            _send(connection, headers, WARM_UP)
            subprocess.run(["callgrind_control", "--instr=on", str(pid)], check=True, capture_output=True)
            began = time.monotonic()
            _send(connection, headers, requests)
            took = time.monotonic() - began
            subprocess.run(["callgrind_control", "--instr=off", str(pid)], check=True, capture_output=True)
            if idle:
                subprocess.run(["callgrind_control", "--dump=busy", str(pid)], check=True, capture_output=True)
                subprocess.run(["callgrind_control", "--instr=on", str(pid)], check=True, capture_output=True)
                time.sleep(took)
                subprocess.run(["callgrind_control", "--instr=off", str(pid)], check=True, capture_output=True)
                subprocess.run(["callgrind_control", "--dump=idle", str(pid)], check=True, capture_output=True)
        finally:
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
    args = parser.parse_args(argv)
    if not callgrind_available():
        print("valgrind (callgrind) is not installed")
        return 1
    setups = [s for s in SETUPS if not args.only or s in args.only.split(",")]
    with tempfile.TemporaryDirectory() as tmp, simulated_replicas(Path(tmp), 1, "--time-scale", "0") as urls:
        root = Path(tmp)
        adapters = write_adapters(root, [ADAPTER])
        _preload([urls["r0"]], adapters)  # the bare proxies load no adapter
        for setup in setups:
            count, background = measure_with_idle(setup, urls["r0"], root, adapters, args.requests, args.idle)
            line = f"{setup:18} {count:8.0f} k instructions per request ({args.requests} requests)"
            if args.idle:
                line += f"; idle window {background:.0f} k, net {count - background:.0f} k"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
