"""The routing benchmark: one seeded multi-tenant trace, replayed with the same timing against the same simulated
fleet through tenantgate under each of its policies and, when installed (`make peers`), vllm-router and
sglang-router under theirs.

The trace: Zipf-popular tenants with one adapter each (more adapters than the fleet's GPU slots), three sessions
per tenant whose prompts share a prefix and grow turn by turn, Poisson arrivals, and one tenant that turns hot
(8x its rate) half-way. Peers cannot load adapters, so for them the simulated engines start with every adapter
registered; the simulator charges the cold load (disk to host memory) and the swap-in on first use per slot, as
it does for tenantgate. Each router gets the tenant the way it reads it: tenantgate by API key, vllm-router by
`x-tenant-id`, sglang-router by `X-SMG-Routing-Key`.

Per setup: TTFT and end-to-end p50/p99 (TTFT p99 also over the heavy tenants' requests and the light tenants' apart,
on the traces that have heavy ones: the colliding tenants, the one that turns hot), requests/s, cold loads against
the compulsory minimum (distinct adapters), evictions, prefix-cache hit ratio, max/mean replica load, the share of
each tenant's requests at its most-used replica, and the peak queue (running + waiting, sampled every 0.1 s from the
engines' /metrics) on the most loaded replica. On the hot trace, through tenantgate, the hot tenant's cold spills
once its second home is warm (its first cold load in the trace ended): its streams that met the cold regime (waited
for their adapter's load on the request path; counted per replica and regime by tenantgate_stream_regimes_total,
read once after the trace) but those on replicas whose loads of it all began before then, and its requests whose
adapter the engine had dropped since (the cold-load log's cause `request`); results.json keeps its streams per
regime (`hot_spills`). Setups with several gateways start that many `tenantgate serve` processes sharing one redis-
server, and the client sends each request to the next gateway in turn, as a load balancer would. Written to OUT as
results.json, results.md and two plots (TTFT distributions; cold loads over time).

    python -m loadtests.bench_routing [--seconds 30] [--rate 20] [--seed 17] [--only NAME] [--out bench-results]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from gateway.routing.ring import Ring
from loadtests.collector import collector_held
from loadtests.fleet import ADMIN_TOKEN, api_key, gateway_config, gateway_process, sim_stats, write_adapters
from loadtests.processes import free_port, healthy, running, sim_command
from loadtests.sim.defaults import SimParams
from loadtests.sim.timeline import prompt_digest

REPO = Path(__file__).resolve().parent.parent
PEERS = REPO / ".peers"
REPLICAS, MAX_LORAS, MAX_CPU_LORAS = 4, 2, 4
HOT = "t05"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@dataclass(frozen=True)
class TraceSpec:
    """One kind of traffic: Zipf-popular tenants with one adapter each, three prefix-sharing sessions per tenant,
    Poisson arrivals at ``rate`` per second, and from half-time the tenant ``HOT`` adding ``hot_extra`` times
    its own rate. ``sim_args``: how the simulated replicas are sized for it."""

    name: str
    about: str
    tenants: int
    rate: float
    hot_extra: float
    sim_args: tuple[str, ...] = ()
    # Heavy tenants that count-balanced homes put on one replica (``colliding``), and their share of the traffic
    # together (the others share the rest evenly); 0: Zipf popularity.
    collide: int = 0
    heavy_share: float = 0.0

    @property
    def tenant_ids(self) -> list[str]:
        return [f"t{i:02d}" for i in range(self.tenants)]

    @property
    def seats(self) -> int:
        """Requests one simulated replica runs at once (its --max-num-seqs), as the gateway's pool states them."""
        args = list(self.sim_args)
        return int(args[args.index("--max-num-seqs") + 1]) if "--max-num-seqs" in args else SimParams().max_num_seqs


TRACES = {
    spec.name: spec
    for spec in (
        TraceSpec(
            "churn",
            "24 adapters for 16 host slots: about a tenth of requests find their adapter cold whatever the router does",
            tenants=24,
            rate=20.0,
            hot_extra=7.0,
        ),
        TraceSpec(
            "hot",
            "16 adapters (every one fits) and a tenant that turns hotter than one replica can serve (4 seats each)",
            tenants=16,
            rate=12.0,
            hot_extra=40.0,
            sim_args=("--max-num-seqs", "4"),
        ),
        TraceSpec("fits", "16 adapters (every one fits), Zipf, steady", tenants=16, rate=20.0, hot_extra=0.0),
        TraceSpec(
            "collide",
            "16 adapters (every one fits); two heavy tenants, 60% of the requests, homed on one replica by "
            "count-balanced homes (4 seats each)",
            tenants=16,
            rate=24.0,
            hot_extra=0.0,
            sim_args=("--max-num-seqs", "4"),
            collide=2,
            heavy_share=0.6,
        ),
    )
}


@dataclass(frozen=True)
class Setup:
    name: str
    router: str  # tenantgate | vllm-router | sglang-router
    policy: str
    prefer_resident: bool = True
    home_placement: str = "balanced"
    # Router processes sharing the fleet (tenantgate's share one redis-server; a peer's share nothing); the client
    # sends each request to the next in turn, as a load balancer would.
    gateways: int = 1
    load_view: str = "shared"  # the product's default (routing.load_view)
    # Routing settings beside the defaults (tenantgate only), e.g. {"balance_factor": 2.0}.
    routing: tuple[tuple[str, Any], ...] = ()
    # Other config sections (tenantgate only), e.g. {"placement": {...}}.
    sections: tuple[tuple[str, Any], ...] = ()


# Homes from traffic at a 20 s trace's pace: the traffic measured every second over a 4 s window, homes planned
# every 2 s (the defaults, 5 s / 60 s / 10 s, suit hours of traffic, not seconds).
TRAFFIC_HOMES = (("traffic", {"interval_s": 1.0, "window_s": 4.0}), ("placement", {"interval_s": 2.0}))


# An oracle for the collide trace (docs/benchmarks.md, "Collide: what placement can reach"): the homes traffic
# homes reach once they have split the two heavy tenants (t09 pinned to r2, the light t03 to r0 in its place), from
# the start, frozen, every adapter filled at its home before the first request; a table counts as measured after
# 0.25 s, so the plan's confinement holds from the first requests.
ORACLE_PINS = {"t09": "r2", "t03": "r0"}
ORACLE_HOMES = (
    ("traffic", {"interval_s": 0.25, "window_s": 0.25}),
    ("placement", {"interval_s": 0.25, "freeze": True, "pins": ORACLE_PINS}),
)
# ... and with no exit off the plan: every key served at its one home, however long the queue there.
ORACLE_HOMES_CONFINED = (
    ("traffic", {"interval_s": 0.25, "window_s": 0.25}),
    ("placement", {"interval_s": 0.25, "freeze": True, "pins": ORACLE_PINS, "off_plan_margin_ms": 600_000.0}),
)

# The default scorers and the load_ahead term (a cold load priced by the loads under way where it would run).
LOAD_AHEAD = {"queue": 1.0, "regime": 1.0, "affinity": 1.0, "cold_stall": 1.0, "load_ahead": 1.0}

# The default scorers and the gpu_slot term (the wait for a GPU adapter slot where every slot is held by other
# adapters in use).
GPU_SLOT = {"queue": 1.0, "regime": 1.0, "affinity": 1.0, "cold_stall": 1.0, "gpu_slot": 1.0}

VLLM_ROUTER_POLICIES = ("consistent_hash", "round_robin", "sticky_least_loaded", "cache_aware")
SETUPS = [
    Setup("tenantgate round_robin", "tenantgate", "round_robin"),
    Setup("tenantgate least_loaded", "tenantgate", "least_loaded"),
    Setup("tenantgate consistent_hash", "tenantgate", "consistent_hash"),
    Setup("tenantgate bounded, ring homes", "tenantgate", "bounded_consistent_hash", home_placement="ring"),
    Setup("tenantgate bounded, no residency", "tenantgate", "bounded_consistent_hash", prefer_resident=False),
    Setup("tenantgate bounded + residency", "tenantgate", "bounded_consistent_hash"),
    Setup("tenantgate bounded, engine load view", "tenantgate", "bounded_consistent_hash", load_view="engine"),
    Setup("tenantgate predicted_ttft", "tenantgate", "predicted_ttft"),
    Setup(
        "tenantgate predicted_ttft, traffic homes",
        "tenantgate",
        "predicted_ttft",
        home_placement="traffic",
        sections=TRAFFIC_HOMES,
    ),
    Setup("tenantgate predicted_ttft, engine load view", "tenantgate", "predicted_ttft", load_view="engine"),
    # Traffic homes learning as fast as the noise lets them (an experiment, docs/benchmarks.md "Collide: what
    # placement can reach"): the average over 1 s, folded and planned every 0.5 s.
    Setup(
        "tenantgate predicted_ttft, traffic homes, 1 s window",
        "tenantgate",
        "predicted_ttft",
        home_placement="traffic",
        sections=(("traffic", {"interval_s": 0.5, "window_s": 1.0}), ("placement", {"interval_s": 0.5})),
    ),
    Setup(
        "tenantgate predicted_ttft, oracle homes",
        "tenantgate",
        "predicted_ttft",
        home_placement="traffic",
        sections=ORACLE_HOMES,
    ),
    Setup(
        "tenantgate predicted_ttft, oracle homes, confined",
        "tenantgate",
        "predicted_ttft",
        home_placement="traffic",
        sections=ORACLE_HOMES_CONFINED,
    ),
    # A hot key's adapter warmed ahead of its spills (routing.cold_margin_ms, off by default: docs/benchmarks.md).
    Setup(
        "tenantgate predicted_ttft, warm ahead", "tenantgate", "predicted_ttft", routing=(("cold_margin_ms", 500.0),)
    ),
    Setup(
        "tenantgate predicted_ttft, warm ahead, traffic homes",
        "tenantgate",
        "predicted_ttft",
        home_placement="traffic",
        routing=(("cold_margin_ms", 500.0),),
        sections=TRAFFIC_HOMES,
    ),
    # A hot key with two copies spilling cold when faster, as before routing.hold_copies (on by default).
    Setup("tenantgate predicted_ttft, no hold", "tenantgate", "predicted_ttft", routing=(("hold_copies", False),)),
    Setup(
        "tenantgate predicted_ttft, no cold stall",
        "tenantgate",
        "predicted_ttft",
        routing=(("scorers", {"queue": 1, "regime": 1, "affinity": 1}),),
    ),
    Setup(
        "tenantgate predicted_ttft, eviction",
        "tenantgate",
        "predicted_ttft",
        routing=(("scorers", {"queue": 1.0, "regime": 1.0, "affinity": 1.0, "cold_stall": 1.0, "eviction": 1.0}),),
    ),
    Setup(
        "tenantgate predicted_ttft, load ahead",
        "tenantgate",
        "predicted_ttft",
        routing=(("scorers", LOAD_AHEAD),),
    ),
    Setup(
        "tenantgate predicted_ttft, 3 gateways, load ahead",
        "tenantgate",
        "predicted_ttft",
        gateways=3,
        routing=(("scorers", LOAD_AHEAD),),
    ),
    Setup("tenantgate predicted_ttft, gpu slot", "tenantgate", "predicted_ttft", routing=(("scorers", GPU_SLOT),)),
    Setup(
        "tenantgate predicted_ttft, 3 gateways, gpu slot",
        "tenantgate",
        "predicted_ttft",
        gateways=3,
        routing=(("scorers", GPU_SLOT),),
    ),
    Setup("tenantgate bounded, 3 gateways", "tenantgate", "bounded_consistent_hash", gateways=3),
    Setup(
        "tenantgate bounded, 3 gateways, engine load view",
        "tenantgate",
        "bounded_consistent_hash",
        gateways=3,
        load_view="engine",
    ),
    Setup("tenantgate predicted_ttft, 3 gateways", "tenantgate", "predicted_ttft", gateways=3),
    Setup(
        "tenantgate predicted_ttft, 3 gateways, engine load view",
        "tenantgate",
        "predicted_ttft",
        gateways=3,
        load_view="engine",
    ),
    Setup(
        "tenantgate predicted_ttft, 3 gateways, gateway load view",
        "tenantgate",
        "predicted_ttft",
        gateways=3,
        load_view="gateway",
    ),
    *(Setup(f"vllm-router {p}", "vllm-router", p) for p in VLLM_ROUTER_POLICIES),
    Setup("vllm-router consistent_hash, 3 instances", "vllm-router", "consistent_hash", gateways=3),
    Setup("vllm-router sticky_least_loaded, 3 instances", "vllm-router", "sticky_least_loaded", gateways=3),
    *(Setup(f"sglang-router {p}", "sglang-router", p) for p in ("cache_aware", "round_robin", "manual")),
    Setup("sglang-router cache_aware, 3 instances", "sglang-router", "cache_aware", gateways=3),
]

# What `make bench` runs (docs/benchmarks.md publishes): tenantgate's default and its variants that matter, and
# the peers' affinity policies, one and three instances. Round robin loses on every trace at this fleet size
# (16-24 adapters, 4 host slots per replica): --all-setups runs it and the rest.
PUBLISHED = {
    "tenantgate bounded + residency",
    "tenantgate predicted_ttft",
    "tenantgate predicted_ttft, traffic homes",
    "tenantgate predicted_ttft, no cold stall",
    "tenantgate predicted_ttft, 3 gateways",
    "tenantgate predicted_ttft, 3 gateways, engine load view",
    "tenantgate predicted_ttft, 3 gateways, gateway load view",
    "vllm-router consistent_hash",
    "vllm-router sticky_least_loaded",
    "vllm-router consistent_hash, 3 instances",
    "vllm-router sticky_least_loaded, 3 instances",
    "sglang-router cache_aware",
    "sglang-router manual",
}


@dataclass(frozen=True)
class Arrival:
    offset_s: float
    tenant: str
    prompt: str


def colliding(tenant_ids: list[str], count: int) -> list[str]:
    """``count`` tenants that count-balanced homes put on the same replica of the benchmark's fleet (the gateway
    computes the same homes: same replica ids, vnodes and tenants)."""
    ring = Ring([f"r{i}" for i in range(REPLICAS)], vnodes=160)
    ring.balance(tenant_ids)
    by_home: dict[str, list[str]] = {}
    for tenant in tenant_ids:
        by_home.setdefault(ring.home(tenant), []).append(tenant)
    return next(tenants[:count] for _, tenants in sorted(by_home.items()) if len(tenants) >= count)


def heavy_tenants(spec: TraceSpec) -> set[str]:
    """The trace's heavy tenants: the colliding ones, and the tenant that turns hot where one does (the others are
    the light ones, whose tail the report shows apart: a plan that serves the heavy ones well may do it at their
    cost)."""
    heavy = set(colliding(spec.tenant_ids, spec.collide)) if spec.collide else set()
    return heavy | ({HOT} if spec.hot_extra else set())


def popularity(spec: TraceSpec) -> dict[str, float]:
    """Each tenant's weight: Zipf by rank, or with ``collide`` the heavy tenants' share and the rest even."""
    ids = spec.tenant_ids
    if not spec.collide:
        return {t: 1 / (rank + 1) ** 1.1 for rank, t in enumerate(ids)}
    heavy = set(colliding(ids, spec.collide))
    light = (1 - spec.heavy_share) / (len(ids) - len(heavy))
    return {t: spec.heavy_share / len(heavy) if t in heavy else light for t in ids}


def make_trace(seconds: float, rate: float, seed: int = 17, spec: TraceSpec | None = None) -> list[Arrival]:
    spec = spec or TRACES["churn"]
    rng = random.Random(seed)
    weights = popularity(spec)
    turns: Counter[tuple[str, int]] = Counter()
    trace: list[Arrival] = []
    now = 0.0
    while True:
        extra = spec.hot_extra if now >= seconds / 2 else 0.0
        total = sum(weights.values()) + extra * weights[HOT]
        now += rng.expovariate(rate * (total / sum(weights.values())))
        if now >= seconds:
            return trace
        pick = {t: w * (1 + extra if t == HOT else 1) for t, w in weights.items()}
        tenant = rng.choices(list(pick), list(pick.values()))[0]
        session = rng.randrange(3)
        turns[(tenant, session)] += 1
        history = " ".join(f"turn {n} said something" for n in range(turns[(tenant, session)]))
        prompt = f"system: you help {tenant} customers with their orders and accounts. session {session}: {history}"
        trace.append(Arrival(now, tenant, prompt))


@dataclass
class Observed:
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    # The tenant of each TTFT in ``ttft``, in the same order (the per-tenant split: heavy against light).
    tenants: list[str] = field(default_factory=list)
    failures: int = 0
    cold_loads_over_time: list[tuple[float, int]] = field(default_factory=list)
    # Per replica, the most requests running + waiting seen at once in the engine's own metrics.
    peak_queue: dict[str, float] = field(default_factory=dict)
    # When the trace started (time.monotonic: the simulators on this host share the clock).
    started: float = 0.0
    # tenantgate, on a trace with a hot tenant: its streams by (replica, regime met), summed over the gateways, read
    # from tenantgate_stream_regimes_total once the trace has run.
    hot_regimes: Counter[tuple[str, str]] = field(default_factory=Counter)
    # Per answered request, in the order of ``ttft``: when it was sent (time.monotonic) and its prompt's digest,
    # which find it in the engines' timelines (tail_regimes).
    sent: list[float] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)


def headers_for(router: str, tenant: str) -> dict[str, str]:
    if router == "tenantgate":
        return {"Authorization": f"Bearer {api_key(tenant)}"}
    if router == "vllm-router":
        return {"x-tenant-id": tenant}
    return {"X-SMG-Routing-Key": tenant}


async def streamed(
    client: httpx.AsyncClient, url: str, router: str, tenant: str, prompt: str
) -> tuple[float, float] | None:
    """One streamed completion of the tenant's adapter through the router: its time to first byte and to the end, in
    seconds, or None when it failed (a status other than 200, or a transport error)."""
    body = {"model": f"lora-{tenant}", "prompt": prompt, "max_tokens": 16, "stream": True}
    sent = time.monotonic()
    first = None
    try:
        async with client.stream(
            "POST", url + "/v1/completions", json=body, headers=headers_for(router, tenant)
        ) as response:
            if response.status_code != 200:
                return None
            async for _ in response.aiter_bytes():
                first = first or time.monotonic()
    except httpx.HTTPError:
        return None
    done = time.monotonic()
    return (first or done) - sent, done - sent


async def replay(
    urls: list[str], router: str, trace: list[Arrival], replicas: dict[str, str], hot: bool = False
) -> Observed:
    started = time.monotonic()
    observed = Observed(started=started)
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:

        async def one(index: int, arrival: Arrival) -> None:
            url = urls[index % len(urls)]
            await asyncio.sleep(max(0.0, started + arrival.offset_s - time.monotonic()))
            sent = time.monotonic()
            timed = await streamed(client, url, router, arrival.tenant, arrival.prompt)
            if timed is None:
                observed.failures += 1
                return
            observed.ttft.append(timed[0])
            observed.e2e.append(timed[1])
            observed.tenants.append(arrival.tenant)
            observed.sent.append(sent)
            observed.digests.append(prompt_digest(arrival.prompt))

        async def sample_cold_loads() -> None:
            while True:
                total = 0
                for replica_url in replicas.values():
                    total += (await client.get(replica_url + "/sim/stats")).json()["cold_loads"]
                observed.cold_loads_over_time.append((time.monotonic() - started, total))
                await asyncio.sleep(1.0)

        async def sample_queues() -> None:
            while True:
                for replica, replica_url in replicas.items():
                    with contextlib.suppress(httpx.HTTPError):
                        queue = engine_queue((await client.get(replica_url + "/metrics")).text)
                        observed.peak_queue[replica] = max(observed.peak_queue.get(replica, 0.0), queue)
                await asyncio.sleep(0.1)

        samplers = [asyncio.create_task(sample_cold_loads()), asyncio.create_task(sample_queues())]
        with collector_held():  # the client's own pauses are not the router's (loadtests/collector.py)
            await asyncio.gather(*(one(index, arrival) for index, arrival in enumerate(trace)))
        for sampler in samplers:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
        if router == "tenantgate" and hot:  # once, at the end: a gateway renders /metrics on its event loop
            for gateway_url in urls:
                page = await client.get(gateway_url + "/metrics", headers=ADMIN_HEADERS)
                observed.hot_regimes.update(stream_regimes(page.text, HOT))
    return observed


def stream_regimes(metrics: str, tenant: str) -> Counter[tuple[str, str]]:
    """A gateway's streams of ``tenant`` by (replica, regime met), from its /metrics page."""
    counts: Counter[tuple[str, str]] = Counter()
    for line in metrics.splitlines():
        if line.startswith("tenantgate_stream_regimes_total{") and f'tenant="{tenant}"' in line:
            labels = dict(part.split("=", 1) for part in line[line.index("{") + 1 : line.index("}")].split(","))
            counts[(labels["replica"].strip('"'), labels["regime"].strip('"'))] += int(float(line.rsplit(" ", 1)[1]))
    return counts


def hot_spills(
    regimes: Counter[tuple[str, str]], events: list[tuple[float, str, str, str, list[str]]], time_scale: float = 1.0
) -> dict[str, Any]:
    """The hot tenant's cold spills once its second home is warm (issue 19), from its streams by (replica, regime
    met) and the cold-load log. Its second home is the replica of its first cold load in the trace (its home was
    filled before), warm ``LOAD_S`` x ``time_scale`` after that load began. A stream that met the cold regime
    waited for its adapter's load on the request path; those on a replica whose loads of the adapter all began
    before then were waiting for a load of the spill's first moments. Counted: every other cold stream (its home's
    included: reloaded after an eviction) and every request whose adapter the engine had dropped (cause
    ``request``: the gateway predicted it resident) from then on."""
    name = f"lora-{HOT}"
    loads = [(t, replica) for t, replica, adapter, _, _ in events if adapter == name]
    by_regime: Counter[str] = Counter()
    for (_, regime), n in regimes.items():
        by_regime[regime] += n
    cold_by_replica = {replica: n for (replica, regime), n in regimes.items() if regime == "cold" and n}
    if not loads:
        return {"second_home": None, "by_regime": dict(by_regime), "cold_by_replica": cold_by_replica,
                "cold_after_warm": by_regime["cold"]}  # fmt: skip
    warm_at = loads[0][0] + LOAD_S * time_scale
    early = {replica for t, replica in loads if t < warm_at} - {replica for t, replica in loads if t >= warm_at}
    cold = sum(n for replica, n in cold_by_replica.items() if replica not in early)
    dropped = sum(1 for t, _, adapter, cause, _ in events if adapter == name and cause == "request" and t >= warm_at)
    return {
        "second_home": loads[0][1],
        "second_home_warm_s": round(warm_at, 2),
        "by_regime": dict(by_regime),
        "cold_by_replica": cold_by_replica,
        "engine_dropped": dropped,
        "cold_after_warm": cold + dropped,
    }


def engine_queue(metrics: str) -> float:
    """vLLM's requests running + waiting, from its /metrics page."""
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
            total += float(line.rsplit(" ", 1)[1])
    return total


@contextlib.contextmanager
def redis_for(root: Path) -> Iterator[str]:
    """A redis-server on loopback (no persistence) for gateways that share residency, until the block ends."""
    port = free_port()
    with (root / "redis.log").open("wb") as log:
        process = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        for _ in range(100):  # bounded: until it answers PING
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(64).startswith(b"+PONG"):
                    break
            time.sleep(0.1)
        else:
            raise RuntimeError("redis-server did not start")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(timeout=15)


@contextlib.contextmanager
def router_for(
    setup: Setup, root: Path, replicas: dict[str, str], adapters: dict[str, str], tenant_ids: list[str],
    seats: int = 0,
) -> Iterator[list[str]]:  # fmt: skip
    """The setup's router(s) in front of ``replicas``; tenantgate's pool states the replicas' ``seats`` (0: not)."""
    if setup.router == "tenantgate":
        tenants = {t: [f"lora-{t}"] for t in tenant_ids}
        with contextlib.ExitStack() as stack:
            extra: dict[str, Any] = {
                "routing": {"affinity": "tenant", "balance_factor": 1.25, "prefer_resident": setup.prefer_resident,
                            "home_placement": setup.home_placement, "load_view": setup.load_view,
                            **dict(setup.routing)},
                "telemetry": {"access_log": False},
                **dict(setup.sections),
            }  # fmt: skip
            if setup.gateways > 1:
                extra["state"] = {"redis_url": stack.enter_context(redis_for(root))}
            urls = []
            for index in range(setup.gateways):
                config = gateway_config(replicas, tenants, adapters, port=free_port(), policy=setup.policy,
                                        max_adapters=MAX_CPU_LORAS, extra=extra)  # fmt: skip
                config["pools"][0]["seats"] = seats
                url, _ = stack.enter_context(gateway_process(root, config, f"gateway-{index}"))
                urls.append(url)
            yield urls
        return
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(peer_process(setup, root, replicas, index)) for index in range(setup.gateways)]


@contextlib.contextmanager
def peer_process(setup: Setup, root: Path, replicas: dict[str, str], index: int) -> Iterator[str]:
    """One instance of a peer router in front of the fleet, until the block ends."""
    port = free_port()
    if setup.router == "vllm-router":
        cmd = [str(PEERS / "vllm-router/bin/vllm-router")]
    else:
        cmd = [str(PEERS / "sglang-router/bin/python"), "-m", "sglang_router.launch_router"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *replicas.values(), "--policy", setup.policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    log = root / f"{setup.router}-{index}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "RUST_LOG": "warn"})  # fmt: skip
    try:
        for _ in range(200):  # bounded: until it routes a request
            with contextlib.suppress(httpx.HTTPError):
                probe = {"model": "lora-t00", "prompt": "warm", "max_tokens": 1}
                if httpx.post(url + "/v1/completions", json=probe, timeout=5).status_code == 200:
                    break
            time.sleep(0.1)
        else:
            raise RuntimeError(f"{setup.name} did not start:\n{log.read_text()[-2000:]}")
        yield url
    finally:
        process.terminate()
        process.wait(timeout=15)


def peer_installed(router: str) -> bool:
    return router == "tenantgate" or (PEERS / router / "bin").exists()


def run_setup(setup: Setup, trace: list[Arrival], spec: TraceSpec, time_scale: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        root = Path(tmp)
        adapters = write_adapters(root, [f"lora-{t}" for t in spec.tenant_ids])
        sim_args = ["--time-scale", str(time_scale), "--max-loras", str(MAX_LORAS),
                    "--max-cpu-loras", str(MAX_CPU_LORAS), *spec.sim_args]  # fmt: skip
        replicas: dict[str, str] = {}
        for index in range(REPLICAS):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            extra = (
                [] if setup.router == "tenantgate" else ["--lora-modules", *(f"{n}={p}" for n, p in adapters.items())]
            )
            cmd = sim_command(port, "--model", "tiny-llama", "--seed", str(index), *sim_args, *extra)
            stack.enter_context(running(cmd, url, root / f"sim-{index}.log", start_timeout_s=30))
            replicas[f"r{index}"] = url
        assert all(healthy(url) for url in replicas.values())
        router_urls = stack.enter_context(router_for(setup, root, replicas, adapters, spec.tenant_ids, spec.seats))
        before = {r: sim_stats(u) for r, u in replicas.items()}
        observed = asyncio.run(replay(router_urls, setup.router, trace, replicas, hot=spec.hot_extra > 0))
        after = {r: sim_stats(u) for r, u in replicas.items()}
        timelines = {r: httpx.get(u + "/sim/timeline", timeout=30).json() for r, u in replicas.items()}
        kept = os.environ.get("BENCH_KEEP_LOGS")  # a directory: every process's log of the run, for reading later
        if kept:
            into = Path(kept) / f"{spec.name}-{setup.name.replace(' ', '_').replace(',', '')}-{time.time():.0f}"
            into.mkdir(parents=True, exist_ok=True)
            for log in root.glob("*.log"):
                shutil.copy(log, into / log.name)
    row = summarize(setup, trace, observed, before, after, hot=spec.hot_extra > 0, time_scale=time_scale,
                    heavy=heavy_tenants(spec))  # fmt: skip
    return {**row, "tail": tail_regimes(observed, timelines, heavy_tenants(spec))}


# What a slow request's time to first token went to; the largest part names its regime (tail_regimes): its own
# adapter's load (on the request path, by the gateway or the engine), other adapters' loads on its replica (vLLM runs
# a load between steps: every request there waits), swap-ins into a GPU slot, the wait for a step to admit it (for a
# seat, a GPU adapter slot, or only the step under way), its own step (prefill and first decode), and the gateway.
TAIL_PARTS = ("own load", "others' loads", "swap-ins", "wait for a seat", "wait for a GPU slot", "wait for a step",
              "first step", "gateway")  # fmt: skip


def overlap(start: float, end: float, spans: list[tuple[float, float]]) -> float:
    """Seconds of [start, end] that ``spans`` cover (the spans do not overlap each other: one engine's stalls)."""
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in spans)


def unstalled(start: float, end: float, stalls: list[tuple[float, float]]) -> float:
    """Seconds of [start, end] that no stall covers."""
    return max(0.0, end - start - overlap(start, end, stalls))


def tail_regimes(
    observed: Observed, timelines: dict[str, dict[str, Any]], heavy: set[str], share: float = 0.01
) -> dict[str, Any]:
    """The slowest ``share`` of requests by TTFT (those at or above the p99), each split into ``TAIL_PARTS`` from
    the engines' timelines (loadtests/sim/timeline.py) and its send time: per request (the tenant, heavy or light,
    seconds into the trace, the replica, the part it spent longest in, each part in ms), and the count per part,
    heavy and light apart. Requests no timeline holds (a log run over) are left out."""
    seen: dict[str, tuple[str, dict[str, Any]]] = {}
    for replica, timeline in timelines.items():
        for record in timeline["requests"]:
            seen[record["digest"]] = (replica, record)
    if not observed.ttft:
        return {"requests": [], "by_part": {}}
    cut = sorted(observed.ttft)[int((1 - share) * (len(observed.ttft) - 1))]
    slow = []
    for index, ttft in enumerate(observed.ttft):
        if ttft < cut or observed.digests[index] not in seen:
            continue
        replica, record = seen[observed.digests[index]]
        sent = observed.sent[index]
        arrived, admitted, first = record["arrived"], record["admitted"], record["first_token"]
        stalls = timelines[replica]["stalls"]
        own = [(a, b) for a, b, kind, adapter in stalls if kind == "load" and adapter == record["adapter"]]
        others = [(a, b) for a, b, kind, adapter in stalls if kind == "load" and adapter != record["adapter"]]
        swaps = [(a, b) for a, b, kind, _ in stalls if kind == "swap"]
        stalled = own + others + swaps
        waited = record["waited_for"]
        wait = ("wait for a seat" if "batch" in waited else "wait for a GPU slot" if "lora_slot" in waited
                else "wait for a step")  # fmt: skip
        parts = dict.fromkeys(TAIL_PARTS, 0.0)
        parts["own load"] = overlap(sent, first, own)
        parts["others' loads"] = overlap(sent, first, others)
        parts["swap-ins"] = overlap(sent, first, swaps)
        parts["gateway"] = unstalled(sent, arrived, stalled)
        parts[wait] = unstalled(arrived, admitted, stalled)
        parts["first step"] = unstalled(admitted, first, stalled)
        tenant = observed.tenants[index]
        slow.append({
            "tenant": tenant, "heavy": tenant in heavy, "at_s": round(sent - observed.started, 2), "replica": replica,
            "ttft_ms": round(1000 * ttft, 1), "part": max(parts, key=lambda part: parts[part]),
            "waited_for": waited, **{part: round(1000 * seconds, 1) for part, seconds in parts.items()},
        })  # fmt: skip
    by_part: dict[str, dict[str, int]] = {}
    for request in slow:
        counts = by_part.setdefault(request["part"], {"heavy": 0, "light": 0})
        counts["heavy" if request["heavy"] else "light"] += 1
    return {"requests": sorted(slow, key=lambda r: -r["ttft_ms"]), "by_part": by_part}


def tail_lines(tail: dict[str, Any]) -> list[str]:
    """The tail's split as printed lines (``--tail``): the count per part, then each request."""
    lines = ["    top 1% by part: " + ", ".join(f"{part} {n['heavy']} heavy / {n['light']} light"
                                          for part, n in sorted(tail["by_part"].items()))]  # fmt: skip
    for r in tail["requests"]:
        spent = ", ".join(f"{part} {r[part]:.0f}" for part in TAIL_PARTS if r[part] >= 1)
        lines.append(f"    {r['ttft_ms']:.0f} ms {r['tenant']}{' (heavy)' if r['heavy'] else ''} at {r['at_s']} s on "
                     f"{r['replica']}: {r['part']} ({spent} ms)")  # fmt: skip
    return lines


def summarize(
    setup: Setup,
    trace: list[Arrival],
    observed: Observed,
    before: dict[str, Any],
    after: dict[str, Any],
    hot: bool = False,
    time_scale: float = 1.0,
    heavy: set[str] | None = None,
) -> dict[str, Any]:
    def delta(key: str) -> int:
        return sum(int(after[r][key]) - int(before[r][key]) for r in after)

    served = {
        r: Counter({m: n - before[r]["requests_by_model"].get(m, 0) for m, n in after[r]["requests_by_model"].items()})
        for r in after
    }
    loads = [sum(c for m, c in counts.items() if m.startswith("lora-")) for counts in served.values()]
    shares = []
    for tenant in {a.tenant for a in trace}:
        per_replica = [counts.get(f"lora-{tenant}", 0) for counts in served.values()]
        if sum(per_replica):
            shares.append(max(per_replica) / sum(per_replica))
    events = cold_load_events(before, after, observed.started)
    hits, misses = delta("prefix_hit_tokens"), delta("prefix_miss_tokens")
    ttft, e2e = sorted(observed.ttft), sorted(observed.e2e)
    start_cold = observed.cold_loads_over_time[0][1] if observed.cold_loads_over_time else 0
    return {
        "setup": setup.name,
        "requests": len(trace),
        "failed": observed.failures,
        "ttft_p50_ms": 1000 * statistics.median(ttft) if ttft else None,
        "ttft_p99_ms": 1000 * ttft[int(0.99 * (len(ttft) - 1))] if ttft else None,
        **tenant_split(observed, heavy or set()),
        "e2e_p50_ms": 1000 * statistics.median(e2e) if e2e else None,
        "e2e_p99_ms": 1000 * e2e[int(0.99 * (len(e2e) - 1))] if e2e else None,
        "requests_per_s": len(e2e) / max(1e-9, trace[-1].offset_s) if trace else 0.0,
        "cold_loads": delta("cold_loads"),
        # Adapters the router registered (tenantgate loads on demand; a peer never does): a registration that found
        # the adapter still in host memory paid no cold load in the simulator (a real vLLM reads it again: a
        # name loaded anew gets a new id).
        "registrations": delta("registrations"),
        "compulsory_cold_loads": len({a.tenant for a in trace}),
        "swap_ins": delta("swap_ins"),
        "evictions": delta("host_evictions") + delta("gpu_evictions"),
        "prefix_hit_ratio": hits / (hits + misses) if hits + misses else 0.0,
        "max_over_mean_load": max(loads) / statistics.mean(loads) if loads and statistics.mean(loads) else 0.0,
        "tenant_share_at_top_replica": statistics.mean(shares) if shares else 0.0,
        "peak_queue": max(observed.peak_queue.values(), default=0.0),
        "cold_loads_over_time": [(round(t, 1), n - start_cold) for t, n in observed.cold_loads_over_time if n >= 0],
        "ttft_ms": [round(1000 * t, 2) for t in observed.ttft],
        # When each of those was sent, seconds into the trace (a tail read over part of the trace: the first seconds
        # apart from the rest).
        "ttft_sent_s": [round(t - observed.started, 2) for t in observed.sent],
        "cold_load_events": events,
        "served_by_replica": {r: dict(counts) for r, counts in served.items()},
        **cold_load_sources(events),
        **hot_tenant(setup, observed, events, hot, time_scale),
    }


def p99_ms(times: list[float]) -> float | None:
    """The 99th percentile in milliseconds (the nearest rank below, as the table's other p99s), None for none."""
    ordered = sorted(times)
    return 1000 * ordered[int(0.99 * (len(ordered) - 1))] if ordered else None


def tenant_split(observed: Observed, heavy: set[str]) -> dict[str, Any]:
    """TTFT p99 of the heavy tenants' requests and of the light tenants' (None where the trace has no heavy
    tenant): the light tenants' tail is otherwise hidden in the whole's."""
    if not heavy:
        return {"heavy_ttft_p99_ms": None, "light_ttft_p99_ms": None}
    pairs = list(zip(observed.tenants, observed.ttft, strict=True))
    return {
        "heavy_ttft_p99_ms": p99_ms([t for tenant, t in pairs if tenant in heavy]),
        "light_ttft_p99_ms": p99_ms([t for tenant, t in pairs if tenant not in heavy]),
    }


def hot_tenant(
    setup: Setup,
    observed: Observed,
    events: list[tuple[float, str, str, str, list[str]]],
    hot: bool,
    time_scale: float,
) -> dict[str, Any]:
    """On a trace with a hot tenant, through tenantgate: its streams after its second home is warm (hot_spills)."""
    if not hot or setup.router != "tenantgate":
        return {"hot_spills": None, "hot_cold_spills": None}
    spills = hot_spills(observed.hot_regimes, events, time_scale)
    return {"hot_spills": spills, "hot_cold_spills": spills["cold_after_warm"]}


# The simulator's longest cold load of the benchmark's adapters (rank 8) at time scale 1: its cold_load_s (0.4 s)
# x (0.5 + 0.5 x 8 / 16) x (1 + its jitter, 0.25) = 0.375 s.
LOAD_S = 0.375
# A victim loaded again on the same replica within this many seconds of its eviction was an eviction regretted.
REGRET_S = 10.0


def cold_load_events(
    before: dict[str, Any], after: dict[str, Any], started: float
) -> list[tuple[float, str, str, str, list[str]]]:
    """The cold loads of the run, oldest first: (seconds since the trace started at ``started``, a
    ``time.monotonic`` reading; replica, adapter, cause, evicted)."""
    events = []
    for replica, stats in after.items():
        seen = max((event[0] for event in before[replica]["cold_load_log"]), default=float("-inf"))
        events += [(t, replica, adapter, cause, evicted) for t, adapter, cause, evicted in stats["cold_load_log"]
                   if t > seen]  # fmt: skip
    events.sort()
    return [(round(t - started, 3), replica, adapter, cause, evicted) for t, replica, adapter, cause, evicted in events]


def cold_load_sources(events: list[tuple[float, str, str, str, list[str]]]) -> dict[str, Any]:
    """Where the cold loads came from: per replica, per adapter, per cause (the gateway loaded it, or a request
    found it fallen out of host memory), the first load of an adapter in the run, and evictions regretted (the
    victim loaded again on that replica within ``REGRET_S``)."""
    evicted_at: dict[tuple[str, str], float] = {}
    regretted = first = 0
    seen: set[str] = set()
    for t, replica, adapter, _, victims in events:
        if adapter not in seen:
            first += 1
            seen.add(adapter)
        if t - evicted_at.pop((replica, adapter), float("-inf")) <= REGRET_S:
            regretted += 1
        for victim in victims:
            evicted_at[(replica, victim)] = t
    return {
        "cold_loads_by_replica": dict(Counter(e[1] for e in events)),
        "cold_loads_by_adapter": dict(Counter(e[2] for e in events).most_common()),
        "cold_loads_by_cause": dict(Counter(e[3] for e in events)),
        "cold_loads_first_sight": first,
        "cold_loads_regretted": regretted,
    }


COLUMNS = [
    ("setup", "setup", "{}"),
    ("TTFT p50", "ttft_p50_ms", "{:.1f} ms"),
    ("TTFT p99", "ttft_p99_ms", "{:.1f} ms"),
    # The same p99 over the heavy tenants' requests alone (the colliding ones, the one that turns hot) and over the
    # light tenants' (tenant_split).
    ("heavy TTFT p99", "heavy_ttft_p99_ms", "{:.1f} ms"),
    ("light TTFT p99", "light_ttft_p99_ms", "{:.1f} ms"),
    ("e2e p50", "e2e_p50_ms", "{:.1f} ms"),
    ("e2e p99", "e2e_p99_ms", "{:.1f} ms"),
    ("req/s", "requests_per_s", "{:.1f}"),
    ("cold loads", "cold_loads", "{:.0f}"),
    ("swap-ins", "swap_ins", "{:.0f}"),
    ("evictions", "evictions", "{:.0f}"),
    ("prefix hits", "prefix_hit_ratio", "{:.0%}"),
    ("max/mean load", "max_over_mean_load", "{:.2f}"),
    ("tenant at top replica", "tenant_share_at_top_replica", "{:.0%}"),
    ("peak queue", "peak_queue", "{:.0f}"),
    ("failed", "failed", "{:.0f}"),
    # The hot tenant's streams that paid a cold load once a second replica was warm for it (tenantgate; hot_spills).
    ("hot cold spills", "hot_cold_spills", "{:.1f}"),
]
# Shown as the mean over seeds with the worst and best seed beside it.
SPREAD = {"ttft_p50_ms", "ttft_p99_ms", "heavy_ttft_p99_ms", "light_ttft_p99_ms", "cold_loads", "peak_queue",
          "hot_cold_spills"}  # fmt: skip


def combine(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One setup's runs over several seeds: each figure's mean, and its range for the ones in ``SPREAD``."""
    combined: dict[str, Any] = {"setup": rows[0]["setup"], "seeds": len(rows)}
    for _, key, _ in COLUMNS[1:]:
        values = [row[key] for row in rows if row[key] is not None]
        combined[key] = statistics.mean(values) if values else None
        if key in SPREAD and values:
            combined[key + "_range"] = (min(values), max(values))
    combined["ttft_ms"] = [t for row in rows for t in row["ttft_ms"]]
    combined["cold_loads_over_time"] = rows[0]["cold_loads_over_time"]
    return combined


def markdown(results: list[dict[str, Any]], header: str) -> str:
    lines = [header, "", "| " + " | ".join(c[0] for c in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in results:
        cells = []
        for _, key, fmt in COLUMNS:
            if row[key] is None:
                cells.append("-")
                continue
            cell = fmt.format(row[key])
            spread = row.get(key + "_range")
            if spread is not None and row.get("seeds", 1) > 1:
                cell += f" ({fmt.format(spread[0])}-{fmt.format(spread[1])})"
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict[str, Any]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(12, 6))
    axis.boxplot([r["ttft_ms"] or [0] for r in results], showfliers=False, whis=(1, 99))
    axis.set_xticks(range(1, len(results) + 1), [r["setup"] for r in results], rotation=35, ha="right", fontsize=8)
    axis.set_ylabel("time to first token (ms), whiskers at p1 and p99")
    axis.set_title(f"TTFT by setup: {title}")
    figure.tight_layout()
    figure.savefig(out / "ttft.png", dpi=110)
    figure, axis = plt.subplots(figsize=(10, 6))
    for row in results:
        points = row["cold_loads_over_time"]
        axis.plot([t for t, _ in points], [n for _, n in points], label=row["setup"])
    axis.set_xlabel("seconds into the trace (first seed)")
    axis.set_ylabel("cold adapter loads so far")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(out / "cold_loads.png", dpi=110)


def main(argv: list[str] | None = None, progress: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0, help="length of the trace (default 30)")
    parser.add_argument("--rate", type=float, default=None, help="mean requests per second before the hot tenant "
                        "(default: the trace's own)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--only", default="", help="run only setups whose name contains this (several: a|b; "
                        "=name for exactly that one)")  # fmt: skip
    parser.add_argument("--all-setups", action="store_true", help="every setup (default: the published ones)")
    parser.add_argument("--trace", default="churn", help=f"one of {', '.join(TRACES)}, or all (default churn)")
    parser.add_argument("--seeds", default="17", help="the traces' seeds, comma-separated (default 17)")
    parser.add_argument("--seed", type=int, default=None, help="one seed (same as --seeds N)")
    parser.add_argument("--tail", action="store_true", help="print what the slowest 1%% of requests waited for "
                        "(results.json keeps each run's in any case)")  # fmt: skip
    parser.add_argument("--time-scale", type=float, default=1.0, help="the simulator's clock: 1 (default) is a "
                        "data-centre GPU, a cold load 300-500 ms; 0.1 runs ten times faster")  # fmt: skip
    args = parser.parse_args(argv)
    specs = list(TRACES.values()) if args.trace == "all" else [TRACES[args.trace]]
    seeds = [args.seed] if args.seed is not None else [int(seed) for seed in args.seeds.split(",")]
    wanted = args.only.split("|") if args.only else []
    setups = [
        s
        for s in SETUPS
        if (any(w[1:] == s.name if w.startswith("=") else w in s.name for w in wanted) if wanted
            else args.all_setups or s.name in PUBLISHED)
        and peer_installed(s.router)
    ]  # fmt: skip
    missing = sorted({s.router for s in SETUPS if not peer_installed(s.router)})
    if missing:
        progress(f"not installed (make peers): {', '.join(missing)}")
    failed = False
    runs: list[dict[str, Any]] = []
    for spec in specs:
        rate = args.rate if args.rate is not None else spec.rate
        header = (
            f"trace {spec.name}: {spec.about}. {args.seconds:.0f} s at {rate:g} requests/s"
            + (f" ({HOT} adds {spec.hot_extra:g}x its rate at half-time)" if spec.hot_extra else "")
            + f"; {REPLICAS} simulated replicas x {MAX_LORAS} GPU / {MAX_CPU_LORAS} host adapter slots"
            + (f" ({' '.join(spec.sim_args)})" if spec.sim_args else "")
            + f", time scale {args.time_scale:g}; seeds {', '.join(map(str, seeds))}; {time.strftime('%Y-%m-%d')}"
        )
        progress(header)
        by_setup: dict[str, list[dict[str, Any]]] = {}
        for seed in seeds:
            trace = make_trace(args.seconds, rate, seed, spec)
            for setup in setups:
                row = {**run_setup(setup, trace, spec, args.time_scale), "trace": spec.name, "seed": seed}
                by_setup.setdefault(setup.name, []).append(row)
                runs.append(row)
                failed |= bool(row["failed"]) and setup.router == "tenantgate"
                spills = f", hot tenant: {row['hot_spills']}" if row["hot_spills"] else ""
                split = (
                    f" (heavy {row['heavy_ttft_p99_ms']:.1f}, light {row['light_ttft_p99_ms']:.1f})"
                    if row["heavy_ttft_p99_ms"] is not None and row["light_ttft_p99_ms"] is not None
                    else ""
                )
                progress(f"  seed {seed} {setup.name}: TTFT p50 {row['ttft_p50_ms']:.1f} ms, p99 "
                         f"{row['ttft_p99_ms']:.1f} ms{split}, cold loads {row['cold_loads']}, peak queue "
                         f"{row['peak_queue']:.0f}{spills}")  # fmt: skip
                if args.tail:
                    for line in tail_lines(row["tail"]):
                        progress(line)
        results = [combine(rows) for rows in by_setup.values()]
        out = args.out / spec.name
        out.mkdir(parents=True, exist_ok=True)
        table = markdown(results, header)
        (out / "results.md").write_text(table)
        plot(results, out, spec.name)
        progress("\n" + table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"runs": runs}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
