"""Replicas an operator drained, kept where a reload and other gateways see them.

A drain used to be a flag on one fleet's replica in one gateway's memory: a reload builds a new fleet (the drain
was lost), and behind a Service the other gateway pods never heard of it. Now the gateway keeps the drained
replicas beside the fleet, as ``pool/replica`` names, and applies them to every fleet it builds before that fleet
serves. With Redis the set lives in ``{prefix}:{drains}`` (a SET; the braces keep it in one Cluster slot): a drain
is written there first (refused, and not made, while Redis does not answer), and every gateway reads the set
every ``SYNC_S`` and applies it, so a drain or undrain through any gateway reaches all of them within that time.
A replica the set names that the fleet does not have is ignored (it may come back with a reload). The gateway owns
the key: one of another type (someone SET a string there) is replaced by the script that meets it with the drains
its gateway knows (read as no drain, every drained replica went back into service on every gateway within
``SYNC_S``). Its WRONGTYPE was every read's and every drain's: the last set known stayed, and no drain or undrain
could be made, until an operator deleted the key.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, cast

from aiohttp import web
from prometheus_client import Counter

from gateway.appkeys import STATE
from gateway.fleet.fleet import Fleet
from gateway.redis_client import NO_ACCESS, OWNED_LUA, KeyRepairs, RedisAccess, make_client, redis_call
from gateway.residency.store import StoreUnavailable
from gateway.tasks import cancel_and_wait

log = logging.getLogger(__name__)

SYNC_S = 1.0

# KEYS: the set; ARGV: "add", "remove" or "read", a name, then the drains this gateway knows. {The set's members
# (after the change), OWNED_LUA's repaired}. A key of another type is replaced by the drains this gateway knows: read
# as no drain, it put every drained replica back into service on every gateway within SYNC_S.
_DRAINS = (
    OWNED_LUA
    + """
if owned(1, 'set') and #ARGV > 2 then
  redis.call('SADD', KEYS[1], unpack(ARGV, 3))
end
if ARGV[1] == 'add' then
  redis.call('SADD', KEYS[1], ARGV[2])
elseif ARGV[1] == 'remove' then
  redis.call('SREM', KEYS[1], ARGV[2])
end
return {redis.call('SMEMBERS', KEYS[1]), repaired}
"""
)


class Drains:
    def __init__(
        self,
        redis_url: str | None,
        *,
        prefix: str = "tg",
        operation_timeout_s: float = 0.5,
        cluster: bool = False,
        access: RedisAccess | None = None,
        repairs: Counter | None = None,
    ) -> None:
        self.drained: set[str] = set()
        self._repairs = KeyRepairs("drains", repairs, then="written again with the drains this gateway knows")
        self._key, self._timeout_s = f"{prefix}:{{drains}}", operation_timeout_s
        self._client = (
            None
            if redis_url is None
            else make_client(redis_url, operation_timeout_s, cluster=cluster, access=access or NO_ACCESS)
        )
        self._script = self._client.register_script(_DRAINS) if self._client is not None else None

    @property
    def shared(self) -> bool:
        """Kept in Redis, where other gateways change it (else only this gateway's own calls change it)."""
        return self._client is not None

    @staticmethod
    def name(pool: str, replica: str) -> str:
        return f"{pool}/{replica}"

    async def set(self, pool: str, replica: str, drained: bool) -> None:
        """Drain or undrain; with Redis, every gateway's set first (``StoreUnavailable``: not made anywhere)."""
        name = self.name(pool, replica)
        if self._script is not None:
            async with redis_call("drain", self._timeout_s):
                args = ["add" if drained else "remove", name, *sorted(self.drained)]
                reply = await cast(Awaitable[list[Any]], self._script(keys=[self._key], args=args))
            self._repairs.note(reply[1])
        if drained:
            self.drained.add(name)
        else:
            self.drained.discard(name)

    async def sync(self) -> None:
        """The shared set, when Redis answers (else the last one known stays)."""
        if self._script is None:
            return
        async with redis_call("drains", self._timeout_s):
            args = ["read", "", *sorted(self.drained)]
            members, repaired = await cast(Awaitable[list[Any]], self._script(keys=[self._key], args=args))
        self._repairs.note(repaired)
        self.drained = set(members)

    def apply(self, fleet: Fleet) -> None:
        """Every replica of the fleet drained exactly when the set names it."""
        for pool in fleet.pools.values():
            for replica_id, replica in pool.replicas.items():
                replica.health.drained = self.name(pool.name, replica_id) in self.drained

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()


DRAINS = web.AppKey("drains", Drains)


async def _follow(app: web.Application) -> None:
    drains = app[DRAINS]
    while True:
        await asyncio.sleep(SYNC_S)
        try:
            await drains.sync()
        except StoreUnavailable as exc:
            log.debug("drains: the shared set is unreachable, keeping the last one: %s", exc)
        drains.apply(app[STATE].serving.fleet)


async def following(app: web.Application) -> AsyncIterator[None]:
    """A cleanup context: the set read once before the gateway serves, then, with Redis, followed every SYNC_S.
    Without Redis nothing but this gateway changes the set (a drain applies itself; a reload applies the set), so
    nothing is followed."""
    drains = app[DRAINS]
    with contextlib.suppress(StoreUnavailable):
        await drains.sync()
    if app[STATE].started:
        drains.apply(app[STATE].serving.fleet)
    task = asyncio.get_running_loop().create_task(_follow(app), name="drains") if drains.shared else None
    yield
    await cancel_and_wait([task])
    await drains.close()
