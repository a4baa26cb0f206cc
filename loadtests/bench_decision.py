"""The cost of one routing decision on the real pool, as the fleet grows: what ``Pool.place`` + ``Pool.release``
and ``Pool.explain`` cost per call, in microseconds, for fleets of 16 to 1,000 replicas.

Each fleet is one pool (160 vnodes per replica, the default RoutingConfig, the default policy or --policy) built
as the gateway builds it, over a driver that does nothing: no server, no I/O, so what is measured is the router
alone (ring, reservations, filters, picker, the residency view). Every replica is made healthy by one probe
(``Pool.probe``, the null driver answers yes), and 10% of them hold the request's adapter resident. The keys are
``--keys`` distinct tenants (``tenant-0`` ...); every call names the adapter, so the resident lookup runs too.

- first sight: the first decision ever for a key (a sample of the keys, each once);
- seen before: ``--calls`` decisions for keys drawn at random from all the keys, each drawn key decided once
  beforehand (untimed);
- explain: ``Pool.explain`` (the same decision, not taken) for a fifth of the seen-before draws.

Every engine answers one scrape (idle, one GPU slot) before the calls, as the gateway scrapes every engine
when it routes by predicted_ttft: a decision reads the scrape's running adapters and GPU slots as it does there.

Each timed call is ``place`` then ``release`` at once, so loads stay at zero in flight and the picker's bound never
bites (every key goes home): this is the decision's fixed cost, not the cost of spilling. Each call is timed on
each clock of ``--clock`` (``wall``: ``time.perf_counter_ns``, what a request waits, preemption included; ``cpu``:
the thread's CPU time, without preemption but with what a busy neighbour does to the caches), with the cyclic GC
off, ``--runs`` times in fresh processes: a cell gives the lowest and highest of the runs' figures. The tail on a
shared machine moves with whatever else runs, so beside each fleet's seen-before figures the same process times a
fixed piece of pure Python work calibrated to the decision's median, call by call in the same way ("same-length
work"): its p99 is what the machine alone does to a call that long. The share of calls over ``--target-us``
(20 us: the scheduler issue's target for p99) and the load average over each run are printed too. Each fleet runs
in a fresh process, so its build time and RSS growth (VmRSS from /proc after the measurements, less VmRSS before
the pool was built: the pool, its ring and what the calls left behind, such as reservations and memos; since
2026-12-02 afternoon the gateway's start-up heap reserve too, gateway/fleet/heap.py, which the bench makes after
building its pool as the gateway does after building its fleet) are its own. Since 2026-12-02 evening the bench also
warms the decision path on a throw-away pool before timing, as the gateway's start-up does (gateway/fleet/warm_up.py):
a process's first decisions are no longer the interpreter's first runs of that code.
Above 100 replicas the seen-before and explain counts shrink in proportion (``--full`` keeps them) so the default
run stays within about two minutes on 2 cores; the counts used are printed under the tables. The first sights do
not shrink: they cost little time, and the pool's per-key tables (its keys' entries: candidates and recent
replicas, gateway/fleet/keys.py; their reservations) double at sizes spaced by powers of two, the first sight that
crosses one rehashing both, so of n first sights on a new pool about log2(n) pay it: 8 of 500 (1.6%, enough to be
the p99 on their own), 11 of 5,000 (0.2%). The same count at every fleet size gives every fleet the same share
of them. ``--causes`` classes each first sight by what it did besides deciding (grew those tables, took a minor page
fault) and prints each class's share and p50 / p99.

    python -m loadtests.bench_decision [--replicas 16,64,256,1000] [--keys 100000] [--calls 20000] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import os
import random
import resource
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from backends.base import Endpoint
from gateway.config import PoolConfig, ResidencyConfig, RoutingConfig
from gateway.fleet import heap, warm_up
from gateway.fleet.pool import Pool
from gateway.observe.metrics import GatewayMetrics
from gateway.residency.lifecycle import PoolResidency
from gateway.residency.memory import MemoryStore
from gateway.residency.signal import NO_SIGNAL, Signal, SlotSignal

ADAPTER = "bench-lora"
RESIDENT_SHARE = 0.10
# What every replica's engine says of itself when scraped: idle, with vLLM's default --max-loras GPU slots. With
# predicted_ttft the gateway scrapes every routing.load_scrape_interval_s, so a decision reads a scrape as here.
IDLE_ENGINE = warm_up.IDLE
# Above this many replicas the seen-before and explain counts shrink in proportion (unless --full); first sights do
# not (see the module docstring).
FULL_SAMPLES_UP_TO = 100
# An EngineDriver with no engine behind it: every replica is healthy and idle, nothing is ever sent. The same as the
# start-up warm-up's.
NullDriver = warm_up.NoEngine


@dataclass(frozen=True)
class Samples:
    first_sight: int
    calls: int
    explain: int
    warmed: int = 0  # distinct drawn keys decided beforehand (set once known)


@dataclass(frozen=True)
class FleetResult:
    replicas: int
    first_sight_us: list[float]
    seen_before_us: list[float]
    explain_us: list[float]
    # The same-length work's calls (see the module docstring), as many as the seen-before ones.
    reference_us: list[float]
    build_s: float
    rss_growth_mb: float
    samples: Samples
    # With --causes, per first sight what it did besides deciding (CAUSES); else empty.
    first_sight_causes: list[str] = field(default_factory=list)


async def _no_publish(body: str) -> None:
    return None


def build_pool(replicas: int, policy: str = "bounded_consistent_hash", shared: bool = False) -> Pool:
    """A pool of ``replicas`` replicas built as the gateway builds one (and as tests/gateway/fleet's make_pool).
    ``shared``: with a slot signal as a gateway sharing Redis has (messages are handed to it here, nothing is sent),
    having heard another gateway's requests in flight on every replica and the bench's adapter in flight on a tenth
    of them: the default load view (``shared``) then reads them at every decision."""
    entries = [{"id": f"r{i}", "url": f"http://10.{i // 250}.{i % 250}.1:8000"} for i in range(replicas)]
    config = PoolConfig.model_validate(
        {"name": "bench", "backend": "vllm", "base_model": "tiny-llama", "replicas": entries, "policy": policy}
    )
    endpoints = [Endpoint(entry["id"], entry["url"]) for entry in entries]
    driver = NullDriver()
    signal: Signal = SlotSignal(_no_publish, GatewayMetrics()) if shared else NO_SIGNAL
    residency = PoolResidency(
        "bench", endpoints, driver, MemoryStore(), ResidencyConfig(), max_adapters=4, load_timeout_s=5, shared=False,
        signal=signal,
    )  # fmt: skip
    pool = Pool(config, RoutingConfig(), driver, residency)
    if isinstance(signal, SlotSignal):
        ids = [entry["id"] for entry in entries]
        flying = {"bench": {replica_id: [ADAPTER] for replica_id in ids[:: round(1 / RESIDENT_SHARE)]}}
        counts = {"bench": dict.fromkeys(ids, 1)}
        signal.heard(json.dumps({"t": "flying", "g": "another-gateway", "n": 1, "h": flying, "c": counts}))
        assert pool.shared_load_view
    return pool


def _rss_mb() -> float:
    """The process's resident set now (VmRSS); where /proc is missing, its peak (ru_maxrss)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# The clock each call is timed with: "wall" (perf_counter: what a request waits, preemption included) or "cpu"
# (this thread's CPU time: what the decision itself costs, whatever else shares the cores).
CLOCKS: dict[str, Callable[[], int]] = {"wall": time.perf_counter_ns, "cpu": time.thread_time_ns}


def _timed(call: Callable[[str], None], keys: Sequence[str], clock: Callable[[], int]) -> list[float]:
    """Microseconds per call of ``call(key)`` for each key in turn, with the cyclic GC off."""
    spent = [0] * len(keys)
    gc.collect()
    gc.disable()
    try:
        for i, key in enumerate(keys):
            started = clock()
            call(key)
            spent[i] = clock() - started
    finally:
        gc.enable()
    return [ns / 1000 for ns in spent]


# What a first sight did besides deciding, as --causes classes it: grew the pool's per-key tables (the dicts behind a
# key's entry and its reservation), took a minor page fault, both, or neither ("").
CAUSES = ("", "fault", "tables", "tables+fault")


def _timed_causes(
    call: Callable[[str], None], keys: Sequence[str], clock: Callable[[], int], tables: Sequence[Mapping[str, object]]
) -> tuple[list[float], list[str]]:
    """``_timed`` with each call's cause (CAUSES): the tables' sizes and the process's minor faults read around each
    call, outside its clock reads (a system call between calls: a --causes run's timings are its own)."""
    spent, causes = [0] * len(keys), [""] * len(keys)
    usage, me = resource.getrusage, resource.RUSAGE_SELF

    def sizeof(table: Mapping[str, object]) -> int:
        return dict.__sizeof__(table)  # the dict's own table (an OrderedDict's links left out)

    gc.collect()
    gc.disable()
    try:
        for i, key in enumerate(keys):
            sizes, faults = [sizeof(table) for table in tables], usage(me).ru_minflt
            started = clock()
            call(key)
            spent[i] = clock() - started
            grew = any(sizeof(table) != size for table, size in zip(tables, sizes, strict=True))
            faulted = usage(me).ru_minflt > faults
            causes[i] = "+".join(name for name, hit in (("tables", grew), ("fault", faulted)) if hit)
    finally:
        gc.enable()
    return [ns / 1000 for ns in spent], causes


def _work(steps: int) -> int:
    """Pure Python work of a fixed length (the same-length work's body)."""
    total = 0
    for step in range(steps):
        total += step
    return total


def _same_length_work(median_us: float, calls: int, clock: Callable[[], int]) -> list[float]:
    """``calls`` timings of ``_work`` sized so that its median is about ``median_us`` on this machine now."""
    steps = 1000

    def work(_: str) -> None:
        _work(steps)

    probe = _pct(_timed(work, [""] * 200, clock), 0.5)
    steps = max(1, round(1000 * median_us / max(0.01, probe)))
    return _timed(work, [""] * calls, clock)


def run_fleet(
    replicas: int,
    keys: int,
    samples: Samples,
    seed: int,
    policy: str,
    clock: str = "wall",
    prefill: int = 0,
    shared: bool = False,
    causes: bool = False,
) -> FleetResult:
    """One fleet, measured in this process (the parent runs each in a fresh one) with ``clock`` (CLOCKS), after
    ``prefill`` decisions for other keys, each once (untimed); with ``causes``, each first sight's cause too."""
    timer = CLOCKS[clock]
    rng = random.Random(seed)
    tenants = [f"tenant-{i}" for i in range(keys)]
    first_keys = rng.sample(tenants, samples.first_sight)
    drawn = [tenants[rng.randrange(keys)] for _ in range(samples.calls)]
    explained = drawn[: samples.explain]
    build_pool(
        1, shared=shared
    )  # imports and first-use set-up (metrics, validators) outside the build time and RSS growth
    gc.collect()
    rss_before = _rss_mb()

    started = time.perf_counter()
    pool = build_pool(replicas, policy, shared)
    build_s = time.perf_counter() - started
    asyncio.run(pool.probe())  # the start-up probe: every replica up
    asyncio.run(pool.scrape_engines())  # and one scrape of each engine's own signals
    heap.reserve()  # as the gateway's start-up does once its fleet is built (gateway/server.py)
    warm_up.decisions([pool], RoutingConfig())  # and its decision path warmed on a throw-away pool, as there
    assert all(replica.healthy for replica in pool.replicas.values())
    for replica_id in rng.sample(sorted(pool.replicas), max(1, round(RESIDENT_SHARE * replicas))):
        pool.residency.views[replica_id].resident[ADAPTER] = time.time()

    def place_release(key: str) -> None:
        pool.release(pool.place(key, ADAPTER))

    def explain(key: str) -> None:
        pool.explain(key, ADAPTER)

    for index in range(prefill):  # a long-running gateway's pool has seen more keys than it remembers
        place_release(f"prefill-{index}")
    first_causes: list[str] = []
    if causes:
        tables = (pool.keys, pool.reservations.active)
        first_sight, first_causes = _timed_causes(place_release, first_keys, timer, tables)
    else:
        first_sight = _timed(place_release, first_keys, timer)
    decided = set(first_keys)
    to_warm = [key for key in dict.fromkeys(drawn) if key not in decided]
    for key in to_warm:  # untimed: every drawn key has been decided once
        place_release(key)
    seen_before = _timed(place_release, drawn, timer)
    explain_us = _timed(explain, explained, timer)
    assert pool.in_flight == 0
    rss_growth = _rss_mb() - rss_before
    reference = _same_length_work(_pct(seen_before, 0.5), len(seen_before), timer)
    used = Samples(samples.first_sight, samples.calls, samples.explain, warmed=len(to_warm))
    return FleetResult(
        replicas, first_sight, seen_before, explain_us, reference, build_s, rss_growth, used, first_causes
    )


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _samples(replicas: int, keys: int, first_sight: int, calls: int, full: bool) -> Samples:
    scale = 1.0 if full else min(1.0, FULL_SAMPLES_UP_TO / replicas)
    first = max(100, min(keys, first_sight))
    drawn = max(100, round(calls * scale))
    return Samples(first, drawn, max(100, drawn // 5))


def _span(values: Sequence[float], digits: int = 1) -> str:
    """The lowest and highest of the runs' figures ("a-b"; one figure when they agree at this precision)."""
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return low if low == high else f"{low}-{high}"


def _p50_p99(runs: list[list[float]]) -> str:
    """p50 / p99 over the runs' calls: each the lowest-highest of the runs."""
    return f"{_span([_pct(run, 0.5) for run in runs])} / {_span([_pct(run, 0.99) for run in runs], 0)}"


def _over(values: list[float], target_us: float) -> float:
    return 100 * sum(1 for value in values if value > target_us) / len(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", default="16,64,256,1000", help="fleet sizes, comma-separated")
    parser.add_argument("--keys", type=int, default=100_000, help="distinct keys (tenant ids)")
    parser.add_argument("--calls", type=int, default=20_000, help="seen-before decisions per fleet")
    parser.add_argument("--first-sight", type=int, default=5_000, help="first decisions per fleet")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--policy", default=PoolConfig.model_fields["policy"].default, help="the pool's policy "
                        "(default: the config's default)")  # fmt: skip
    parser.add_argument("--clock", default="cpu,wall", help="the clocks, comma-separated: wall (perf_counter, "
                        "preemption included), cpu (the thread's CPU time); default both")  # fmt: skip
    parser.add_argument("--runs", type=int, default=3, help="runs per clock, each fleet in a fresh process")
    parser.add_argument("--shared", action="store_true", help="a slot signal that heard another gateway's "
                        "requests (as with Redis): the shared load view's lookups run")  # fmt: skip
    parser.add_argument("--prefill", type=int, default=0, help="decide this many other keys first, each "
                        "once (untimed): over the pool's memos (65,536) is a long-running gateway")  # fmt: skip
    parser.add_argument("--causes", action="store_true", help="class each first sight by what it did besides "
                        "deciding (grew the pool's per-key tables, took a page fault) and print each class's "
                        "share and p50 / p99")  # fmt: skip
    parser.add_argument("--target-us", type=float, default=20.0, help="report the share of calls over this")
    parser.add_argument("--full", action="store_true", help="no smaller seen-before "
                        f"samples above {FULL_SAMPLES_UP_TO} replicas")  # fmt: skip
    args = parser.parse_args()
    sizes = [int(size) for size in args.replicas.split(",")]
    clocks = [clock for clock in args.clock.split(",") if clock]
    unknown = sorted(set(clocks) - set(CLOCKS))
    if unknown:
        parser.error(f"unknown clocks {unknown}; known: {sorted(CLOCKS)}")
    routing = RoutingConfig()
    print(
        f"one decision on a real Pool: place + release per call (explain alone in its own column); "
        f"{routing.vnodes} vnodes, {args.policy}, {args.keys} keys, adapter resident on "
        f"{RESIDENT_SHARE:.0%} of replicas; cyclic GC disabled while timing; {args.runs} runs per clock, each "
        f"fleet in a fresh process (cells: lowest-highest over the runs); {args.prefill} keys decided first; "
        f"{'shared load view heard from another gateway' if args.shared else 'no Redis'}; "
        f"seed {args.seed}"
    )
    context = multiprocessing.get_context("spawn")
    used: dict[int, Samples] = {}
    for clock in clocks:
        results: dict[int, list[FleetResult]] = {replicas: [] for replicas in sizes}
        loads: list[str] = []
        for _ in range(args.runs):
            before = os.getloadavg()[0]
            for replicas in sizes:
                samples = _samples(replicas, args.keys, args.first_sight, args.calls, args.full)
                with ProcessPoolExecutor(max_workers=1, mp_context=context) as executor:
                    result = executor.submit(
                        run_fleet,
                        replicas,
                        args.keys,
                        samples,
                        args.seed,
                        args.policy,
                        clock,
                        args.prefill,
                        args.shared,
                        args.causes,
                    ).result()
                results[replicas].append(result)
                used[replicas] = result.samples
            loads.append(f"{before:.1f}-{os.getloadavg()[0]:.1f}")
        _print_table(clock, results, args.target_us)
        if args.causes:
            _print_causes(results)
        print(f"load average (1 min) at the start and end of each run: {', '.join(loads)}")
    print("samples used (first sight keys / seen-before calls, their drawn keys decided beforehand / explain calls):")
    for replicas, samples in used.items():
        print(f"{replicas:>8}: {samples.first_sight} / {samples.calls}, {samples.warmed} warmed / {samples.explain}")


def _print_causes(results: dict[int, list[FleetResult]]) -> None:
    """Per fleet and class of first sight (CAUSES): its share of the first sights and its p50 / p99, each the
    lowest-highest over the runs (a run without such first sights leaves the cell's figures out)."""
    print("first sights by what they did besides deciding: share, p50 / p99 (lowest-highest over the runs)")
    for replicas, runs in results.items():
        cells = []
        for cause in CAUSES:
            shares = [100 * r.first_sight_causes.count(cause) / len(r.first_sight_causes) for r in runs]
            times = [
                [us for us, why in zip(r.first_sight_us, r.first_sight_causes, strict=True) if why == cause]
                for r in runs
            ]
            times = [values for values in times if values]
            figures = f" {_p50_p99(times)}" if times else ""
            cells.append(f"{cause or 'neither'} {_span(shares)}%{figures}")
        print(f"{replicas:>8} | " + " | ".join(cells))


def _print_table(clock: str, results: dict[int, list[FleetResult]], target_us: float) -> None:
    over = f"over {target_us:g} us"
    header = (
        f"{'replicas':>8} | {'first sight p50 / p99':>22} | {'seen before p50 / p99':>22} | "
        f"{over + ' (first, seen)':>24} | {'same-length work p50 / p99':>26} | {'explain p50 / p99':>18} | "
        f"{'build (s)':>9} | {'RSS (MB)':>8}"
    )
    print(f"\n{clock} clock, microseconds per call")
    print(header)
    print("-" * len(header))
    for replicas, runs in results.items():
        first = _p50_p99([r.first_sight_us for r in runs])
        seen = _p50_p99([r.seen_before_us for r in runs])
        share = (
            f"{_span([_over(r.first_sight_us, target_us) for r in runs])}%, "
            f"{_span([_over(r.seen_before_us, target_us) for r in runs])}%"
        )
        same = _p50_p99([r.reference_us for r in runs])
        explained = _p50_p99([r.explain_us for r in runs])
        print(
            f"{replicas:>8} | {first:>22} | {seen:>22} | {share:>24} | {same:>26} | {explained:>18} | "
            f"{runs[0].build_s:>9.2f} | {runs[0].rss_growth_mb:>8.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
