"""Tenants, keys and adapters changed at run time, on top of the config file (which stays the seed).

Through the admin API an operator adds or removes tenants, adds or revokes API keys (as ``sha256:`` hashes), and
adds or retires adapters in the catalog, without a restart. Alone, a gateway keeps these changes in memory. With
Redis they live there and every gateway sharing it applies each change as soon as it is published: the message
carries the change itself, so applying it costs no Redis round trip; a resync every ``resync_s`` repairs a missed
message. A retired adapter leaves every tenant's list (its requests get the 404 of a missing model). Redis layout:

- ``{prefix}:{registry}:tenants``  HASH tenant id -> the tenant's config as JSON (the config file's schema);
- ``{prefix}:{registry}:keys``     HASH key hash -> tenant id (keys added to config tenants);
- ``{prefix}:{registry}:revoked``  SET of revoked key hashes (config keys included);
- ``{prefix}:{registry}:adapters`` HASH adapter name -> its catalog entry as JSON;
- ``{prefix}:{registry}:retired``  SET of retired adapter names (config adapters included);
- ``{prefix}:{registry}:splits``   HASH name -> a split (A/B variants, or an adapter's versions in a rollout) as JSON;
- ``{prefix}:registry``          the pub/sub channel of changes.

The braces are a Redis Cluster hash tag: every registry key lives in one slot, so a change is one MULTI.

Every change is validated exactly as the config file is (the merged config must load) and refused whole if not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from pydantic import ValidationError
from redis.asyncio.cluster import RedisCluster

from gateway.config import AdapterConfig, ConfigError, GatewayConfig, SplitConfig, TenantConfig, describe_errors
from gateway.redis_client import NO_ACCESS, RedisAccess, make_client, redis_call
from gateway.residency.store import StoreUnavailable

log = logging.getLogger(__name__)


@dataclass
class RegistryState:
    tenants: dict[str, TenantConfig] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)
    revoked: set[str] = field(default_factory=set)
    adapters: dict[str, AdapterConfig] = field(default_factory=dict)
    retired: set[str] = field(default_factory=set)
    splits: dict[str, SplitConfig] = field(default_factory=dict)

    def apply(self, change: dict[str, Any]) -> None:
        kind = change["kind"]
        if kind == "set_split":
            split = SplitConfig.model_validate(change["split"])
            self.splits[split.name] = split
        elif kind == "add_adapter":
            adapter = AdapterConfig.model_validate(change["adapter"])
            self.adapters[adapter.name] = adapter
            self.retired.discard(adapter.name)
        elif kind == "retire_adapter":
            self.adapters.pop(change["name"], None)
            self.retired.add(change["name"])
        elif kind == "add_tenant":
            tenant = TenantConfig.model_validate(change["tenant"])
            self.tenants[tenant.id] = tenant
        elif kind == "remove_tenant":
            self.tenants.pop(change["tenant_id"], None)
        elif kind == "add_key":
            self.keys[change["key_hash"]] = change["tenant_id"]
            self.revoked.discard(change["key_hash"])
        elif kind == "revoke_key":
            self.keys.pop(change["key_hash"], None)
            self.revoked.add(change["key_hash"])

    def merged(self, base: GatewayConfig, *, lenient: bool = False) -> GatewayConfig:
        """The config the gateway serves: the file's tenants and these, keys added and revoked. ``lenient``: a
        run-time tenant this config cannot serve (it names an adapter the file lacks, e.g. while files roll out)
        is left out and logged rather than refusing the lot, so revocations always apply."""
        try:
            return self._merge(base, self.tenants)
        except ConfigError:
            if not lenient:
                raise
        adapters = {a.name for a in base.adapters if a.name not in self.retired} | set(self.adapters)
        base_models = {p.base_model for p in base.pools}
        servable = {
            tid: t
            for tid, t in self.tenants.items()
            if set(t.adapters) <= adapters and set(t.base_models) <= base_models
        }
        for tenant_id in sorted(set(self.tenants) - set(servable)):
            log.error("run-time tenant %r names models this config lacks: left out until it has them", tenant_id)
        return self._merge(base, servable)

    def _merge(self, base: GatewayConfig, runtime: dict[str, TenantConfig]) -> GatewayConfig:
        tenants = {tenant.id: tenant for tenant in base.tenants}
        tenants.update(runtime)
        extra: dict[str, list[str]] = {}
        for key_hash, tenant_id in self.keys.items():
            extra.setdefault(tenant_id, []).append(key_hash)
        merged = []
        for tenant in tenants.values():
            keys = [k for k in [*tenant.api_keys, *extra.get(tenant.id, [])] if k not in self.revoked]
            # A retired adapter leaves every tenant's list: their requests for it get the 404 of a missing model.
            adapters = [a for a in tenant.adapters if a not in self.retired]
            merged.append({**tenant.model_dump(), "api_keys": list(dict.fromkeys(keys)), "adapters": adapters})
        catalog = {a.name: a for a in base.adapters if a.name not in self.retired}
        catalog.update(self.adapters)
        splits = {split.name: split for split in base.splits}
        splits.update(self.splits)
        try:
            return GatewayConfig.model_validate(
                {
                    **base.model_dump(),
                    "tenants": merged,
                    "adapters": [a.model_dump() for a in catalog.values()],
                    "splits": [s.model_dump() for s in splits.values()],
                }
            )
        except ValidationError as exc:
            raise ConfigError("tenant registry", describe_errors(exc)) from exc


# KEYS: tenants, keys, revoked, adapters, retired, splits (hashes and sets), read together.
_READ = """
return {redis.call('HGETALL', KEYS[1]), redis.call('HGETALL', KEYS[2]), redis.call('SMEMBERS', KEYS[3]),
        redis.call('HGETALL', KEYS[4]), redis.call('SMEMBERS', KEYS[5]), redis.call('HGETALL', KEYS[6])}
"""


def _pairs(flat: list[str]) -> dict[str, str]:
    return {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}


class Registry:
    def __init__(self, redis_url: str | None, *, prefix: str = "tg", operation_timeout_s: float = 0.5,
                 resync_s: float = 5.0, cluster: bool = False, access: RedisAccess = NO_ACCESS) -> None:  # fmt: skip
        self.state = RegistryState()
        self._prefix, self._timeout_s, self._resync_s = prefix, operation_timeout_s, resync_s
        self._client = (
            make_client(redis_url, operation_timeout_s, cluster=cluster, access=access) if redis_url else None
        )
        self._subscriber = (
            make_client(redis_url, operation_timeout_s, subscriber=True, cluster=cluster, access=access)
            if redis_url
            else None
        )
        self._read = self._client.register_script(_READ) if self._client is not None else None
        self._on_change: Callable[[], None] = lambda: None
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def _channel(self) -> str:
        return f"{self._prefix}:registry"

    async def start(self, on_change: Callable[[], None]) -> None:
        """Load what Redis holds and follow its changes; ``on_change`` runs after each applied change."""
        self._on_change = on_change
        if self._client is None:
            return
        with contextlib.suppress(StoreUnavailable):
            await self._resync()
        self._tasks = [
            asyncio.create_task(self._follow(), name="registry changes"),
            asyncio.create_task(self._resync_forever(), name="registry resync"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._client is not None and self._subscriber is not None:
            await self._client.aclose()
            await self._subscriber.aclose()

    async def change(self, change: dict[str, Any], base: GatewayConfig) -> GatewayConfig:
        """Validate a change against the merged config, store and publish it; returns the new merged config."""
        current = self.state
        trial = RegistryState(
            dict(current.tenants),
            dict(current.keys),
            set(current.revoked),
            dict(current.adapters),
            set(current.retired),
            dict(current.splits),
        )
        try:
            trial.apply(change)
        except ValidationError as exc:
            raise ConfigError("tenant", describe_errors(exc)) from exc
        merged = trial.merged(base)  # raises ConfigError: refused whole
        if self._client is not None:
            await self._store(change)
        self.state = trial
        self._on_change()
        return merged

    async def _store(self, change: dict[str, Any]) -> None:
        p, kind = self._prefix, change["kind"]
        async with redis_call("registry change", self._timeout_s), self._client.pipeline(transaction=True) as pipe:  # type: ignore[union-attr]
            if kind == "set_split":
                pipe.hset(f"{p}:{{registry}}:splits", change["split"]["name"], json.dumps(change["split"]))
            elif kind == "add_adapter":
                pipe.hset(f"{p}:{{registry}}:adapters", change["adapter"]["name"], json.dumps(change["adapter"]))
                pipe.srem(f"{p}:{{registry}}:retired", change["adapter"]["name"])
            elif kind == "retire_adapter":
                pipe.hdel(f"{p}:{{registry}}:adapters", change["name"])
                pipe.sadd(f"{p}:{{registry}}:retired", change["name"])
            elif kind == "add_tenant":
                pipe.hset(f"{p}:{{registry}}:tenants", change["tenant"]["id"], json.dumps(change["tenant"]))
            elif kind == "remove_tenant":
                pipe.hdel(f"{p}:{{registry}}:tenants", change["tenant_id"])
            elif kind == "add_key":
                pipe.hset(f"{p}:{{registry}}:keys", change["key_hash"], change["tenant_id"])
                pipe.srem(f"{p}:{{registry}}:revoked", change["key_hash"])
            elif kind == "revoke_key":
                pipe.hdel(f"{p}:{{registry}}:keys", change["key_hash"])
                pipe.sadd(f"{p}:{{registry}}:revoked", change["key_hash"])
            await pipe.execute()
        # Apart from the MULTI: PUBLISH names no key, so on a cluster it cannot join a one-slot transaction.
        async with redis_call("registry publish", self._timeout_s):
            await self._client.publish(self._channel, json.dumps(change))  # type: ignore[union-attr]

    async def _resync(self) -> None:
        p, read = self._prefix, self._read
        assert read is not None
        names = ("tenants", "keys", "revoked", "adapters", "retired", "splits")
        async with redis_call("registry read", self._timeout_s):
            # One script: an atomic read of the six keys (one slot on a cluster: the {registry} hash tag).
            reply = cast(list[Any], await read(keys=[f"{p}:{{registry}}:{name}" for name in names]))
        tenants, keys, adapters, splits = (_pairs(reply[i]) for i in (0, 1, 3, 5))
        revoked, retired = reply[2], reply[4]
        state = RegistryState(
            {tid: TenantConfig.model_validate_json(raw) for tid, raw in tenants.items()},
            dict(keys),
            set(revoked),
            {name: AdapterConfig.model_validate_json(raw) for name, raw in adapters.items()},
            set(retired),
            {name: SplitConfig.model_validate_json(raw) for name, raw in splits.items()},
        )
        if state != self.state:
            self.state = state
            self._on_change()

    async def _follow(self) -> None:
        assert self._subscriber is not None
        while True:
            try:
                if isinstance(self._subscriber, RedisCluster):
                    await self._subscriber.initialize()  # its pub/sub needs the slot map first
                async with self._subscriber.pubsub() as pubsub:
                    await pubsub.subscribe(self._channel)
                    await self._resync()  # whatever changed while we were not listening
                    async for message in pubsub.listen():
                        if message.get("type") == "message":
                            self.state.apply(json.loads(message["data"]))
                            self._on_change()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: try again shortly; the resync loop repairs the rest
                log.warning("registry: not following changes (%s); retrying", exc)
                await asyncio.sleep(1.0)

    async def _resync_forever(self) -> None:
        while True:
            await asyncio.sleep(self._resync_s)
            try:
                await self._resync()
            except StoreUnavailable as exc:
                log.debug("registry resync skipped: %s", exc)
            except Exception:
                log.exception("registry resync failed")
