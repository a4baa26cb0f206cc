"""Token buckets in Redis that several gateways lease from (gateway/tenants/admission.py says why leases).

Layout: ``{prefix}:rl:{{tenant:kind}}:{per_minute}`` HASH {tokens, at}, refilled in the script by Redis' own clock
(``TIME``), so gateways' clocks never disagree; it expires once it would be full again anyway. A debt (tokens a
request used beyond its lease) takes the bucket below zero, and every gateway's next lease waits it out.

The limit is part of the key: gateways whose configs give a tenant different limits (a rolling config change, or
configs that differ) each lease from the bucket of their own limit, shared with the gateways that have the same one.
One bucket for all had the stricter capacity clamp the looser gateways' refill and their leases drain what the
stricter counted on, so the lowest limit throttled every gateway's traffic. Each limit holds for the traffic of
the gateways configured with it; while two limits are live the tenant may get both (docs/operations.md).
"""

from __future__ import annotations

from typing import Any, cast

from prometheus_client import Counter

from gateway.redis_client import NO_ACCESS, OWNED_LUA, KeyRepairs, RedisAccess, make_client, redis_call

# Both scripts read a field that is not a finite number as missing, and keep a debt to at most an hour's refill (60
# times the per-minute capacity): Lua's tonumber takes "inf", "-inf" and "nan" (and a figure past a double as
# infinite), which another writer may have left. Minus infinity, or a debt past what PEXPIRE takes in milliseconds,
# was written back, then failed the PEXPIRE: such a bucket never healed, and every gateway fell back on its local one
# for good (the tenant's limit times the gateways).
#
# A key of another type than the HASH this writes (someone SET a string there) is deleted first: read as no bucket,
# a full one, and written over. Its HMGET raised WRONGTYPE, which is StoreUnavailable, and the first lease to meet
# it sent every limit of the gateway (the outage is shared by every tenant's) to its local bucket for FALLBACK_S,
# again and again while the key stayed.
_FINITE = (
    OWNED_LUA
    + """
local function finite(x)
  if x == nil or x ~= x or x == math.huge or x == -math.huge then return nil end
  return x
end
owned(1, 'hash')
"""
)

# KEYS: bucket; ARGV: want, need, capacity, per_s. Returns {granted, wait_s} as strings (floats survive that way),
# then OWNED_LUA's repaired.
_LEASE = (
    _FINITE
    + """
local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) + tonumber(now_parts[2]) / 1e6
local want, need = tonumber(ARGV[1]), tonumber(ARGV[2])
local capacity, per_s = tonumber(ARGV[3]), tonumber(ARGV[4])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = finite(tonumber(state[1])) or capacity
local at = finite(tonumber(state[2])) or now
tokens = math.max(-60 * capacity, math.min(capacity, tokens + math.max(0, now - at) * per_s))
local granted, wait = 0, 0
if tokens >= need then
  granted = math.min(want, tokens)
  tokens = tokens - granted
else
  wait = (math.min(need, capacity) - tokens) / per_s
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(1000 * (capacity - tokens) / per_s) + 1000)
return {tostring(granted), tostring(wait), repaired}
"""
)

# KEYS: bucket; ARGV: amount, capacity, per_s. Takes amount, below zero if need be; kept until it has refilled.
# Returns {tokens left, repaired}.
_DEBIT = (
    _FINITE
    + """
local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) + tonumber(now_parts[2]) / 1e6
local amount, capacity, per_s = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = finite(tonumber(state[1])) or capacity
local at = finite(tonumber(state[2])) or now
tokens = math.max(-60 * capacity, math.min(capacity, tokens + math.max(0, now - at) * per_s) - amount)
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(1000 * (capacity - tokens) / per_s) + 1000)
return {tostring(tokens), repaired}
"""
)


class RedisBuckets:
    def __init__(
        self, url: str, *, prefix: str = "tg", operation_timeout_s: float = 0.5, cluster: bool = False,
        access: RedisAccess = NO_ACCESS, repairs: Counter | None = None,
    ) -> None:  # fmt: skip
        self._prefix, self._timeout_s = prefix, operation_timeout_s
        self._repairs = KeyRepairs("rate_buckets", repairs)
        self._client = make_client(url, operation_timeout_s, cluster=cluster, access=access)
        self._lease = self._client.register_script(_LEASE)
        self._debit = self._client.register_script(_DEBIT)

    def bucket(self, key: str, capacity: float) -> str:
        """The Redis key of ``key``'s bucket at this capacity (the per-minute limit)."""
        return f"{self._prefix}:rl:{{{key}}}:{capacity:.0f}"

    async def lease(self, key: str, want: float, need: float, capacity: float, per_s: float) -> tuple[float, float]:
        async with redis_call("lease", self._timeout_s):
            granted, wait, repaired = cast(
                list[Any], await self._lease(keys=[self.bucket(key, capacity)], args=[want, need, capacity, per_s])
            )
        self._repairs.note(repaired)
        return float(granted), float(wait)

    async def debit(self, key: str, amount: float, capacity: float, per_s: float) -> None:
        async with redis_call("debit", self._timeout_s):
            reply = await self._debit(keys=[self.bucket(key, capacity)], args=[amount, capacity, per_s])
        self._repairs.note(cast(list[Any], reply)[1])

    async def close(self) -> None:
        await self._client.aclose()
