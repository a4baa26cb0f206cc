"""A noisy tenant and its quiet neighbours: what one tenant's burst costs the others in cold loads and TTFT.

The routing benchmark's fleet (4 simulated replicas at time scale 1, 2 GPU and 4 host adapter slots each, so 16
adapters fill the 16 slots exactly; `--max-num-seqs` the simulator's default), one tenantgate in front. 15 quiet
tenants send Poisson traffic (``--quiet-rate`` requests per second in all) for ``--warm-s`` seconds, then tenant
t00 opens ``--streams`` concurrent streams, each sending its next request as the last ends, for ``--noisy-s``
seconds while the quiet tenants go on. Printed per setup: the quiet tenants' cold loads and TTFT p50/p99 in the
noisy phase, the same in the warm-up phase (the reference), the replicas that loaded t00's adapter, and t00's own
requests and TTFT p50. The cold loads are the simulator's own log (disk to host memory), not the gateway's.

    python -m loadtests.noisy_tenant [--seeds 17,18,19] [--only traffic] [--out noisy-results]

Everything runs on 127.0.0.1. Setups: ``balanced`` (the default config) and ``traffic`` (routing.home_placement:
traffic at the routing benchmark's pace); ``traffic, unconfined`` turns placement.confine_spills off, where the
config has it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtests.bench_routing import (
    MAX_CPU_LORAS,
    MAX_LORAS,
    REPLICAS,
    TRAFFIC_HOMES,
    Setup,
    cold_load_events,
    router_for,
    streamed,
)
from loadtests.fleet import sim_stats, write_adapters
from loadtests.processes import free_port, running, sim_command
from loadtests.sim.defaults import SimParams

NOISY = "t00"
TENANTS = [f"t{i:02d}" for i in range(16)]
SETUPS = {
    "balanced": Setup("balanced", "tenantgate", "predicted_ttft"),
    "traffic": Setup("traffic", "tenantgate", "predicted_ttft", home_placement="traffic", sections=TRAFFIC_HOMES),
    "traffic, unconfined": Setup(
        "traffic, unconfined",
        "tenantgate",
        "predicted_ttft",
        home_placement="traffic",
        sections=(*TRAFFIC_HOMES[:1], ("placement", {**dict(TRAFFIC_HOMES)["placement"], "confine_spills": False})),
    ),
}


@dataclass
class Phase:
    ttft: list[float] = field(default_factory=list)
    failures: int = 0


@dataclass
class Observed:
    quiet_warm: Phase = field(default_factory=Phase)
    quiet_noisy: Phase = field(default_factory=Phase)
    noisy: Phase = field(default_factory=Phase)
    started: float = 0.0
    noisy_from: float = 0.0


async def one(client: httpx.AsyncClient, url: str, tenant: str, prompt: str, phase: Phase) -> None:
    timed = await streamed(client, url, "tenantgate", tenant, prompt)
    if timed is None:
        phase.failures += 1
        return
    phase.ttft.append(timed[0])


async def drive(url: str, seed: int, quiet_rate: float, warm_s: float, noisy_s: float, streams: int) -> Observed:
    rng = random.Random(seed)
    observed = Observed(started=time.monotonic())
    observed.noisy_from = observed.started + warm_s
    end = observed.noisy_from + noisy_s
    quiet = TENANTS[1:]
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=128)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        tasks: list[asyncio.Task[None]] = []

        async def quiet_traffic() -> None:
            at = observed.started
            turn = 0
            while True:
                at += rng.expovariate(quiet_rate)
                if at >= end:
                    return
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                tenant = rng.choice(quiet)
                turn += 1
                phase = observed.quiet_noisy if at >= observed.noisy_from else observed.quiet_warm
                prompt = f"system: you help {tenant} customers. turn {turn % 7}"
                tasks.append(asyncio.create_task(one(client, url, tenant, prompt, phase)))

        async def noisy_stream(index: int) -> None:
            await asyncio.sleep(max(0.0, observed.noisy_from - time.monotonic()))
            turn = 0
            while time.monotonic() < end:
                turn += 1
                await one(client, url, NOISY, f"system: noisy stream {index} turn {turn % 5}", observed.noisy)

        await asyncio.gather(quiet_traffic(), *(noisy_stream(i) for i in range(streams)))
        await asyncio.gather(*tasks)
    return observed


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(setup: Setup, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        root = Path(tmp)
        adapters = write_adapters(root, [f"lora-{t}" for t in TENANTS])
        sim_args = ["--time-scale", "1", "--max-loras", str(MAX_LORAS), "--max-cpu-loras", str(MAX_CPU_LORAS)]
        replicas: dict[str, str] = {}
        for index in range(REPLICAS):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            cmd = sim_command(port, "--model", "tiny-llama", "--seed", str(index), *sim_args)
            stack.enter_context(running(cmd, url, root / f"sim-{index}.log", start_timeout_s=30))
            replicas[f"r{index}"] = url
        seats = SimParams().max_num_seqs  # the simulator's default: the pool states what its replicas run at once
        urls = stack.enter_context(router_for(setup, root, replicas, adapters, TENANTS, seats))
        before = {r: sim_stats(u) for r, u in replicas.items()}
        observed = asyncio.run(drive(urls[0], seed, args.quiet_rate, args.warm_s, args.noisy_s, args.streams))
        after = {r: sim_stats(u) for r, u in replicas.items()}
    events = cold_load_events(before, after, observed.started)
    noisy_at = observed.noisy_from - observed.started
    quiet_cold_warm = sum(1 for t, _, a, _, _ in events if a != f"lora-{NOISY}" and t < noisy_at)
    quiet_cold_noisy = sum(1 for t, _, a, _, _ in events if a != f"lora-{NOISY}" and t >= noisy_at)
    noisy_replicas = sorted({r for _, r, a, _, _ in events if a == f"lora-{NOISY}"})
    return {
        "setup": setup.name,
        "seed": seed,
        "quiet_cold_loads_warmup": quiet_cold_warm,
        "quiet_cold_loads_noisy": quiet_cold_noisy,
        "quiet_ttft_p50_ms_warmup": 1000 * percentile(observed.quiet_warm.ttft, 0.5),
        "quiet_ttft_p99_ms_warmup": 1000 * percentile(observed.quiet_warm.ttft, 0.99),
        "quiet_ttft_p50_ms_noisy": 1000 * percentile(observed.quiet_noisy.ttft, 0.5),
        "quiet_ttft_p99_ms_noisy": 1000 * percentile(observed.quiet_noisy.ttft, 0.99),
        "quiet_requests_noisy": len(observed.quiet_noisy.ttft),
        "noisy_loaded_on": noisy_replicas,
        "noisy_requests": len(observed.noisy.ttft),
        "noisy_ttft_p50_ms": 1000 * percentile(observed.noisy.ttft, 0.5),
        "failures": observed.quiet_warm.failures + observed.quiet_noisy.failures + observed.noisy.failures,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="17", help="comma-separated seeds of the quiet tenants' arrivals")
    parser.add_argument("--only", default="", help="setups separated by ; (default: all): " + ", ".join(SETUPS))
    parser.add_argument("--quiet-rate", type=float, default=12.0, help="quiet tenants' requests/s in all (12)")
    parser.add_argument("--warm-s", type=float, default=8.0, help="seconds of quiet traffic alone first (8)")
    parser.add_argument("--noisy-s", type=float, default=20.0, help="seconds of the noisy tenant (20)")
    parser.add_argument("--streams", type=int, default=32, help="the noisy tenant's concurrent streams (32)")
    parser.add_argument("--out", default="", help="a directory for results.json (default: print only)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(";") if n.strip()] or list(SETUPS)
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for name in names:
            row = run(SETUPS[name], seed, args)
            rows.append(row)
            print(json.dumps(row), flush=True)
    for name in names:
        mine = [r for r in rows if r["setup"] == name]

        def summary(field_name: str, rows: list[dict[str, Any]] = mine) -> str:
            values = [r[field_name] for r in rows]
            return f"{statistics.mean(values):.0f} ({min(values):.0f}-{max(values):.0f})"

        print(
            f"{name}: quiet cold loads noisy phase {summary('quiet_cold_loads_noisy')}, warm-up "
            f"{summary('quiet_cold_loads_warmup')}; quiet TTFT p50/p99 noisy phase {summary('quiet_ttft_p50_ms_noisy')}"
            f" / {summary('quiet_ttft_p99_ms_noisy')} ms, warm-up {summary('quiet_ttft_p50_ms_warmup')} / "
            f"{summary('quiet_ttft_p99_ms_warmup')} ms; noisy requests {summary('noisy_requests')}, "
            f"TTFT p50 {summary('noisy_ttft_p50_ms')} ms; noisy adapter loaded on "
            f"{[len(r['noisy_loaded_on']) for r in mine]} replicas"
        )
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
