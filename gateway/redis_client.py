"""One way to talk to Redis: a client that fails fast (no retries, bounded calls), and every failure as
``StoreUnavailable``, so callers fall back to local state instead of waiting on Redis."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis.asyncio
from prometheus_client import Counter
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.config import ConfigError, StateConfig
from gateway.residency.store import StoreUnavailable

log = logging.getLogger(__name__)

Client = redis.asyncio.Redis | RedisCluster


@dataclass(frozen=True)
class RedisAccess:
    """How a client logs in and which TLS files it uses, resolved once at start from ``state.*`` (the password from
    the environment or a file, never from the config). The default is no AUTH and no TLS files."""

    username: str | None = None
    password: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def client_kwargs(self) -> dict[str, Any]:
        """redis-py's keyword arguments (the ssl_* ones only exist for a rediss:// URL: the config checks it)."""
        named = {
            "username": self.username, "password": self.password, "ssl_ca_certs": self.ca_file,
            "ssl_certfile": self.cert_file, "ssl_keyfile": self.key_file,
        }  # fmt: skip
        return {key: value for key, value in named.items() if value is not None}


NO_ACCESS = RedisAccess()

# The keys the gateway writes are its own. One holding another Redis type than the gateway writes there (someone SET
# a string where a hash lives) made every command on it raise WRONGTYPE, which is StoreUnavailable: the feature on
# that key stayed down until an operator deleted it. Every script on such keys begins with this: ``owned(i, kind)``
# deletes KEYS[i] when it holds another type than ``kind`` (what it held no gateway could read), notes "key type"
# in ``repaired`` (for a script that reports it) and says whether it did.
OWNED_LUA = """
local repaired = {}
local function owned(i, kind)
  local found = redis.call('TYPE', KEYS[i])['ok']
  if found ~= 'none' and found ~= kind then
    redis.call('DEL', KEYS[i])
    repaired[#repaired + 1] = KEYS[i] .. ' ' .. found
    return true
  end
  return false
end
"""

# The stores whose scripts begin with OWNED_LUA: the ``store`` label of tenantgate_redis_key_repairs_total.
KEY_REPAIR_STORES = ("residency", "placement", "rate_buckets", "traffic", "reload_fanout", "drains")
# Keys each store logs once, at most: a Redis that keeps meeting new keys of another type (each rate bucket's, say)
# is still counted, without this set growing with it.
_LOGGED_KEYS = 1024


class KeyRepairs:
    """One store's repairs (OWNED_LUA's ``repaired``, which every script on the gateway's keys answers): each counted
    in ``counter`` (tenantgate_redis_key_repairs_total{store}) and logged the first time for each key. Only the
    residency store's were counted before; a repair elsewhere (a rate bucket, the traffic figures, the gateways'
    heartbeats, the drains, the placement keys) left no figure, and most left no line either."""

    def __init__(self, store: str, counter: Counter | None = None, *, then: str = "") -> None:
        if store not in KEY_REPAIR_STORES:
            raise ValueError(f"not a store whose keys are repaired: {store!r}")
        self.store = store
        self._count = counter.labels(store).inc if counter is not None else None
        self._then = f" ({then})" if then else ""
        self._logged: set[str] = set()
        self._past_logged = False  # _LOGGED_KEYS keys were logged: the next one says that the rest are only counted

    def note(self, found: Iterable[object]) -> list[str]:
        """The keys a script repaired, from its ``repaired`` ("key type" entries), each counted and logged once (the
        first ``_LOGGED_KEYS`` keys; past them one line says so, and the rest are counted only)."""
        keys = []
        for entry in found:
            key, _, held = str(entry).rpartition(" ")
            keys.append(key)
            if self._count is not None:
                self._count()
            if key in self._logged:
                continue
            if len(self._logged) < _LOGGED_KEYS:
                self._logged.add(key)
                log.warning("%s store: %s held a %s, not what the gateway writes there: deleted%s", self.store, key,
                            held, self._then)  # fmt: skip
            elif not self._past_logged:
                # Not a line per repair past the set's bound: every repair of every key not remembered logged again,
                # a line per call for a Redis that keeps meeting keys of another type.
                self._past_logged = True
                log.warning("%s store: %s held a %s, not what the gateway writes there: deleted%s; past %d keys, "
                            "further repairs are counted only (tenantgate_redis_key_repairs_total)", self.store, key,
                            held, self._then, _LOGGED_KEYS)  # fmt: skip
        return keys


def secret(environ: Mapping[str, str], env: str | None, file: str | None, what: str) -> str | None:
    """A secret from the environment variable ``env`` or the file ``file`` (a mounted Secret; its trailing newline
    dropped), None when neither is named; ``ConfigError`` if the one named is missing or empty. Read at start-up."""
    if env is not None:
        value = environ.get(env, "")
        if not value:
            raise ConfigError(what, [f"the environment variable {env} is not set (or empty)"])
        return value
    if file is not None:
        try:
            value = Path(file).read_text().rstrip("\r\n")
        except OSError as exc:
            raise ConfigError(what, [f"cannot read {file}: {exc.strerror}"]) from exc
        if not value:
            raise ConfigError(what, [f"{file} is empty"])
        return value
    return None


def redis_access(state: StateConfig, environ: Mapping[str, str]) -> RedisAccess:
    password = secret(environ, state.password_env, state.password_file, "state.password")
    tls = state.tls
    if tls is None:
        return RedisAccess(state.username, password)
    return RedisAccess(state.username, password, tls.ca_file, tls.cert_file, tls.key_file)


def make_client(
    url: str,
    operation_timeout_s: float,
    *,
    subscriber: bool = False,
    cluster: bool = False,
    access: RedisAccess = NO_ACCESS,
) -> Client:
    """``subscriber``: for pub/sub, whose reads wait for the next message however long (no read timeout).
    ``cluster``: a Redis Cluster (``url`` names any node); every multi-key change the gateway makes touches one
    slot (hash-tagged keys). The cluster client keeps its own retries: a failover needs a topology refresh.
    ``access``: AUTH and TLS files (``redis_access``)."""
    if cluster:
        return RedisCluster.from_url(
            url,
            socket_timeout=None if subscriber else operation_timeout_s,
            socket_connect_timeout=operation_timeout_s,
            decode_responses=True,
            **access.client_kwargs(),
        )
    return redis.asyncio.Redis.from_url(
        url,
        socket_timeout=None if subscriber else operation_timeout_s,
        socket_connect_timeout=operation_timeout_s,
        retry=Retry(NoBackoff(), 0),
        decode_responses=True,
        **access.client_kwargs(),
    )


# A subscription quiet this long is asked (a PING on its connection); one that then stays quiet as long again is
# taken as dropped. A connection can die without a reset ever reaching us (a
# NAT or load balancer that forgot the idle flow, a host gone): waiting for the next message would wait forever
# while the caller believes it listens. The pings also keep such an idle flow alive.
QUIET_S = 15.0


async def channel_messages(
    subscriber: Client, channel: str, quiet_s: float | None = None
) -> AsyncIterator[dict[str, Any]]:
    """Subscribe to ``channel`` and yield what arrives (type ``message``), Redis' confirmation of the subscription
    (type ``subscribe``: from then on every message published reaches us) included, until the connection drops or
    stops answering (the error is raised: the caller subscribes again); the answers to its pings are not yielded.
    ``subscriber``: a ``make_client(..., subscriber=True)`` client. ``quiet_s``: ``QUIET_S`` unless given (a caller
    that says it listens by this must learn sooner that it does not: the slot signal)."""
    quiet_s = QUIET_S if quiet_s is None else quiet_s
    if isinstance(subscriber, RedisCluster):
        await subscriber.initialize()  # its pub/sub needs the slot map first
    async with subscriber.pubsub() as pubsub:
        await pubsub.subscribe(channel)
        asked = False
        while True:
            message = await pubsub.get_message(timeout=quiet_s)
            if message is not None:  # anything, a ping's answer included, says the connection lives
                asked = False
                if message["type"] in ("message", "subscribe"):
                    yield message
            elif asked:
                raise ConnectionError(f"the subscription to {channel} did not answer a ping within {quiet_s:g} s")
            else:
                await pubsub.ping()
                asked = True


@asynccontextmanager
async def redis_call(what: str, timeout_s: float) -> AsyncIterator[None]:
    # asyncio.TimeoutError is TimeoutError (Python >= 3.11); redis' own TimeoutError is a RedisError.
    try:
        async with asyncio.timeout(timeout_s):
            yield
    except (RedisError, OSError, TimeoutError) as exc:
        raise StoreUnavailable(f"redis {what} failed: {exc!r}") from exc
