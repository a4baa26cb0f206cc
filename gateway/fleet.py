"""The pools of replicas the gateway routes to: their rings, in-flight loads, health and drivers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from backends.base import Endpoint, EngineDriver
from backends.vllm import VllmDriver
from gateway.config import GatewayConfig, PoolConfig, RoutingConfig
from gateway.routing.decision import ReplicaLoad, RoutingDecision
from gateway.routing.policies import decide
from gateway.routing.reservations import HomeReservations
from gateway.routing.ring import Ring

log = logging.getLogger(__name__)


@dataclass
class Replica:
    endpoint: Endpoint
    healthy: bool = True
    in_flight: int = 0


class Pool:
    def __init__(self, config: PoolConfig, routing: RoutingConfig, driver: EngineDriver) -> None:
        self.config = config
        self.name = config.name
        self.driver = driver
        self.balance_factor = routing.balance_factor
        self.replicas = {r.id: Replica(Endpoint(r.id, str(r.url).rstrip("/"))) for r in config.replicas}
        self.ring = Ring(list(self.replicas), routing.vnodes)
        reserve = config.policy == "bounded_consistent_hash"
        self.reservations = HomeReservations(routing.home_reservation_s if reserve else 0.0)
        self._ticks = 0

    def explain(self, key: str) -> RoutingDecision:
        """The decision ``place`` would take for ``key`` now, without taking it (for /admin/route)."""
        return self._decide(key)

    def place(self, key: str) -> RoutingDecision:
        """Decide where ``key``'s request goes and count it there; every placed decision must be released."""
        self._ticks += 1
        decision = self._decide(key)
        if decision.chosen is not None:
            self.replicas[decision.chosen].in_flight += 1
            self.reservations.arrived(key, decision.home, decision.chosen)
        return decision

    def release(self, decision: RoutingDecision) -> None:
        assert decision.chosen is not None
        self.replicas[decision.chosen].in_flight -= 1
        self.reservations.finished(decision.key, decision.chosen)

    def _decide(self, key: str) -> RoutingDecision:
        reservations = self.reservations
        reservations.expire()
        loads = [
            ReplicaLoad(r.endpoint.id, r.healthy, r.in_flight, reservations.reserved(r.endpoint.id))
            for r in self.replicas.values()
        ]
        return decide(
            self.ring,
            key,
            loads,
            pool=self.name,
            policy=self.config.policy,
            balance_factor=self.balance_factor,
            tick=self._ticks,
            standing=reservations.standing(key),
        )

    @property
    def any_healthy(self) -> bool:
        return any(replica.healthy for replica in self.replicas.values())

    async def probe(self) -> None:
        results = await asyncio.gather(*(self.driver.healthy(r.endpoint) for r in self.replicas.values()))
        for replica, healthy in zip(self.replicas.values(), results, strict=True):
            if healthy != replica.healthy:
                log.warning("replica %s/%s is now %s", self.name, replica.endpoint.id, "up" if healthy else "down")
            replica.healthy = healthy


def make_driver(config: PoolConfig) -> EngineDriver:
    return VllmDriver(
        connect_timeout_s=config.connect_timeout_s,
        request_timeout_s=config.request_timeout_s,
        adapter_load_timeout_s=config.adapter_load_timeout_s,
        max_connections_per_replica=config.max_connections_per_replica,
    )


class Fleet:
    def __init__(self, config: GatewayConfig) -> None:
        self.pools = {p.name: Pool(p, config.routing, make_driver(p)) for p in config.pools}
        self._probes: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Probe every replica once (so readiness is true from the start), then keep probing in the background."""
        await asyncio.gather(*(pool.probe() for pool in self.pools.values()))
        self._probes = [
            asyncio.create_task(self._probe_forever(p), name=f"probe {p.name}") for p in self.pools.values()
        ]

    async def _probe_forever(self, pool: Pool) -> None:
        while True:
            await asyncio.sleep(pool.config.health_interval_s)
            try:
                await pool.probe()
            except Exception:  # a probe bug must not end probing for the pool
                log.exception("health probe of pool %s failed", pool.name)

    async def close(self) -> None:
        for task in self._probes:
            task.cancel()
        for task in self._probes:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.gather(*(pool.driver.close() for pool in self.pools.values()))

    @property
    def unready_pools(self) -> list[str]:
        return [name for name, pool in self.pools.items() if not pool.any_healthy]
