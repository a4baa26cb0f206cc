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

Each timed call is ``place`` then ``release`` at once, so loads stay at zero in flight and the picker's bound never
bites (every key goes home): this is the decision's fixed cost, not the cost of spilling. Timing is
``time.perf_counter_ns`` around each call, with the cyclic GC off; p99 and max include the interpreter's noise,
so on a shared machine read p50 first. Each fleet runs in a fresh process, so its build time and RSS growth
(VmRSS from /proc after the measurements, less VmRSS before the pool was built: the pool, its ring and what the
calls left behind, such as reservations and memos) are its own. Above 100 replicas the sample counts shrink in
proportion (``--full`` keeps them) so the default run stays within about three minutes on 2 cores; the counts
used are printed under the table.

    python -m loadtests.bench_decision [--replicas 16,64,256,1000] [--keys 100000] [--calls 50000]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing
import random
import resource
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from backends.base import AdapterRef, Endpoint, EngineLoad, EngineRequest, EngineResponse
from backends.errors import EngineUnavailable
from gateway.config import PoolConfig, ResidencyConfig, RoutingConfig
from gateway.fleet.pool import Pool
from gateway.residency.lifecycle import PoolResidency
from gateway.residency.memory import MemoryStore

ADAPTER = "bench-lora"
RESIDENT_SHARE = 0.10
# Above this many replicas the sample counts shrink in proportion (unless --full).
FULL_SAMPLES_UP_TO = 100


class NullDriver:
    """An EngineDriver with no engine behind it: every replica is healthy, nothing is ever sent."""

    async def prepare_adapter(self, adapter: AdapterRef) -> None:
        return None

    async def load_adapter(self, replica: Endpoint, adapter: AdapterRef) -> None:
        return None

    async def unload_adapter(self, replica: Endpoint, engine_name: str) -> None:
        return None

    async def list_adapters(self, replica: Endpoint) -> set[str] | None:
        return None

    async def send(self, replica: Endpoint, request: EngineRequest) -> EngineResponse:
        raise EngineUnavailable(f"{replica.id}: the null driver sends nothing")

    async def healthy(self, replica: Endpoint) -> bool:
        return True

    async def load_signals(self, replica: Endpoint) -> EngineLoad | None:
        return None

    async def close(self) -> None:
        return None


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
    build_s: float
    rss_growth_mb: float
    samples: Samples


def build_pool(replicas: int, policy: str = "bounded_consistent_hash") -> Pool:
    """A pool of ``replicas`` replicas built as the gateway builds one (and as tests/gateway/fleet's make_pool)."""
    entries = [{"id": f"r{i}", "url": f"http://10.{i // 250}.{i % 250}.1:8000"} for i in range(replicas)]
    config = PoolConfig.model_validate(
        {"name": "bench", "backend": "vllm", "base_model": "tiny-llama", "replicas": entries, "policy": policy}
    )
    endpoints = [Endpoint(entry["id"], entry["url"]) for entry in entries]
    driver = NullDriver()
    residency = PoolResidency(
        "bench", endpoints, driver, MemoryStore(), ResidencyConfig(), max_adapters=4, load_timeout_s=5, shared=False
    )
    return Pool(config, RoutingConfig(), driver, residency)


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


def run_fleet(replicas: int, keys: int, samples: Samples, seed: int, policy: str, clock: str = "wall") -> FleetResult:
    """One fleet, measured in this process (the parent runs each in a fresh one) with ``clock`` (CLOCKS)."""
    timer = CLOCKS[clock]
    rng = random.Random(seed)
    tenants = [f"tenant-{i}" for i in range(keys)]
    first_keys = rng.sample(tenants, samples.first_sight)
    drawn = [tenants[rng.randrange(keys)] for _ in range(samples.calls)]
    explained = drawn[: samples.explain]
    build_pool(1)  # imports and first-use set-up (metrics, validators) outside the build time and RSS growth
    gc.collect()
    rss_before = _rss_mb()

    started = time.perf_counter()
    pool = build_pool(replicas, policy)
    build_s = time.perf_counter() - started
    asyncio.run(pool.probe())  # the start-up probe: every replica up
    assert all(replica.healthy for replica in pool.replicas.values())
    for replica_id in rng.sample(sorted(pool.replicas), max(1, round(RESIDENT_SHARE * replicas))):
        pool.residency.views[replica_id].resident[ADAPTER] = time.time()

    def place_release(key: str) -> None:
        pool.release(pool.place(key, ADAPTER))

    def explain(key: str) -> None:
        pool.explain(key, ADAPTER)

    first_sight = _timed(place_release, first_keys, timer)
    decided = set(first_keys)
    to_warm = [key for key in dict.fromkeys(drawn) if key not in decided]
    for key in to_warm:  # untimed: every drawn key has been decided once
        place_release(key)
    seen_before = _timed(place_release, drawn, timer)
    explain_us = _timed(explain, explained, timer)
    assert pool.in_flight == 0
    rss_growth = _rss_mb() - rss_before
    used = Samples(samples.first_sight, samples.calls, samples.explain, warmed=len(to_warm))
    return FleetResult(replicas, first_sight, seen_before, explain_us, build_s, rss_growth, used)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _samples(replicas: int, keys: int, first_sight: int, calls: int, full: bool) -> Samples:
    scale = 1.0 if full else min(1.0, FULL_SAMPLES_UP_TO / replicas)
    first = max(100, min(keys, round(first_sight * scale)))
    drawn = max(100, round(calls * scale))
    return Samples(first, drawn, max(100, drawn // 5))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", default="16,64,256,1000", help="fleet sizes, comma-separated")
    parser.add_argument("--keys", type=int, default=100_000, help="distinct keys (tenant ids)")
    parser.add_argument("--calls", type=int, default=50_000, help="seen-before decisions per fleet")
    parser.add_argument("--first-sight", type=int, default=20_000, help="first decisions per fleet")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--policy", default=PoolConfig.model_fields["policy"].default, help="the pool's policy "
                        "(default: the config's default)")  # fmt: skip
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall: perf_counter (preemption included); cpu: the thread's CPU time")  # fmt: skip
    parser.add_argument("--full", action="store_true", help=f"no smaller samples above {FULL_SAMPLES_UP_TO} replicas")
    args = parser.parse_args()
    sizes = [int(size) for size in args.replicas.split(",")]
    routing = RoutingConfig()
    print(
        f"one decision on a real Pool: place + release per call (explain alone in its own columns); "
        f"{routing.vnodes} vnodes, {args.policy}, {args.keys} keys, adapter resident on "
        f"{RESIDENT_SHARE:.0%} of replicas; cyclic GC disabled while timing; {args.clock} clock; seed {args.seed}"
    )
    header = (
        f"{'replicas':>8} | {'first sight p50 / p99 / max (us)':>32} | {'seen before p50 / p99 (us)':>26} | "
        f"{'explain p50 / p99 (us)':>22} | {'pool build (s)':>14} | {'RSS growth (MB)':>15}"
    )
    print(header)
    print("-" * len(header))
    results: list[FleetResult] = []
    context = multiprocessing.get_context("spawn")
    for replicas in sizes:
        samples = _samples(replicas, args.keys, args.first_sight, args.calls, args.full)
        with ProcessPoolExecutor(max_workers=1, mp_context=context) as executor:
            result = executor.submit(
                run_fleet, replicas, args.keys, samples, args.seed, args.policy, args.clock
            ).result()
        results.append(result)
        first, seen, explained = result.first_sight_us, result.seen_before_us, result.explain_us
        first_cell = f"{_pct(first, 0.5):.1f} / {_pct(first, 0.99):.1f} / {max(first):.1f}"
        seen_cell = f"{_pct(seen, 0.5):.1f} / {_pct(seen, 0.99):.1f}"
        explain_cell = f"{_pct(explained, 0.5):.1f} / {_pct(explained, 0.99):.1f}"
        print(
            f"{replicas:>8} | {first_cell:>32} | {seen_cell:>26} | {explain_cell:>22} | "
            f"{result.build_s:>14.2f} | {result.rss_growth_mb:>15.1f}",
            flush=True,
        )
    print("samples used (first sight keys / seen-before calls, their drawn keys decided beforehand / explain calls):")
    for result in results:
        used = result.samples
        print(f"{result.replicas:>8}: {used.first_sight} / {used.calls}, {used.warmed} warmed / {used.explain}")


if __name__ == "__main__":
    main()
