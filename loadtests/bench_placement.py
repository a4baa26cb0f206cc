"""What homes from traffic cost: the leader's CPU to plan a pool per interval, and the Redis bytes per interval.

CPU: ``plan`` (gateway/placement/plan.py) on one pool of R replicas and K keys with balanced homes to start
from, Zipf loads whose two heaviest keys share a home, the default settings (4 moves); each size planned
``--repeats`` times from the same start, median and max in milliseconds. What the leader does besides (the
warm-up checks, encoding the table) is linear in the keys the table holds, which is at most the keys that moved.

Redis: a real redis-server (``redis-server`` on PATH); G gateways each make the interval's poll (one script call)
on a table of T placed keys, measured by the server's own counters (INFO stats: total_net_input_bytes and
total_net_output_bytes, less those of the INFO calls themselves): an interval where the table did not change (the
reply carries the version alone), and one where the leader publishes a new version (the others then read it).

    python -m loadtests.bench_placement [--repeats 20] [--gateways 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator

import redis.asyncio

from gateway.placement.plan import PlanInput, PlanSettings, plan
from gateway.placement.store import RedisHomesStore
from gateway.placement.table import HomesTable, PoolTable
from gateway.redis_client import make_client
from gateway.routing.ring import Ring
from loadtests.processes import free_port

SIZES = ((4, 16), (16, 200), (16, 2000), (64, 2000), (64, 10_000))


def plan_input(replicas: int, keys: int, seed: int = 17) -> PlanInput:
    ids = [f"r{i}" for i in range(replicas)]
    ring = Ring(ids, vnodes=160)
    names = [f"tenant-{i}" for i in range(keys)]
    ring.balance(names)
    rng = random.Random(seed)
    rng.shuffle(names)
    loads = {name: 100 / (rank + 1) ** 1.1 for rank, name in enumerate(names)}
    # The two heaviest on one replica: the plan has a move to make.
    heavy, second = names[0], names[1]
    current = {second: (ring.home(heavy),)}
    return PlanInput(ids, loads, current, ring.home, known=names, now=0.0)


def plan_cost(replicas: int, keys: int, repeats: int) -> tuple[float, float, int]:
    given, settings = plan_input(replicas, keys), PlanSettings()
    times, moves = [], 0
    for _ in range(repeats):
        started = time.perf_counter()
        result = plan(given, settings)
        times.append(1000 * (time.perf_counter() - started))
        moves = len(result.changes)
    return statistics.median(times), max(times), moves


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        process = subprocess.Popen(
            ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no", "--dir", tmp],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            for _ in range(100):  # bounded: until it accepts connections
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
                time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}"
        finally:
            process.terminate()
            process.wait(timeout=10)


async def net_bytes(client: redis.asyncio.Redis) -> int:
    stats = await client.info("stats")
    return int(stats["total_net_input_bytes"]) + int(stats["total_net_output_bytes"])


def table(version: int, keys: int) -> HomesTable:
    homes = {f"tenant-{i}": (f"r{i % 16}", f"r{(i + 1) % 16}") if i < 3 else (f"r{i % 16}",) for i in range(keys)}
    why = {key: "balance: 12.5 req/s from r3 (40.2) to r7 (18.1)" for key in homes}
    return HomesTable(version, "gw-0", {"llama": PoolTable(homes, why=why)}, moves=4)


async def redis_bytes(url: str, gateways: int, placed: int) -> tuple[float, float, int]:
    """Bytes per gateway for an interval without a change and one with a new version; the table's size."""
    probe = redis.asyncio.Redis.from_url(url)
    stores = [
        RedisHomesStore(make_client(url, 2.0), operation_timeout_s=2.0, lease_s=30.0, prefix=f"bench{placed}")
        for _ in range(gateways)
    ]
    try:
        await stores[0].poll("gw-0", 0)  # gw-0 leads
        await stores[0].publish("gw-0", table(1, placed))
        for index, store in enumerate(stores):  # every script cached, every gateway at version 1
            await store.poll(f"gw-{index}", 1)
        info_cost = await net_bytes(probe) - await net_bytes(probe)  # negative: what one INFO pair adds
        before = await net_bytes(probe)
        for index, store in enumerate(stores):
            await store.poll(f"gw-{index}", 1)
        quiet = (await net_bytes(probe) - before + info_cost) / gateways
        before = await net_bytes(probe)
        await stores[0].publish("gw-0", table(2, placed))
        for index, store in enumerate(stores):
            await store.poll(f"gw-{index}", 1 if index else 2)
        changed = (await net_bytes(probe) - before + info_cost) / gateways
        stored = await probe.get(stores[0].keys[1])
        return quiet, changed, len(stored or b"")
    finally:
        for store in stores:
            await store.close()
        await probe.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--gateways", type=int, default=3)
    args = parser.parse_args(argv)
    print("| replicas | keys | plan p50 | plan max | keys changed |")
    print("|---|---|---|---|---|")
    for replicas, keys in SIZES:
        p50, worst, moves = plan_cost(replicas, keys, args.repeats)
        print(f"| {replicas} | {keys} | {p50:.2f} ms | {worst:.2f} ms | {moves} |")
    print()
    print(f"| keys in the table | per gateway, no change | per gateway, new version ({args.gateways}) | table |")
    print("|---|---|---|---|")
    with redis_server() as url:
        for placed in (8, 100, 1000):
            quiet, changed, size = asyncio.run(redis_bytes(url, args.gateways, placed))
            print(f"| {placed} | {quiet:.0f} B | {changed:.0f} B | {size} B |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
