"""Where the homes table lives, and who may write it: a leader's lease and the versioned table.

With Redis, one call per gateway per interval (``poll``): a script that takes or renews the leader's lease
(``SET {prefix}:{placement}:leader <id> NX PX <ttl>``, or ``PEXPIRE`` when this gateway holds it) and returns the
table only when its version is newer than the one the gateway has (otherwise its version alone: a few bytes). The
leader makes one more call when it publishes (``publish``): a script that writes only while this gateway holds the
lease and only a higher version, so a leader that lost its lease cannot overwrite its successor. The table has no
expiry: when the leader dies every gateway keeps routing by the last version until another takes the lease. Both
keys carry the hash tag ``{placement}``: one Redis Cluster slot.

What operators set at run time (freeze, pins: the admin API) lives in the hash ``{prefix}:{placement}:operator``,
which the poll returns to every gateway (the leader plans by it; the others report it to operators, whose request
may land on any of them). Without Redis (``LocalHomesStore``) the gateway is its own leader and
its table and operator settings live in the process.

The gateway owns these keys: the poll deletes one of another Redis type than it writes there (someone SET a string
where the operator's hash lives), whose content no gateway could read, and says so (logged once per key). Before,
the poll's GET or HGETALL raised WRONGTYPE (``StoreUnavailable``) at every gateway and every interval: placement
stopped for good, and the first look before serving failed, until an operator deleted the key.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from prometheus_client import Counter

from gateway.placement.table import HomesTable, decode, encode
from gateway.redis_client import OWNED_LUA, Client, KeyRepairs, redis_call
from gateway.residency.store import StoreUnavailable

log = logging.getLogger(__name__)

# A stored table's version, the digits before its first space: 0 (unreadable, so the leader publishes over it) when
# missing or longer than 15 digits. Lua's numbers are doubles: a version of 2^63 or more comes back to Redis as
# -2^63, and one above 2^53 no longer counts up, so a table written with such a version (by hand, or by a gateway
# of another format) would refuse every leader's publish for good.
_READABLE_VERSION = """
local function readable_version(stored)
  local digits = string.match(stored, '^(%d+) ')
  if not digits or #digits > 15 then
    return 0
  end
  return tonumber(digits)
end
"""

# KEYS: the lease, the table, the operator's settings. ARGV: this gateway's id, the version it has, the lease's
# ttl (ms). Returns {1 if this gateway leads else 0, the table's version, the operator's settings (a flat
# hash), the keys of another type it deleted ("key type"), the table (only when newer)}.
_POLL = (
    _READABLE_VERSION
    + OWNED_LUA
    + """
owned(1, 'string')
owned(2, 'string')
owned(3, 'hash')
local holder = redis.call('GET', KEYS[1])
local leads = 0
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  leads = 1
elseif not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
  leads = 1
end
local operator = redis.call('HGETALL', KEYS[3])
local stored = redis.call('GET', KEYS[2])
if not stored then
  return {leads, 0, operator, repaired}
end
local version = readable_version(stored)
if version <= tonumber(ARGV[2]) then
  return {leads, version, operator, repaired}
end
return {leads, version, operator, repaired, string.sub(stored, string.find(stored, ' ') + 1)}
"""
)

# KEYS: the lease, the table. ARGV: this gateway's id, the new version, the table. 1: written; 0: refused.
_PUBLISH = (
    _READABLE_VERSION
    + """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
local stored = redis.call('GET', KEYS[2])
if stored and readable_version(stored) >= tonumber(ARGV[2]) then
  return 0
end
redis.call('SET', KEYS[2], ARGV[2] .. ' ' .. ARGV[3])
return 1
"""
)


@dataclass(frozen=True)
class Operator:
    """What operators set at run time (the admin API), on top of the config's ``placement``."""

    frozen: bool = False
    pins: Mapping[str, Mapping[str, str]] = field(default_factory=dict)  # pool -> key -> replica


@dataclass(frozen=True)
class Polled:
    leads: bool
    version: int  # the stored table's version (0: none yet)
    table: HomesTable | None  # the stored table, when newer than the version asked about
    operator: Operator = Operator()  # the leader plans by it; every gateway reports it
    bytes_read: int = 0


def _pin_field(pool: str, key: str) -> str:
    """``pin:<pool> <key>``: a pool name holds no space (config.Name), while both may hold a '/'."""
    return f"pin:{pool} {key}"


def _operator(fields: Mapping[str, str]) -> Operator:
    """The operator's hash: ``frozen`` -> "1" or "0"; ``_pin_field(pool, key)`` -> replica."""
    pins: dict[str, dict[str, str]] = {}
    for name, value in fields.items():
        if name.startswith("pin:") and " " in name:
            pool, _, key = name[4:].partition(" ")
            pins.setdefault(pool, {})[key] = value
    return Operator(fields.get("frozen") == "1", pins)


class HomesStore(Protocol):
    async def poll(self, gateway_id: str, known_version: int) -> Polled: ...

    async def publish(self, gateway_id: str, table: HomesTable) -> int:
        """Write ``table`` (its version must be above the stored one); the bytes written, 0 when refused."""
        ...

    async def operator(self) -> Operator:
        """The freeze and pins as stored now (the admin API's view; the leader reads them with its poll)."""
        ...

    async def set_frozen(self, frozen: bool) -> None: ...

    async def set_pin(self, pool: str, key: str, replica: str | None) -> None:
        """Pin ``key``'s home in ``pool`` to ``replica`` (None: unpin)."""
        ...

    async def close(self) -> None: ...


class LocalHomesStore:
    """Without Redis: this gateway leads, and its table is the one it published last."""

    def __init__(self) -> None:
        self._table: HomesTable | None = None
        self._operator: dict[str, str] = {}

    async def poll(self, gateway_id: str, known_version: int) -> Polled:
        table = self._table
        version = table.version if table is not None else 0
        newer = table if table is not None and version > known_version else None
        return Polled(True, version, newer, _operator(self._operator))

    async def operator(self) -> Operator:
        return _operator(self._operator)

    async def set_frozen(self, frozen: bool) -> None:
        self._operator["frozen"] = "1" if frozen else "0"

    async def set_pin(self, pool: str, key: str, replica: str | None) -> None:
        if replica is None:
            self._operator.pop(_pin_field(pool, key), None)
        else:
            self._operator[_pin_field(pool, key)] = replica

    async def publish(self, gateway_id: str, table: HomesTable) -> int:
        if self._table is not None and table.version <= self._table.version:
            return 0
        self._table = table
        return 1

    async def close(self) -> None:
        return None


class RedisHomesStore:
    """``client``: ``redis_client.make_client``'s, which the store closes."""

    def __init__(
        self, client: Client, *, operation_timeout_s: float, lease_s: float, prefix: str = "tg",
        repairs: Counter | None = None,
    ) -> None:  # fmt: skip
        self._client = client
        self._timeout_s = operation_timeout_s
        self._lease_ms = max(1, round(1000 * lease_s))
        self.keys = [f"{prefix}:{{placement}}:leader", f"{prefix}:{{placement}}:homes"]
        self._operator_key = f"{prefix}:{{placement}}:operator"
        self._poll = self._client.register_script(_POLL)
        self._publish = self._client.register_script(_PUBLISH)
        self._repairs = KeyRepairs("placement", repairs)  # keys the poll found of another type

    async def poll(self, gateway_id: str, known_version: int) -> Polled:
        """Take or renew the lease; the table when newer than ``known_version`` (StoreUnavailable on failure). A
        stored table that does not decode (another format's, or written by hand) comes back as None with its
        version: the leader publishes its own above it."""
        async with redis_call("placement poll", self._timeout_s):
            reply = await cast(
                Awaitable[list[Any]],
                self._poll(keys=[*self.keys, self._operator_key], args=[gateway_id, known_version, self._lease_ms]),
            )
        leads, version, flat = bool(int(reply[0])), int(reply[1]), [str(item) for item in reply[2]]
        self._repairs.note(reply[3])
        text = str(reply[4]) if len(reply) > 4 else None
        operator = _operator(dict(zip(flat[::2], flat[1::2], strict=True)))
        table = None
        if text is not None:
            try:
                table = decode(text)
            except (ValueError, TypeError, KeyError) as exc:
                log.warning("placement table version %d unreadable, not installed: %s", version, exc)
        return Polled(leads, version, table, operator, len(text or "") + sum(map(len, flat)) + 16)

    async def operator(self) -> Operator:
        async with redis_call("placement operator", self._timeout_s):
            fields = await cast(Awaitable[dict[str, str]], self._client.hgetall(self._operator_key))
        return _operator({str(name): str(value) for name, value in fields.items()})

    async def set_frozen(self, frozen: bool) -> None:
        async with redis_call("placement freeze", self._timeout_s):
            await self._client.hset(self._operator_key, "frozen", "1" if frozen else "0")

    async def set_pin(self, pool: str, key: str, replica: str | None) -> None:
        field_name = _pin_field(pool, key)
        async with redis_call("placement pin", self._timeout_s):
            if replica is None:
                await self._client.hdel(self._operator_key, field_name)
            else:
                await self._client.hset(self._operator_key, field_name, replica)

    async def publish(self, gateway_id: str, table: HomesTable) -> int:
        body = encode(table)
        async with redis_call("placement publish", self._timeout_s):
            written = await cast(Awaitable[int], self._publish(keys=self.keys, args=[gateway_id, table.version, body]))
        return len(body) if int(written) else 0

    async def close(self) -> None:
        with contextlib.suppress(StoreUnavailable):
            async with redis_call("close", self._timeout_s):
                await self._client.aclose()
