"""The routing decision's code warmed once at start-up, on throw-away pools, before the tenant listener opens.

Why: a process's first decisions are its slowest. CPython 3.11 specialises each bytecode of a function after it has
run a few times (and builds its inline caches then), so the first request a gateway routes took 155-400 us and the
next eight 25-50 us, against 10-12 us once warm (make bench-decision's first sights, per call, docs/benchmarks.md).
Those are the first tenants' requests after every start and every new worker. The code is shared by every pool of a
policy, so running it on a pool nobody routes to warms it for all of them: in a fresh process at 64 replicas the
first decision then took 77-110 us and the next eight 13-27 us.

How: per pool of the fleet, a pool of ``REPLICAS`` replicas of the same policy and routing settings, over a driver
that reaches no engine, decides ``DECISIONS`` requests (a few keys, each seen first and then again; with the
adapter resident on one replica, scraped, and without an adapter) and releases each. Nothing it makes outlives the
call: the real pools are not touched (no key, no reservation, no load), and the throw-away pool takes the real
pool's name and its metrics object, so the only metric children it asks for (the residency's lookup counters, made
when a residency is built) are the real pool's own, already made, and nothing counts a decision (a lease would: it
is not taken). tests/gateway/fleet/test_warm_up.py holds this.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from backends.base import AdapterRef, Endpoint, EngineLoad, EngineRequest, EngineResponse
from backends.errors import EngineUnavailable
from gateway.config import PoolConfig, RoutingConfig
from gateway.fleet.pool import Pool
from gateway.residency.lifecycle import PoolResidency
from gateway.residency.memory import MemoryStore

REPLICAS = 2
# Enough for each bytecode of the decision's paths to be specialised (a few runs each) on both kinds of decision.
DECISIONS = 30
_KEYS = 10
_ADAPTER = "warm-up-adapter"
IDLE = EngineLoad(running=0, waiting=0, kv_cache_usage=0.0, running_adapters=frozenset(), gpu_slots=1)


class NoEngine:
    """An EngineDriver that reaches no engine: every replica answers healthy and idle, nothing is sent. Also the
    decision benchmarks' driver (loadtests/bench_decision.py)."""

    async def prepare_adapter(self, adapter: AdapterRef) -> None:
        return None

    async def load_adapter(self, replica: Endpoint, adapter: AdapterRef) -> None:
        return None

    async def unload_adapter(self, replica: Endpoint, engine_name: str) -> None:
        return None

    async def list_adapters(self, replica: Endpoint) -> set[str] | None:
        return None

    async def send(self, replica: Endpoint, request: EngineRequest) -> EngineResponse:
        raise EngineUnavailable(f"{replica.id}: the warm-up sends nothing")

    async def healthy(self, replica: Endpoint) -> bool:
        return True

    async def load_signals(self, replica: Endpoint) -> EngineLoad | None:
        return IDLE

    async def close(self) -> None:
        return None


def throwaway(pool: Pool, routing: RoutingConfig) -> Pool:
    """A pool of ``REPLICAS`` replicas like ``pool`` (its name, policy and metrics; ``routing``), every replica up
    and scraped idle, the warm-up's adapter resident on the last one."""
    entries = [{"id": f"warm-up-{i}", "url": f"http://127.0.0.{i + 1}:1"} for i in range(REPLICAS)]
    config = PoolConfig.model_validate(
        {"name": pool.name, "backend": "vllm", "base_model": "warm-up", "replicas": entries, "policy": pool.policy}
    )
    driver = NoEngine()
    endpoints = [Endpoint(entry["id"], entry["url"]) for entry in entries]
    residency = PoolResidency(
        pool.name, endpoints, driver, MemoryStore(), pool.residency.config, max_adapters=4, load_timeout_s=1.0,
        shared=False, metrics=pool.residency.metrics,
    )  # fmt: skip
    twin = Pool(config, routing, driver, residency)
    twin.took_probes({entry["url"]: True for entry in entries})
    twin.took_scrape(time.monotonic(), dict.fromkeys(twin.replicas, IDLE))
    residency.views[entries[-1]["id"]].resident[_ADAPTER] = time.time()
    return twin


def decisions(pools: Iterable[Pool], routing: RoutingConfig) -> int:
    """Warm the decision path of each of ``pools``' policies (see the module docstring); returns the decisions
    taken. Once per process, at start-up (gateway/server.py)."""
    taken = 0
    warmed: set[str] = set()
    for pool in pools:
        if pool.policy in warmed:  # the code is the policy's, not the pool's
            continue
        warmed.add(pool.policy)
        twin = throwaway(pool, routing)
        for i in range(DECISIONS):
            decision = twin.place(f"warm-up-{i % _KEYS}", _ADAPTER if i % 3 else None)
            if decision.chosen is not None:
                twin.release(decision)
            taken += 1
    return taken
