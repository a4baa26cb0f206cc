"""The fleet's traffic: every gateway's measured figures, merged through Redis into one every gateway reads.

Every ``traffic.interval_s`` each gateway folds its meter (gateway/observe/traffic.py) and makes one Redis call:
a script that writes this gateway's figures into the hash ``{prefix}:{{traffic}}:by_gateway`` (field: the
gateway's id; value: the Redis clock's milliseconds at the write, a space, then the figures as JSON), drops the
entries not rewritten within three intervals (a gateway gone) and those stamped further ahead of Redis' clock than
that (a clock set back: they were never older, and a gateway gone stayed counted until the clock caught up), and
returns the rest but those larger than this gateway's own figures can be (``max_entry_bytes``: every gateway reads
and parses every entry, on its event loop, each interval; left out, said once). The sum of those is the
fleet's figure (``merge``). The Redis clock stamps the entries, so gateways' clocks need not agree. One key, so one
Redis Cluster slot.

Without Redis, or while it does not answer, the fleet's figure is this gateway's own.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Awaitable
from typing import Any, cast

from prometheus_client import Counter

from gateway.observe.traffic import PoolTraffic, Rate, Traffic, TrafficMeter, merge
from gateway.redis_client import NO_ACCESS, OWNED_LUA, KeyRepairs, RedisAccess, make_client, redis_call
from gateway.residency.store import StoreUnavailable

log = logging.getLogger(__name__)

# KEYS: the hash; ARGV: this gateway's id, its figures (JSON), how old (or how far ahead) an entry may be (ms), the
# largest entry read (bytes). Returns {{id, entry, ...}, {id, ...}, repaired}: the entries that are fresh, this
# gateway's included, the ids of those left out for their size, and the key if it was of another type (OWNED_LUA).
_SWAP = (
    OWNED_LUA
    + """
owned(1, 'hash')  -- another type (someone SET a string there): every gateway's swap failed for good
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local oldest, newest = now - tonumber(ARGV[3]), now + tonumber(ARGV[3])
local largest = tonumber(ARGV[4])
redis.call('HSET', KEYS[1], ARGV[1], now .. ' ' .. ARGV[2])
local all = redis.call('HGETALL', KEYS[1])
local fresh, large = {}, {}
for i = 1, #all, 2 do
  local written = tonumber(string.match(all[i + 1], '^(%d+) '))
  if written == nil or written < oldest or written > newest then
    redis.call('HDEL', KEYS[1], all[i])
  elseif #all[i + 1] > largest then
    large[#large + 1] = all[i]
  else
    fresh[#fresh + 1] = all[i]
    fresh[#fresh + 1] = all[i + 1]
  end
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {fresh, large, repaired}
"""
)

# The bytes a key's figures may take in an entry (``encode``'s are ~30-50), for the largest entry read: 256 per key of
# this gateway's traffic.max_keys, and at least MIN_ENTRY_BYTES.
ENTRY_BYTES_PER_KEY = 256
MIN_ENTRY_BYTES = 1 << 20


def encode(traffic: Traffic) -> str:
    """A gateway's figures as compact JSON: {pool: [requests/s, tokens/s, {key: [requests/s, tokens/s(, spills/s(,
    in flight))]}]} (a key's spills only when it has some or requests in flight, those only when it has some)."""

    def pair(rate: Rate) -> list[float]:
        figures = [float(f"{rate.requests_per_s:.4g}"), float(f"{rate.tokens_per_s:.4g}")]
        spills, in_flight = float(f"{rate.spills_per_s:.4g}"), float(f"{rate.in_flight:.4g}")
        if in_flight:
            return [*figures, spills, in_flight]
        return [*figures, spills] if spills else figures

    body = {
        pool: [*pair(t.total)[:2], {key: pair(rate) for key, rate in t.keys.items()}] for pool, t in traffic.items()
    }
    return json.dumps(body, separators=(",", ":"))


def decode(text: str) -> Traffic:
    """``encode``'s inverse; raises ValueError (or a subclass) on anything else."""
    try:
        body = json.loads(text)
    except RecursionError as exc:  # nested past the parser's depth: as unreadable as any other noise
        raise ValueError("traffic figures are nested too deep") from exc
    if not isinstance(body, dict):
        raise ValueError("traffic figures are not an object")
    traffic: dict[str, PoolTraffic] = {}
    for pool, (requests, tokens, keys) in body.items():
        if not isinstance(keys, dict):
            raise ValueError(f"pool {pool!r}: its keys are not an object")
        rates = {str(key): _rate(figures) for key, figures in cast(dict[str, Any], keys).items()}
        traffic[str(pool)] = PoolTraffic(Rate(_figure(requests), _figure(tokens)), rates)
    return traffic


def _rate(figures: Any) -> Rate:
    """[requests/s, tokens/s], with spills/s, and with requests in flight after them (a gateway of the version before
    spills wrote two; before requests in flight, at most three)."""
    if not isinstance(figures, list) or len(figures) not in (2, 3, 4):
        raise ValueError(f"a key's figures are not 2 to 4 numbers: {figures!r}")
    return Rate(*(_figure(figure) for figure in figures))


# The most a figure may say, per second: far above any fleet's traffic, and far enough below a double's range that
# the fleet's figure, a sum over every gateway's, stays finite.
MAX_RATE = 1e9


def _figure(value: Any) -> float:
    """A rate: finite, not negative, at most ``MAX_RATE`` (one infinite rate had the plan swap keys back and forth
    every interval; two finite ones near a double's top, 1e308 each, summed to infinity in ``merge`` and did the
    same). An integer past a double (valid JSON) is unreadable too: float() raised OverflowError, past the tick's
    handling, and every gateway's traffic tick failed while the entry was fresh."""
    try:
        figure = float(value)
    except OverflowError as exc:
        raise ValueError("not a rate: an integer past a double's range") from exc
    if not 0 <= figure <= MAX_RATE:  # NaN fails it too
        raise ValueError(f"not a rate: {value!r}")
    return figure


class TrafficExchange:
    """Swaps this gateway's figures for every fresh gateway's, in one Redis call."""

    def __init__(
        self,
        redis_url: str,
        *,
        operation_timeout_s: float,
        stale_after_s: float,
        cluster: bool = False,
        prefix: str = "tg",
        access: RedisAccess = NO_ACCESS,
        max_keys: int = 2000,
        repairs: Counter | None = None,
    ) -> None:
        self._repairs = KeyRepairs("traffic", repairs)
        self._client = make_client(redis_url, operation_timeout_s, cluster=cluster, access=access)
        self._timeout_s = operation_timeout_s
        self._stale_ms = max(1, round(1000 * stale_after_s))
        self.max_entry_bytes = max(MIN_ENTRY_BYTES, ENTRY_BYTES_PER_KEY * max_keys)
        self._large: set[str] = set()  # gateways whose entry was left out for its size, each said once
        self.key = f"{prefix}:{{traffic}}:by_gateway"
        self._swap = self._client.register_script(_SWAP)

    async def swap(self, gateway_id: str, figures: str) -> dict[str, str]:
        """Write ``figures`` as this gateway's; every fresh gateway's figures by id (StoreUnavailable on failure)."""
        args: list[str | int] = [gateway_id, figures, self._stale_ms, self.max_entry_bytes]
        async with redis_call("traffic swap", self._timeout_s):
            reply = await cast(Awaitable[list[list[str]]], self._swap(keys=[self.key], args=args))
        entries, large, repaired = reply
        self._repairs.note(repaired)
        for other in large:
            if other not in self._large:
                self._large.add(other)
                log.warning("traffic figures of gateway %s larger than %d bytes: left out", other, self.max_entry_bytes)
        return {entries[i]: entries[i + 1].partition(" ")[2] for i in range(0, len(entries) - 1, 2)}

    async def close(self) -> None:
        with contextlib.suppress(StoreUnavailable):
            async with redis_call("close", self._timeout_s):
                await self._client.aclose()


class FleetTraffic:
    """This gateway's meter and the fleet's figure: ``tick`` (every interval) folds the meter, swaps figures
    through Redis and merges them. ``fleet`` is the figure routing and placement read; ``gateways`` how many
    gateways' figures made it (1: this one's alone)."""

    def __init__(
        self, meter: TrafficMeter, gateway_id: str, max_keys: int, exchange: TrafficExchange | None = None
    ) -> None:
        self.meter = meter
        self.gateway_id = gateway_id
        self.max_keys = max_keys
        self.exchange = exchange
        self.fleet: Traffic = {}
        self.gateways = 0
        self.exchange_up = exchange is not None
        self.bytes_written = 0  # the figures' size at the last swap, for the Redis traffic per interval
        self.bytes_read = 0
        # Gateways whose figures could not be read, each warned about once.
        self._unreadable: set[str] = set()

    async def tick(self) -> None:
        own = self.meter.fold()
        if self.exchange is None:
            self.fleet, self.gateways = own, 1
            return
        figures = encode(own)
        try:
            entries = await self.exchange.swap(self.gateway_id, figures)
        except StoreUnavailable as exc:
            if self.exchange_up:
                log.warning("traffic exchange failed, placing by this gateway's own figures: %s", exc)
            self.exchange_up = False
            self.fleet, self.gateways = own, 1
            return
        if not self.exchange_up:
            log.warning("traffic exchange answers again")
        self.exchange_up = True
        views = [own]
        for gateway_id, text in entries.items():
            if gateway_id == self.gateway_id:
                continue  # its own figures: ``own`` already, without the rounding
            try:
                views.append(decode(text))
            except Exception as exc:  # a figure another version wrote, or noise: left out, said once
                if gateway_id not in self._unreadable:
                    self._unreadable.add(gateway_id)
                    log.warning("traffic figures of gateway %s unreadable: %s", gateway_id, exc)
        self.fleet = merge(views, self.max_keys)
        self.gateways = len(views)
        self.bytes_written, self.bytes_read = len(figures), sum(len(text) for text in entries.values())

    async def close(self) -> None:
        if self.exchange is not None:
            await self.exchange.close()
