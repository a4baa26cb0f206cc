"""A residency store that times every call into the metrics: how long Redis round trips take, and which fail."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Collection
from typing import TypeVar

from gateway.observe.metrics import GatewayMetrics
from gateway.residency.store import ReplicaRecord, ResidencyStore, Uses

T = TypeVar("T")


class TimedStore:
    def __init__(self, inner: ResidencyStore, metrics: GatewayMetrics) -> None:
        self._inner = inner
        self._seconds = metrics.store_operation_seconds

    async def _timed(self, operation: str, call: Awaitable[T]) -> T:
        started, outcome = time.perf_counter(), "unavailable"
        try:
            result = await call
            outcome = "ok"
            return result
        finally:
            self._seconds.labels(operation, outcome).observe(time.perf_counter() - started)

    async def record(self, pool: str, replica: str) -> ReplicaRecord:
        return await self._timed("record", self._inner.record(pool, replica))

    async def acquire(self, pool: str, replica: str, holder: str, ttl_s: float) -> bool:
        return await self._timed("acquire", self._inner.acquire(pool, replica, holder, ttl_s))

    async def renew(self, pool: str, replica: str, holder: str, ttl_s: float) -> bool:
        return await self._timed("renew", self._inner.renew(pool, replica, holder, ttl_s))

    async def release(self, pool: str, replica: str, holder: str) -> None:
        await self._timed("release", self._inner.release(pool, replica, holder))

    async def break_lock(self, pool: str, replica: str, owned_by: str, unless: str) -> bool:
        return await self._timed("break_lock", self._inner.break_lock(pool, replica, owned_by, unless))

    async def add(self, pool: str, replica: str, adapter: str, used_at: float, *, pinned: bool = False) -> None:
        await self._timed("add", self._inner.add(pool, replica, adapter, used_at, pinned=pinned))

    async def remove(self, pool: str, replica: str, adapters: Collection[str]) -> None:
        await self._timed("remove", self._inner.remove(pool, replica, adapters))

    async def touch(self, uses: Uses) -> None:
        await self._timed("touch", self._inner.touch(uses))

    async def reconcile(self, pool: str, replica: str, on_engine: Collection[str], now: float) -> ReplicaRecord:
        return await self._timed("reconcile", self._inner.reconcile(pool, replica, on_engine, now))

    async def clock(self) -> float | None:
        return await self._timed("clock", self._inner.clock())

    async def ping(self) -> None:
        await self._timed("ping", self._inner.ping())

    async def close(self) -> None:
        await self._inner.close()
