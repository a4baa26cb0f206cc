"""How soon a slot another gateway frees ends a wait for it: the slot signal through a real redis-server.

Two gateways' adapter lifecycles (``PoolResidency``) share one replica whose working set holds one adapter, each
with its own Redis store client and its own slot signal channel (gateway/residency/signal_redis.py), in one
process and one event loop, over a driver that does nothing (``bench_decision.NullDriver``). The in-use window is
10 s and the slot wait 30 s, so only the release can end a wait. Each round: A loads an adapter and holds it (a
request in flight); B's load of another waits for the slot; once A has heard B's wait and B's held sets have
settled, A's request ends (``end_use``: the release). Measured from that call:

- woken: B's wait returns (it looks again under the replica's lock);
- served: B's load is done (lock, record read, the eviction of A's adapter, the load, the record written).

Both gateways share one event loop here, so a publish and the delivery it causes take turns on it: in two
processes the wake-up would not wait for A's own work. Redis on loopback.

    python -m loadtests.bench_slot_release [--rounds 300]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

from backends.base import AdapterRef, Endpoint
from gateway.config import ResidencyConfig
from gateway.observe.metrics import GatewayMetrics
from gateway.residency.lifecycle import PoolResidency
from gateway.residency.redis import RedisStore
from gateway.residency.signal import SETTLE_S, SlotSignal
from gateway.residency.signal_redis import RedisSlotChannel
from gateway.residency.store import ReplicaRecord
from loadtests.bench_decision import NullDriver
from loadtests.bench_routing import redis_for

CONFIG = ResidencyConfig(use_flush_interval_s=2.5, slot_wait_timeout_s=30.0)


class TimedWait(PoolResidency):
    """A lifecycle that notes when each of its waits for a slot returns."""

    woken_at: list[float]

    async def _wait_for_room(self, replica_id: str, record: ReplicaRecord, give_up_at: float, news: int) -> None:
        await super()._wait_for_room(replica_id, record, give_up_at, news)
        self.woken_at.append(time.perf_counter())


@contextlib.asynccontextmanager
async def gateway(url: str, prefix: str) -> AsyncIterator[tuple[TimedWait, SlotSignal]]:
    metrics = GatewayMetrics()
    store = RedisStore(url, prefix=prefix)
    slots = RedisSlotChannel(url, metrics, operation_timeout_s=1.0, prefix=prefix)
    following = asyncio.create_task(slots.run())
    life = TimedWait(
        "llama", [Endpoint("r0", "http://r0")], NullDriver(), store, CONFIG, max_adapters=1, load_timeout_s=30,
        shared=True, metrics=metrics, signal=slots.signal,
    )  # fmt: skip
    life.woken_at = []
    try:
        yield life, slots.signal
    finally:
        following.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await following
        await slots.close()
        await store.close()


async def until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(10_000):  # bounded: about 10 s
        if condition():
            return
        await asyncio.sleep(0.001)
    raise RuntimeError(f"never: {what}")


async def measure(url: str, rounds: int) -> tuple[list[float], list[float], int]:
    woken, served, skipped = [], [], 0
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    async with gateway(url, prefix) as (a, a_signal), gateway(url, prefix) as (b, b_signal):
        await until(lambda: a_signal.listening and b_signal.listening, "both subscribed")
        for index in range(rounds):
            held, wanted = f"a{index}", f"b{index}"
            await a.ensure("r0", AdapterRef(held, f"/loras/{held}"))
            a.begin_use("r0", held)
            waiting = asyncio.create_task(b.ensure("r0", AdapterRef(wanted, f"/loras/{wanted}")))
            await until(lambda: a_signal.remote_waiting("llama", "r0"), "A hears B's wait")
            settled = frozenset({held})
            await until(lambda: b_signal.remote_holds("llama", "r0") == settled, "B's wait settles")  # noqa: B023
            # Past B's settle wake and the look it causes: B waits again, and the next wake is the release's.
            await asyncio.sleep(SETTLE_S + 0.01)
            await until(lambda: b.slot_waiters["r0"] == 1, "B waits")
            b.woken_at.clear()
            released = time.perf_counter()
            a.end_use("r0", held)
            await waiting
            done = time.perf_counter()
            if b.woken_at:
                served.append(done - released)
                woken.append(b.woken_at[0] - released)
            else:
                skipped += 1  # B was looking under the lock when the release came, and found room at once
            b.begin_use("r0", wanted)  # B's request runs and ends: r0 is idle again for the next round
            b.end_use("r0", wanted)
            await asyncio.sleep(0.01)  # past the unloaded adapter's release, so the next round starts clean
    return woken, served, skipped


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def print_ms(rows: Sequence[tuple[str, list[float]]], width: int, decimals: int) -> None:
    """Per row, its durations (seconds) as p50, p90, p99, max and mean in milliseconds."""
    print(" " * width + "".join(f"{name:>8}" for name in ("p50", "p90", "p99", "max", "mean")))
    for name, values in rows:
        ms = [v * 1000 for v in values]
        figures = [_pct(ms, 0.5), _pct(ms, 0.9), _pct(ms, 0.99), max(ms), statistics.fmean(ms)]
        print(f"{name:{width}}" + "".join(f"{f:8.{decimals}f}" for f in figures))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root, redis_for(Path(root)) as url:
        woken, served, skipped = asyncio.run(measure(url, args.rounds))
    print(f"{len(woken)} releases through Redis ({skipped} rounds left out: B was not waiting), ms from A's end_use:")
    print_ms((("woken", woken), ("served", served)), 8, 2)


if __name__ == "__main__":
    main()
