"""Tenants, keys and adapters changed at run time, on top of the config file (which stays the seed).

Through the admin API an operator adds or removes tenants, adds or revokes API keys (as ``sha256:`` hashes), and
adds or retires adapters in the catalog, without a restart. Alone, a gateway keeps these changes in memory. With
Redis they live there and every gateway sharing it applies each change as soon as it is published: the message
carries the change itself, so applying it costs no Redis round trip; a resync every ``resync_s`` repairs a missed
message. A retired adapter leaves every tenant's list (its requests get the 404 of a missing model).

Every change, stored and published, is signed and versioned (gateway/tenants/signing.py): a forged or replayed
one is refused and logged. The latest change of an entity (a key, a tenant, an adapter, a split) is its state, so
Redis holds one signed envelope per entity. Redis layout:

- ``{prefix}:{registry}:entries``  HASH entity (``key:sha256:...``, ``tenant:ID``, ``adapter:NAME``, ``split:NAME``)
  -> its latest change as a signed envelope ``{"change", "version", "mac"}``;
- ``{prefix}:{registry}:head``     the signed head: the latest version and a digest of every entity's version;
- ``{prefix}:{registry}:lock``     held while a gateway writes a change (versions are counted under it);
- ``{prefix}:registry``          the pub/sub channel: each change's envelope.

The braces are a Redis Cluster hash tag: every registry key lives in one slot, so a change is one MULTI.

Every change is validated exactly as the config file is (the merged config must load) and refused whole if not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any, cast

from pydantic import ValidationError

from gateway.config import AdapterConfig, ConfigError, GatewayConfig, SplitConfig, TenantConfig, describe_errors
from gateway.observe.metrics import GatewayMetrics
from gateway.redis_client import NO_ACCESS, RedisAccess, channel_messages, make_client, redis_call
from gateway.residency.store import StoreUnavailable
from gateway.tasks import cancel_and_wait
from gateway.tenants.signing import Refused, Signer, digest, entity, known_entity

log = logging.getLogger(__name__)

# What applying a signed change of a known kind raises when another version's gateway signed it in a shape this one
# cannot apply: a model this schema refuses (ValidationError), a field under another name (KeyError), a list where
# this version has a string (TypeError). Such a change is refused alone; past the handling, any of them failed
# start-up and every resync.
_UNREADABLE = (ValidationError, KeyError, TypeError)


def _text(change: dict[str, Any], field: str) -> str:
    """A change's name field, checked: a number or a list there (another version's shape) was kept as it was, and
    a key's tenant that is not a string raised out of every merge later (TypeError: unhashable), not here."""
    value = change[field]
    if not isinstance(value, str):
        raise TypeError(f"{field} is {type(value).__name__}, not a string")
    return value


@dataclass
class RegistryState:
    tenants: dict[str, TenantConfig] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)
    revoked: set[str] = field(default_factory=set)
    adapters: dict[str, AdapterConfig] = field(default_factory=dict)
    retired: set[str] = field(default_factory=set)
    splits: dict[str, SplitConfig] = field(default_factory=dict)
    # Each entity's version, and the latest version applied (signing.py): nothing older is applied again.
    versions: dict[str, int] = field(default_factory=dict)
    version: int = 0

    def copy(self) -> RegistryState:
        return replace(
            self, tenants=dict(self.tenants), keys=dict(self.keys), revoked=set(self.revoked),
            adapters=dict(self.adapters), retired=set(self.retired), splits=dict(self.splits),
            versions=dict(self.versions),
        )  # fmt: skip

    def accept(self, change: dict[str, Any], version: int) -> None:
        """Apply a change as the entity's ``version``."""
        self.apply(change)
        self.versions[entity(change)] = version
        self.version = max(self.version, version)

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
            name = _text(change, "name")
            self.adapters.pop(name, None)
            self.retired.add(name)
        elif kind == "add_tenant":
            tenant = TenantConfig.model_validate(change["tenant"])
            self.tenants[tenant.id] = tenant
        elif kind == "remove_tenant":
            self.tenants.pop(_text(change, "tenant_id"), None)
        elif kind == "add_key":
            key_hash, tenant_id = _text(change, "key_hash"), _text(change, "tenant_id")
            self.keys[key_hash] = tenant_id
            self.revoked.discard(key_hash)
        elif kind == "revoke_key":
            key_hash = _text(change, "key_hash")
            self.keys.pop(key_hash, None)
            self.revoked.add(key_hash)

    def merged(self, base: GatewayConfig, *, lenient: bool = False) -> GatewayConfig:
        """The config the gateway serves: the file's tenants and these, keys added and revoked. ``lenient``: a
        run-time adapter, split or tenant this config cannot serve (a pool or a model the file lacks: files rolling
        out, or gateways with different configs sharing the registry) is left out and logged rather than refusing
        the lot, so revocations always apply. (An adapter in a pool only another gateway's config has failed the
        whole merge: that gateway applied no registry change from then on, a revoked key included.)"""
        try:
            return self._merge(base, self.tenants, self.adapters, self.splits)
        except ConfigError:
            if not lenient:
                raise
        # Left out in steps, each only if the one before still fails: what names a pool or model this config lacks;
        # then the whole run-time catalog (an adapter's name or engine name clashing with one of this config's);
        # then every run-time tenant. The last is the file's tenants with keys added and revoked: always valid.
        problem: ConfigError | None = None
        for catalog in (
            (self.adapters, self.splits),
            ({}, {}),
            None,
        ):
            tenants, adapters, splits = self._servable(base, *catalog) if catalog is not None else ({}, {}, {})
            try:
                merged = self._merge(base, tenants, adapters, splits)
            except ConfigError as exc:
                problem = exc
                continue
            for kind, left_out in (
                ("adapter", set(self.adapters) - set(adapters)),
                ("split", set(self.splits) - set(splits)),
                ("tenant", set(self.tenants) - set(tenants)),
            ):
                for name in sorted(left_out):
                    log.error("run-time %s %r cannot be served by this config: left out until it can", kind, name)
            return merged
        assert problem is not None
        raise problem

    def _servable(
        self, base: GatewayConfig, adapters: dict[str, AdapterConfig], splits: dict[str, SplitConfig]
    ) -> tuple[dict[str, TenantConfig], dict[str, AdapterConfig], dict[str, SplitConfig]]:
        """The run-time tenants, adapters and splits (of ``adapters`` and ``splits``) whose pools and models this
        config has."""
        pools = {p.name for p in base.pools}
        base_models = {p.base_model for p in base.pools}
        kept = {n: a for n, a in adapters.items() if a.pool in pools and n not in base_models}
        models = {a.name for a in base.adapters if a.name not in self.retired} | set(kept) | base_models
        kept_splits = {n: s for n, s in splits.items() if all(v.model in models for v in s.variants)}
        # What a tenant may name: an adapter, or a split.
        targets = (models - base_models) | {split.name for split in base.splits} | set(kept_splits)
        tenants = {
            tid: t
            for tid, t in self.tenants.items()
            if set(t.adapters) <= targets and set(t.base_models) <= base_models
        }
        return tenants, kept, kept_splits

    def _merge(
        self,
        base: GatewayConfig,
        runtime: dict[str, TenantConfig],
        runtime_adapters: dict[str, AdapterConfig],
        runtime_splits: dict[str, SplitConfig],
    ) -> GatewayConfig:
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
        catalog.update(runtime_adapters)
        splits = {split.name: split for split in base.splits}
        splits.update(runtime_splits)
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


# KEYS: entries, head: read together (the head must describe exactly these entries). A key of another type than the
# gateways write there (someone's SET on the entries, an HSET on the head) answers {false, key, type}: without the
# check the read failed with WRONGTYPE, which reads as Redis being away, so the registry was taken for unreachable
# (logged at debug, every resync) instead of altered. Not repaired as other stores' keys are (OWNED_LUA): the entries
# are signed changes no gateway can write back, so it is refused like any alteration, until an operator restores it.
_READ = """
local kinds = {'hash', 'string'}
for i = 1, 2 do
  local held = redis.call('TYPE', KEYS[i]).ok
  if held ~= 'none' and held ~= kinds[i] then return {false, KEYS[i], held} end
end
return {redis.call('HGETALL', KEYS[1]), redis.call('GET', KEYS[2])}
"""
# KEYS: lock; ARGV: the holder's token. Release only one's own lock.
_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
_LOCK_TTL_MS = 10_000
_LOCK_WAIT_S = 5.0


def _pairs(flat: list[str]) -> dict[str, str]:
    return {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}


class Registry:
    def __init__(self, redis_url: str | None, *, prefix: str = "tg", operation_timeout_s: float = 0.5,
                 resync_s: float = 5.0, cluster: bool = False, access: RedisAccess = NO_ACCESS,
                 signing_key: bytes | None = None, metrics: GatewayMetrics | None = None) -> None:  # fmt: skip
        self.state = RegistryState()
        self._signer, self._metrics = Signer(signing_key), metrics
        self._last_refusal = ""
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
        self._unlock = self._client.register_script(_UNLOCK) if self._client is not None else None
        self._on_change: Callable[[], None] = lambda: None
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False  # the loops below stop retrying: a cancellation they lost cannot keep them alive

    @property
    def _channel(self) -> str:
        return f"{self._prefix}:registry"

    def _key(self, name: str) -> str:
        return f"{self._prefix}:{{registry}}:{name}"

    def _refused(self, reason: str, source: str, message: str) -> None:
        """Counted each time; logged once per distinct problem (a resync meets the same one every few seconds)."""
        if self._metrics is not None:
            self._metrics.registry_refused.labels(reason, source).inc()
        line = f"{reason}:{source}:{message}"
        if line != self._last_refusal:
            self._last_refusal = line
            log.error("registry: refused a %s %s entry: %s", reason, source, message)

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
        self._closing = True
        await cancel_and_wait(self._tasks)
        if self._client is not None and self._subscriber is not None:
            await self._client.aclose()
            await self._subscriber.aclose()

    async def change(self, change: dict[str, Any], base: GatewayConfig) -> GatewayConfig:
        """Validate a change against the merged config, store and publish it; returns the new merged config."""
        trial = self.state.copy()
        try:
            where = entity(change)
            trial.apply(change)
            merged = trial.merged(base)  # raises ConfigError: refused whole
        except ConfigError:
            raise
        except ValidationError as exc:
            raise ConfigError("tenant", describe_errors(exc)) from exc
        except Exception as exc:  # any change that fails to apply is refused (a 400), not a 500
            # A change missing its body (KeyError), naming something by a list (TypeError), of an unknown kind
            # (Refused): the admin API answered 500 for these, as only pydantic's errors were caught.
            raise ConfigError("tenant", [f"the change cannot be applied: {exc!r}"]) from exc
        version = await self._store(change) if self._client is not None else self.state.version + 1
        trial.versions[where] = version
        trial.version = max(trial.version, version)
        self.state = trial
        self._on_change()
        return merged

    @contextlib.asynccontextmanager
    async def _locked(self) -> AsyncIterator[None]:
        """The registry's writer lock: versions are counted, and the head rewritten, by one gateway at a time."""
        assert self._client is not None and self._unlock is not None
        token, deadline = secrets.token_hex(16), time.monotonic() + _LOCK_WAIT_S
        while True:
            async with redis_call("registry lock", self._timeout_s):
                if await self._client.set(self._key("lock"), token, nx=True, px=_LOCK_TTL_MS):
                    break
            if time.monotonic() > deadline:
                raise StoreUnavailable("the registry is locked by another change; try again")
            await asyncio.sleep(0.05)
        try:
            yield
        finally:
            with contextlib.suppress(StoreUnavailable):
                async with redis_call("registry unlock", self._timeout_s):
                    await self._unlock(keys=[self._key("lock")], args=[token])

    async def _snapshot(self) -> tuple[int, list[tuple[dict[str, Any], int]], dict[str, int]]:
        """What Redis holds, checked: the head's version, every entry's change and version this version can read,
        and every entry's version by entity, those included (``Refused``: a forged entry or head, or entries the
        head does not describe)."""
        assert self._read is not None
        async with redis_call("registry read", self._timeout_s):
            answer = cast(list[Any], await self._read(keys=[self._key("entries"), self._key("head")]))
        if len(answer) == 3:
            _, key, held = answer
            raise Refused("altered", f"{key} holds a {held}, not what the gateways write there")
        flat, raw_head = answer
        entries = _pairs(flat)
        if raw_head is None:
            if entries:
                raise Refused("altered", "the registry has entries but no head")
            return 0, [], {}
        head_version, signed_digest = self._signer.open_head(raw_head)
        opened, versions = [], {}
        for name, raw in entries.items():
            try:
                change, version = self._signer.open_signed(raw)
            except Refused as exc:
                raise Refused("altered", f"entry {name!r}: {exc}") from exc
            if version > head_version:
                raise Refused("altered", f"entry {name!r} is not where or when it was signed")
            versions[name] = version  # the head's digest covers it whether or not this version can read it
            try:
                where = known_entity(change)
            except Refused as exc:  # another version's kind or shape: refused alone, the rest is believed
                self._refused(exc.reason, "stored", f"entry {name!r}: {exc}")
                continue
            if where != name:
                raise Refused("altered", f"entry {name!r} is not where or when it was signed")
            opened.append((change, version))
        if digest(versions) != signed_digest:
            raise Refused("altered", "entries were deleted, added or replaced by older ones since the head was signed")
        return head_version, sorted(opened, key=lambda pair: pair[1]), versions

    async def _store(self, change: dict[str, Any]) -> int:
        """Sign the change with the next version, store it and the new head under the lock, publish it."""
        assert self._client is not None
        if not self._signer.can_sign:
            raise StoreUnavailable("no registry signing key (state.registry_key_env, or an admin token)")
        async with self._locked():
            try:
                head_version, _, versions = await self._snapshot()
            except Refused as exc:
                self._refused(exc.reason, "stored", str(exc))
                raise StoreUnavailable(f"the registry in Redis was altered outside the gateways: {exc}") from exc
            version = head_version + 1
            versions[entity(change)] = version  # every entry's, those this version cannot read included
            envelope = self._signer.envelope(change, version)
            async with redis_call("registry change", self._timeout_s), self._client.pipeline(transaction=True) as pipe:
                pipe.hset(self._key("entries"), entity(change), json.dumps(envelope))
                pipe.set(self._key("head"), json.dumps(self._signer.head(version, versions)))
                await pipe.execute()
        # Apart from the MULTI: PUBLISH names no key, so on a cluster it cannot join a one-slot transaction.
        async with redis_call("registry publish", self._timeout_s):
            await self._client.publish(self._channel, json.dumps(envelope))
        return version

    async def _resync(self) -> None:
        try:
            head_version, entries, _ = await self._snapshot()
        except Refused as exc:
            self._refused(exc.reason, "stored", str(exc))
            return
        if head_version < self.state.version:  # an older registry put back in place of the current one
            message = f"its head is version {head_version}, this gateway has applied {self.state.version}"
            self._refused("stale", "stored", message)
            return
        state = RegistryState()
        for change, version in entries:
            try:
                state.accept(change, version)
            except _UNREADABLE as exc:  # signed by a gateway that validated it: another version's schema
                # Refused alone (its version kept, so nothing older replaces it): it raised out of start-up, and
                # out of every resync, the subscription's included, so no change applied here from then on.
                state.versions[entity(change)] = version
                self._refused("invalid", "stored", str(exc)[:200])
        state.version = head_version
        if state != self.state:
            self.state = state
            self._on_change()

    def _message(self, data: str | bytes) -> None:
        """A published change: applied if signed and newer than what this gateway has for its entity."""
        try:
            change, version = self._signer.open(data)
        except Refused as exc:
            self._refused(exc.reason, "message", str(exc))
            return
        known = self.state.versions.get(entity(change), 0)
        if version == known:
            return  # this gateway's own change, or one a resync already brought
        if version < known:
            self._refused("stale", "message", f"{change['kind']} version {version}, after version {known}")
            return
        try:
            self.state.accept(change, version)
        except _UNREADABLE as exc:  # signed by a gateway that validated it: another version's schema
            self._refused("invalid", "message", str(exc)[:200])
            return
        self._on_change()

    async def _follow(self) -> None:
        assert self._subscriber is not None
        while True:
            try:
                async for message in channel_messages(self._subscriber, self._channel):
                    if message.get("type") == "subscribe":
                        await self._resync()  # whatever changed while we were not listening
                    elif message.get("type") == "message":
                        self._message(message["data"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: try again shortly; the resync loop repairs the rest
                if self._closing:
                    return
                log.warning("registry: not following changes (%s); retrying", exc)
                await asyncio.sleep(1.0)

    async def _resync_forever(self) -> None:
        while not self._closing:
            await asyncio.sleep(self._resync_s)
            try:
                await self._resync()
            except StoreUnavailable as exc:
                log.debug("registry resync skipped: %s", exc)
            except Exception:
                log.exception("registry resync failed")
