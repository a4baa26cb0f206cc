"""The residency store in Redis, shared by several gateways (the semantics of ``memory.MemoryStore``, exactly).

Key layout, per pool and replica; the braces are a Redis Cluster hash tag, so one replica's keys share a slot and
a transaction or script may touch them together (``{prefix}:{{pool:replica}}`` is the f-string
``f"{prefix}:{{{pool}:{replica}}}"``, e.g. ``tg:{llama:r0}:resident``):

- ``{prefix}:{{pool:replica}}:resident`` ZSET: engine adapter name -> last use, unix seconds on Redis' clock;
- ``{prefix}:{{pool:replica}}:pinned``   SET: engine adapter names pinned on the replica;
- ``{prefix}:{{pool:replica}}:lock``     STRING: the lock's holder ("gateway-id adapter"), with a PX expiry.

Last-use times only move forward (``ZADD GT``); ``touch`` never re-adds an evicted adapter (``ZADD XX GT``); the
lock is ``SET NX PX`` (re-taken by its holder, which refreshes the ttl), renewed by compare-and-``PEXPIRE`` while
its holder works, and given back by compare-and-delete; every
change to more than one key is one Lua script (a touch's ZADDs aside). The client does not retry: each operation is
bounded by ``operation_timeout_s``, and any Redis error or timeout becomes ``StoreUnavailable``.

The gateway owns these keys. One of another type (someone SET a string where the resident ZSET lives) is deleted by
the script that meets it, which says so (``ReplicaRecord.repaired``; logged, and counted in
``tenantgate_redis_key_repairs_total{store="residency"}``): the lifecycle rebuilds that replica's record from its
engine's listing at its next sync. Before, every call on the replica raised WRONGTYPE, which is
``StoreUnavailable``: the pool's store counted as down (routing from the local view, ``/readyz`` saying so) until
an operator deleted the key. A touch (``ZADD XX``) skips such a key: the next read repairs it. A write (an add, a
remove) that repaired one kept only its own change, so the replica's next read says that repair too.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Collection
from contextlib import AbstractAsyncContextManager
from typing import Any, cast

from redis.exceptions import ResponseError

from gateway.observe.metrics import GatewayMetrics
from gateway.redis_client import NO_ACCESS, OWNED_LUA, KeyRepairs, RedisAccess, make_client, redis_call
from gateway.residency.store import FUTURE_MARK_S, ReplicaRecord, Uses

log = logging.getLogger(__name__)

# A TIME reply further than this from the gateway's own clock is not a clock (a year 1970 or 2100 answer): the last
# offset is kept. Far wider than any skew between hosts whose clocks are kept at all.
MAX_CLOCK_GAP_S = 86_400.0

# Every script begins with OWNED_LUA (gateway/redis_client.py) and answers ``repaired`` as its last item
# (``_repaired``): a lock of another type is held by no gateway; a resident or pinned key of another type holds
# nothing this version can read.

# KEYS: lock; ARGV: holder, ttl in ms. 1 when the holder has the lock (taken, or re-taken with its ttl refreshed).
_ACQUIRE = """
owned(1, 'string')
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return {1, repaired}
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, repaired}
end
return {0, repaired}
"""

# KEYS: lock; ARGV: holder, ttl in ms. Pushes the expiry out only while the holder holds the lock: 1, else 0.
_RENEW = """
owned(1, 'string')
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return {redis.call('PEXPIRE', KEYS[1], ARGV[2]), repaired}
end
return {0, repaired}
"""

# KEYS: lock; ARGV: holder. Deletes the lock only if the holder still holds it.
_RELEASE = """
owned(1, 'string')
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return {redis.call('DEL', KEYS[1]), repaired}
end
return {0, repaired}
"""

# KEYS: lock; ARGV: a prefix, an exception. Deletes the lock if its holder begins with the first and not the second.
_BREAK = """
owned(1, 'string')
local holder = redis.call('GET', KEYS[1])
if holder and string.sub(holder, 1, #ARGV[1]) == ARGV[1] and string.sub(holder, 1, #ARGV[2]) ~= ARGV[2] then
  return {redis.call('DEL', KEYS[1]), repaired}
end
return {0, repaired}
"""

# KEYS: resident, pinned; ARGV: last use, adapter, "1" to pin it. The adapter recorded (its last use only forward).
_ADD = """
owned(1, 'zset')
owned(2, 'set')
redis.call('ZADD', KEYS[1], 'GT', ARGV[1], ARGV[2])
if ARGV[3] == '1' then
  redis.call('SADD', KEYS[2], ARGV[2])
end
return {0, repaired}
"""

# KEYS: resident, pinned; ARGV: adapters. Forgets them, resident entry and pin together.
_REMOVE = """
owned(1, 'zset')
owned(2, 'set')
redis.call('ZREM', KEYS[1], unpack(ARGV))
redis.call('SREM', KEYS[2], unpack(ARGV))
return {0, repaired}
"""

# KEYS: resident, pinned, lock; ARGV: now, then the adapters on the engine.
# Returns the record as it was ({member, score, ...}, {pinned...}, holder or nil), then makes resident exactly the
# adapters on the engine (known last uses kept, newcomers at now; a last use more than FUTURE_MARK_S after now is
# set to now: see ``FUTURE_MARK_S``) and drops the pins of the adapters gone.
_RECONCILE = """
owned(1, 'zset')
owned(2, 'set')
owned(3, 'string')
local resident = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
local pinned = redis.call('SMEMBERS', KEYS[2])
local holder = redis.call('GET', KEYS[3])
local present = {}
for i = 2, #ARGV do
  present[ARGV[i]] = true
end
for i = 1, #resident, 2 do
  if not present[resident[i]] then
    redis.call('ZREM', KEYS[1], resident[i])
  end
end
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], 'NX', ARGV[1], ARGV[i])
end
local latest = tonumber(ARGV[1]) + FUTURE_MARK_S
for i = 1, #resident, 2 do
  if present[resident[i]] and tonumber(resident[i + 1]) > latest then
    redis.call('ZADD', KEYS[1], 'XX', ARGV[1], resident[i])
  end
end
for _, adapter in ipairs(pinned) do
  if not present[adapter] then
    redis.call('SREM', KEYS[2], adapter)
  end
end
return {resident, pinned, holder, repaired}
"""

_RECONCILE = _RECONCILE.replace("FUTURE_MARK_S", repr(FUTURE_MARK_S))

# KEYS: any key (every gateway names the same one, so on a Redis Cluster all read one node's clock). Redis' TIME.
_CLOCK = """
return redis.call('TIME')
"""

# KEYS: resident, pinned, lock. The record in one atomic read ({member, score, ...}, {pinned...}, holder or nil).
_RECORD = """
owned(1, 'zset')
owned(2, 'set')
owned(3, 'string')
return {
  redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES'), redis.call('SMEMBERS', KEYS[2]), redis.call('GET', KEYS[3]),
  repaired
}
"""


# The last part of each key of a replica's record, and the ``key`` label of its repairs.
RECORD_KEYS = ("resident", "pinned", "lock")


class RedisStore:
    def __init__(
        self, url: str, *, prefix: str = "tg", operation_timeout_s: float = 0.5, cluster: bool = False,
        access: RedisAccess = NO_ACCESS, metrics: GatewayMetrics | None = None,
    ) -> None:  # fmt: skip
        self._prefix = prefix
        self._timeout_s = operation_timeout_s
        self._repairs = KeyRepairs(
            "residency", metrics.key_repairs if metrics is not None else None,
            then="the replica's record is rebuilt from its engine",
        )  # fmt: skip
        # Record keys a write (an add, a remove) repaired, per replica, until its next read says so: the write kept
        # only its own adapter, and the lifecycle learns from a read that the rest is to rebuild from the engine.
        self._repaired_by_writes: dict[tuple[str, str], frozenset[str]] = {}
        # No retries: a store that does not answer must fail fast, the caller falls back to its local view.
        self._client = make_client(url, operation_timeout_s, cluster=cluster, access=access)
        script = self._client.register_script
        self._acquire, self._release = script(OWNED_LUA + _ACQUIRE), script(OWNED_LUA + _RELEASE)
        self._renew, self._break = script(OWNED_LUA + _RENEW), script(OWNED_LUA + _BREAK)
        self._add, self._remove = script(OWNED_LUA + _ADD), script(OWNED_LUA + _REMOVE)
        self._reconcile, self._record = script(OWNED_LUA + _RECONCILE), script(OWNED_LUA + _RECORD)
        self._clock = script(_CLOCK)

    def _keys(self, pool: str, replica: str) -> tuple[str, str, str]:
        """The replica's resident, pinned and lock keys."""
        base = f"{self._prefix}:{{{pool}:{replica}}}"
        resident, pinned, lock = RECORD_KEYS
        return f"{base}:{resident}", f"{base}:{pinned}", f"{base}:{lock}"

    def _call(self, what: str) -> AbstractAsyncContextManager[None]:
        return redis_call(what, self._timeout_s)

    def _repaired(self, reply: list[Any]) -> tuple[Any, frozenset[str]]:
        """A script's answer (``{result..., repaired}``) as its first item and the kinds of key it repaired (resident,
        pinned, lock); each repair counted, and logged the first time for each key."""
        kinds = {key.rpartition(":")[2] for key in self._repairs.note(cast(list[str], reply[-1]))}
        return reply[0], frozenset(kinds)

    async def record(self, pool: str, replica: str) -> ReplicaRecord:
        async with self._call("record"):
            # A script, not MULTI: one atomic read that works the same on a Redis Cluster (one slot per replica).
            reply = await cast(Awaitable[list[Any]], self._record(keys=list(self._keys(pool, replica))))
        repaired = self._repaired(reply)[1] | self._repaired_by_writes.pop((pool, replica), frozenset())
        return _record_from(reply, repaired)

    async def acquire(self, pool: str, replica: str, holder: str, ttl_s: float) -> bool:
        lock_key = self._keys(pool, replica)[2]
        ttl_ms = max(1, math.ceil(ttl_s * 1000))
        async with self._call("acquire"):
            reply = await cast(Awaitable[list[Any]], self._acquire(keys=[lock_key], args=[holder, ttl_ms]))
        return bool(self._repaired(reply)[0])

    async def renew(self, pool: str, replica: str, holder: str, ttl_s: float) -> bool:
        lock_key = self._keys(pool, replica)[2]
        ttl_ms = max(1, math.ceil(ttl_s * 1000))
        async with self._call("renew"):
            reply = await cast(Awaitable[list[Any]], self._renew(keys=[lock_key], args=[holder, ttl_ms]))
        return bool(self._repaired(reply)[0])

    async def release(self, pool: str, replica: str, holder: str) -> None:
        lock_key = self._keys(pool, replica)[2]
        async with self._call("release"):
            self._repaired(await cast(Awaitable[list[Any]], self._release(keys=[lock_key], args=[holder])))

    async def break_lock(self, pool: str, replica: str, owned_by: str, unless: str) -> bool:
        lock_key = self._keys(pool, replica)[2]
        async with self._call("break_lock"):
            reply = await cast(Awaitable[list[Any]], self._break(keys=[lock_key], args=[owned_by, unless]))
        return bool(self._repaired(reply)[0])

    async def add(self, pool: str, replica: str, adapter: str, used_at: float, *, pinned: bool = False) -> None:
        keys = list(self._keys(pool, replica)[:2])
        async with self._call("add"):
            reply = await cast(Awaitable[list[Any]], self._add(keys=keys, args=[used_at, adapter, int(pinned)]))
        self._written(pool, replica, reply)

    async def remove(self, pool: str, replica: str, adapters: Collection[str]) -> None:
        if not adapters:
            return
        keys = list(self._keys(pool, replica)[:2])
        async with self._call("remove"):
            reply = await cast(Awaitable[list[Any]], self._remove(keys=keys, args=list(adapters)))
        self._written(pool, replica, reply)

    def _written(self, pool: str, replica: str, reply: list[Any]) -> None:
        """A write's answer: a record key it repaired is said by the replica's next read (``record``)."""
        repaired = self._repaired(reply)[1]
        if repaired:
            where = (pool, replica)
            self._repaired_by_writes[where] = self._repaired_by_writes.get(where, frozenset()) | repaired

    async def touch(self, uses: Uses) -> None:
        if not uses:
            return
        # One ZADD per replica with every adapter it used (XX GT applies member by member): a flush every 0.25 s
        # touches each adapter in use, and each command costs the client a few us of Python.
        by_replica: dict[tuple[str, str], dict[str, float]] = {}
        for (pool, replica, adapter), used_at in uses.items():
            by_replica.setdefault((pool, replica), {})[adapter] = used_at
        async with self._call("touch"), self._client.pipeline(transaction=False) as pipe:
            for (pool, replica), members in by_replica.items():
                pipe.zadd(self._keys(pool, replica)[0], members, xx=True, gt=True)
            for answer in await pipe.execute(raise_on_error=False):
                # A key of another type holds nothing to touch: skipped, the next read of its record repairs it.
                if isinstance(answer, Exception) and not _wrong_type(answer):
                    raise answer

    async def reconcile(self, pool: str, replica: str, on_engine: Collection[str], now: float) -> ReplicaRecord:
        keys = self._keys(pool, replica)
        async with self._call("reconcile"):
            reply = await cast(
                Awaitable[list[Any]], self._reconcile(keys=list(keys), args=[now, *dict.fromkeys(on_engine)])
            )
        self._repaired_by_writes.pop((pool, replica), None)  # rebuilt from the engine: nothing left to say
        return _record_from(reply, self._repaired(reply)[1])

    async def clock(self) -> float | None:
        """Redis' TIME, or None (logged) for an answer that is no time: not two integers, or a day or more from this
        host's clock. None keeps the gateway's last offset (``PoolResidency._learn_clock``): an unreadable answer
        raised out of the sync before, which then read no record (every 2 s), and at start-up ended the fleet's
        start-up task: the gateway never turned ready."""
        async with self._call("clock"):
            reply = await cast(Awaitable[Any], self._clock(keys=[f"{self._prefix}:{{clock}}"]))
        try:
            seconds, micros = (int(part) for part in reply)
            if not 0 <= micros < 1_000_000:
                raise ValueError(f"microseconds {micros}")
        except (TypeError, ValueError) as exc:
            log.warning("redis TIME answered %.100r, not a time (%s): the last clock offset is kept", reply, exc)
            return None
        now = seconds + micros / 1e6
        if abs(now - time.time()) >= MAX_CLOCK_GAP_S:
            log.warning("redis TIME answered %s, a day or more from this host's clock: the last offset is kept", now)
            return None
        return now

    async def ping(self) -> None:
        async with self._call("ping"):
            await cast(Awaitable[Any], self._client.ping())

    async def close(self) -> None:
        async with self._call("close"):
            await self._client.aclose()


def _record_from(reply: list[Any], repaired: frozenset[str]) -> ReplicaRecord:
    """A script's {member, score, ...}, {pinned...}, holder-or-nil as a record."""
    flat, pinned, holder = cast(list[str], reply[0]), cast(list[str], reply[1]), cast(str | None, reply[2])
    resident = {flat[i]: float(flat[i + 1]) for i in range(0, len(flat), 2)}
    return ReplicaRecord(resident, frozenset(pinned), holder, repaired)


def _wrong_type(error: Exception) -> bool:
    return isinstance(error, ResponseError) and str(error).startswith("WRONGTYPE")
