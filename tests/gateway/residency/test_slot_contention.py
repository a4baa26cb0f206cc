"""Slot contention between gateways never fails a request the engine would serve.

Two gateways share Redis and a fleet of 2 simulated vLLM replicas whose working set the gateways bound at 2
adapters; 8 tenants, one adapter each, arrive cold and all at once from 16 clients alternating between the
gateways, then keep up steady traffic. vLLM queues a request whose adapter has no slot rather than refuse it, so
the gateways' own bound must not refuse one either: every request is answered 200, none waits past its client's
deadline. (Before the fix, each such burst failed 3-9 requests with 503 "no room for another adapter" and hung
others for the load timeout. This end-to-end run did not fail on that code in four tries on this machine; the
mechanism behind it, a load waiting for a slot while holding the lock the slots' holders need, is pinned down
deterministically in test_lifecycle.py, which does fail on that code.)
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import openai
import pytest

from loadtests.fleet import api_key
from tests.gateway.residency.test_residency_e2e import two_gateways
from tests.redis_server import RedisServer

pytestmark = pytest.mark.timeout(240)

TENANTS = {f"t{i}": [f"adapter-t{i}"] for i in range(8)}
# Real time: a cold load takes 400 ms and a request tens of ms, so the burst's adapters hold their slots long
# enough to contend for them (at the suites' usual 0.01 time scale the burst is over before it contends).
SIM = ("--time-scale", "1", "--max-loras", "2", "--max-cpu-loras", "2")
CLIENTS = 16
MAX_TOKENS = 16
BURST = 48
STEADY_S = 60.0
# A client gives up after this: a request the gateway held (waiting for a slot, or for a lock) longer fails.
CLIENT_TIMEOUT_S = 20.0


async def one(gateway: str, tenant: str, outcomes: Counter[str]) -> None:
    client = openai.AsyncOpenAI(
        base_url=gateway + "/v1", api_key=api_key(tenant), max_retries=0, timeout=CLIENT_TIMEOUT_S
    )
    try:
        await client.completions.create(model=f"adapter-{tenant}", prompt="hello", max_tokens=MAX_TOKENS)
        outcomes["200"] += 1
    except openai.APIStatusError as exc:
        outcomes[f"{exc.status_code} {exc.message}"] += 1
    except openai.APIConnectionError as exc:  # a timeout included: the request hung
        outcomes[f"lost: {type(exc).__name__}"] += 1
    finally:
        await client.close()


async def burst(gateways: list[str], outcomes: Counter[str]) -> None:
    slots = asyncio.Semaphore(CLIENTS)
    tenants = list(TENANTS)

    async def request(index: int) -> None:
        async with slots:
            await one(gateways[index % 2], tenants[index % len(tenants)], outcomes)

    await asyncio.gather(*(request(index) for index in range(BURST)))


async def steady(gateways: list[str], outcomes: Counter[str]) -> None:
    stop = time.monotonic() + STEADY_S
    tenants = list(TENANTS)

    async def client(index: int) -> None:
        sent = 0
        while time.monotonic() < stop:
            await one(gateways[(index + sent) % 2], tenants[(index + sent) % len(tenants)], outcomes)
            sent += 1

    await asyncio.gather(*(client(index) for index in range(CLIENTS)))


def test_a_cold_burst_over_full_slots_fails_nothing_the_engine_would_serve(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    with two_gateways(tmp_path, TENANTS, 2, redis_server.url, sim_args=SIM) as (_, gateways):
        cold: Counter[str] = Counter()
        asyncio.run(burst(gateways, cold))
        assert cold == Counter({"200": BURST}), cold
        after: Counter[str] = Counter()
        asyncio.run(steady(gateways, after))
        assert set(after) == {"200"}, after
