"""The residency record's interface: per pool and replica, the adapters resident there, when each was last used,
which are pinned, and the lock that serialises loads and evictions on the replica.

Two implementations: ``memory.MemoryStore`` (one gateway, the embedded default) and ``redis.RedisStore`` (several
gateways sharing one Redis). Adapters are recorded by the name the engine knows them by (``engine_name``), because
reconciliation compares the record with what the engine lists, and an adapter loaded by hand has no catalog name.

Contract (both implementations pass one test suite, tests/gateway/residency/test_store.py):
- every method that changes more than one key does so atomically;
- ``touch`` only moves an existing adapter's last-use time forward, never re-adds an evicted one;
- the replica lock is held by one owner at a time and lapses after ``ttl_s`` unless its owner renews it;
- a failure to reach the store raises ``StoreUnavailable`` and nothing else.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Protocol

# A last use stamped further than this in the future of the store's clock came from a clock that jumped (Redis' own,
# ahead and back, or an offset learned from it meanwhile): reconciliation sets it to now, and a gateway's view does
# not keep such a mark of its own over the record's. Last uses only move forward (ZADD GT), so one such mark kept its
# adapter "just used", never evicted, until the real time caught up with it.
FUTURE_MARK_S = 10.0


class StoreUnavailable(Exception):
    """The store could not be reached or answered with an error; the caller falls back to its local view."""


@dataclass(frozen=True)
class ReplicaRecord:
    # engine adapter name -> last use, unix seconds
    resident: dict[str, float] = field(default_factory=dict)
    pinned: frozenset[str] = frozenset()
    # "owner adapter" of the load or eviction holding the replica's lock, if any
    lock_holder: str | None = None
    # The keys of this record (resident, pinned, lock) the store found of another type and deleted, as it read or in
    # a write since the last read (gateway/residency/redis.py): the record lacks what they held, and the lifecycle
    # rebuilds it from the engine.
    repaired: frozenset[str] = frozenset()


# A use to write behind: (pool, replica, engine adapter name) -> unix seconds.
Uses = Mapping[tuple[str, str, str], float]


class ResidencyStore(Protocol):
    async def record(self, pool: str, replica: str) -> ReplicaRecord: ...

    async def acquire(self, pool: str, replica: str, holder: str, ttl_s: float) -> bool:
        """Take the replica's lock for ``holder`` ("gateway-id adapter"); False when someone else holds it."""
        ...

    async def renew(self, pool: str, replica: str, holder: str, ttl_s: float) -> bool:
        """Push the lock's expiry ``ttl_s`` out, only while ``holder`` holds it (never re-take a lapsed or released
        one: a renewal that lands after its holder's release must not lock the replica again); False otherwise."""
        ...

    async def release(self, pool: str, replica: str, holder: str) -> None:
        """Give the lock back, only if ``holder`` still holds it."""
        ...

    async def break_lock(self, pool: str, replica: str, owned_by: str, unless: str) -> bool:
        """Delete the replica's lock if its holder begins with ``owned_by`` and not with ``unless`` (a dead
        predecessor of this process: gateway/residency/owner.py); whether it did."""
        ...

    async def add(self, pool: str, replica: str, adapter: str, used_at: float, *, pinned: bool = False) -> None: ...

    async def remove(self, pool: str, replica: str, adapters: Collection[str]) -> None:
        """Forget adapters on a replica (unloaded): resident entry and pin together."""
        ...

    async def touch(self, uses: Uses) -> None:
        """Write last-use times behind, in one batch; adapters not resident are left out."""
        ...

    async def reconcile(self, pool: str, replica: str, on_engine: Collection[str], now: float) -> ReplicaRecord:
        """Make the record say exactly ``on_engine``: keep known last uses (set to ``now`` those more than
        ``FUTURE_MARK_S`` after it), add newcomers at ``now``, drop the rest with their pins; return the record as
        it was before."""
        ...

    async def clock(self) -> float | None:
        """The store's own time, unix seconds, which gateways sharing it stamp use times by (their clocks may
        disagree by minutes); None when the store keeps none (in-process: one gateway, its own clock)."""
        ...

    async def ping(self) -> None: ...

    async def close(self) -> None: ...
