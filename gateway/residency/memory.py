"""The in-process residency store: the embedded default for a single gateway."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from gateway.residency.store import FUTURE_MARK_S, ReplicaRecord, Uses


@dataclass
class _Replica:
    resident: dict[str, float] = field(default_factory=dict)
    pinned: set[str] = field(default_factory=set)
    holder: str | None = None
    held_until: float = 0.0


class MemoryStore:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._replicas: dict[tuple[str, str], _Replica] = {}

    def _replica(self, pool: str, replica: str) -> _Replica:
        return self._replicas.setdefault((pool, replica), _Replica())

    async def record(self, pool: str, replica: str) -> ReplicaRecord:
        state = self._replica(pool, replica)
        holder = state.holder if state.held_until > self._clock() else None
        return ReplicaRecord(dict(state.resident), frozenset(state.pinned), holder)

    async def acquire(self, pool: str, replica: str, holder: str, ttl_s: float) -> bool:
        state = self._replica(pool, replica)
        now = self._clock()
        if state.holder is not None and state.held_until > now and state.holder != holder:
            return False
        state.holder, state.held_until = holder, now + ttl_s
        return True

    async def renew(self, pool: str, replica: str, holder: str, ttl_s: float) -> bool:
        state = self._replica(pool, replica)
        now = self._clock()
        if state.holder != holder or state.held_until <= now:
            return False
        state.held_until = now + ttl_s
        return True

    async def release(self, pool: str, replica: str, holder: str) -> None:
        state = self._replica(pool, replica)
        if state.holder == holder:
            state.holder = None

    async def break_lock(self, pool: str, replica: str, owned_by: str, unless: str) -> bool:
        state = self._replica(pool, replica)
        holder = state.holder if state.held_until > self._clock() else None
        if holder is None or not holder.startswith(owned_by) or holder.startswith(unless):
            return False
        state.holder = None
        return True

    async def add(self, pool: str, replica: str, adapter: str, used_at: float, *, pinned: bool = False) -> None:
        state = self._replica(pool, replica)
        state.resident[adapter] = max(used_at, state.resident.get(adapter, 0.0))
        if pinned:
            state.pinned.add(adapter)

    async def remove(self, pool: str, replica: str, adapters: Collection[str]) -> None:
        state = self._replica(pool, replica)
        for adapter in adapters:
            state.resident.pop(adapter, None)
            state.pinned.discard(adapter)

    async def touch(self, uses: Uses) -> None:
        for (pool, replica, adapter), used_at in uses.items():
            resident = self._replica(pool, replica).resident
            if adapter in resident:
                resident[adapter] = max(used_at, resident[adapter])

    async def reconcile(self, pool: str, replica: str, on_engine: Collection[str], now: float) -> ReplicaRecord:
        before = await self.record(pool, replica)
        state = self._replica(pool, replica)
        present = set(on_engine)
        latest = now + FUTURE_MARK_S  # a mark from a clock that jumped is set to now
        state.resident = {
            adapter: used if (used := state.resident.get(adapter, now)) <= latest else now for adapter in present
        }
        state.pinned &= present
        return before

    async def clock(self) -> float | None:
        return None  # one gateway: its own clock is the only one

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None
