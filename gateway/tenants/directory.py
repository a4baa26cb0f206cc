"""The tenants and what they may call: each tenant's models (adapters, base models, A/B splits) and what a request
for one runs on. A model the tenant may not use gets the same 404 as one that does not exist, so one tenant cannot
learn another's adapter names. Who is calling is identity.py's question."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import NamedTuple

from backends.base import AdapterRef
from gateway.config import AdapterConfig, GatewayConfig, RoutingConfig
from gateway.errors import ModelNotFound


@dataclass(frozen=True)
class Target:
    """What a request runs on: a pool, and the adapter in it (None for the base model). A split's target has
    ``variants`` (cumulative weight share, target) instead, and ``pick`` chooses one per end user."""

    model: str
    pool: str
    engine_model: str
    adapter: AdapterConfig | None
    variants: tuple[tuple[float, Target], ...] = ()
    # The adapter as the engine knows it (built once here, not per request); None for the base model.
    adapter_ref: AdapterRef | None = None
    # The tenant's prefix-cache salt when another tenant can call the same engine model and the pool salts
    # (pools[].cache_salt); None otherwise. Sent to the engine as cache_salt.
    cache_salt: str | None = None

    def pick(self, tenant_id: str, user: str | None) -> Target:
        """The variant for this end user: a hash of tenant, split and user, so the same user always gets the same
        one; without a user, each request draws afresh."""
        if not self.variants:
            return self
        key = f"{tenant_id}/{self.model}/{user if user is not None else secrets.token_hex(8)}"
        point = int.from_bytes(hashlib.blake2b(sent_bytes(key), digest_size=8).digest(), "big") / 2**64
        return next((target for bound, target in self.variants if point < bound), self.variants[-1][1])


@dataclass(frozen=True)
class Tenant:
    id: str
    targets: dict[str, Target]
    default_model: str


class Routed(NamedTuple):  # immutable; one per request, and a named tuple costs a third of a frozen dataclass
    """A request's model resolved: what it runs on, the split variant picked (None without a split), its ring key."""

    target: Target
    variant: str | None
    key: str


class TenantDirectory:
    def __init__(self, config: GatewayConfig) -> None:
        adapters = {adapter.name: adapter for adapter in config.adapters}
        pools_by_base = {pool.base_model: pool for pool in config.pools}
        pools = {pool.name: pool for pool in config.pools}
        # Read by identity.py: each tenant by the sha256 of each of its API keys, and by its id.
        self.by_key_hash: dict[str, Tenant] = {}
        self.by_id: dict[str, Tenant] = {}

        def target(name: str) -> Target:
            if name in adapters:
                adapter = adapters[name]
                engine_name = adapter.engine_name or adapter.name
                return Target(
                    name, adapter.pool, engine_name, adapter, adapter_ref=AdapterRef(engine_name, adapter.source)
                )
            pool = pools_by_base[name]
            return Target(name, pool.name, pool.base_model, None)

        splits = {}
        for split in config.splits:
            total = sum(v.weight for v in split.variants)
            bound, variants = 0.0, []
            for variant in split.variants:
                bound += variant.weight / total
                variants.append((bound, target(variant.model)))
            first = variants[0][1]
            splits[split.name] = Target(
                split.name, first.pool, first.engine_model, first.adapter, tuple(variants), first.adapter_ref
            )
        every: dict[str, dict[str, Target]] = {}
        for tenant_config in config.tenants:
            targets: dict[str, Target] = {}
            for name in tenant_config.adapters:
                targets[name] = splits[name] if name in splits else target(name)
            for base in tenant_config.base_models:
                targets[base] = Target(base, pools_by_base[base].name, pools[pools_by_base[base].name].base_model, None)
            every[tenant_config.id] = targets
        salted = _salted(every, {pool.name for pool in config.pools if pool.salts_prefix_cache})
        for tenant_config in config.tenants:
            targets = salted[tenant_config.id]
            tenant = Tenant(tenant_config.id, targets, next(iter(targets)))
            self.by_id[tenant.id] = tenant
            for key_hash in tenant_config.api_keys:
                self.by_key_hash[key_hash] = tenant

    def tenant(self, tenant_id: str) -> Tenant | None:
        return self.by_id.get(tenant_id)

    @staticmethod
    def route(tenant: Tenant, model: str | None, session_id: str | None, routing: RoutingConfig) -> Routed:
        """What a request for ``model`` runs on and the key it is routed by: a split's variant picked for this end
        user (``session_id``: the x-session-id header or the OpenAI ``user``)."""
        target = TenantDirectory.resolve(tenant, model)
        variant = None
        if target.variants:  # an A/B split: this end user's variant, from now on the request's model
            target = target.pick(tenant.id, session_id)
            variant = target.model
        return Routed(target, variant, affinity_key(routing, tenant, target, session_id))

    @staticmethod
    def resolve(tenant: Tenant, model: str | None) -> Target:
        """The tenant's target for ``model``; an absent model means the tenant's first adapter."""
        if model is None:
            return tenant.targets[tenant.default_model]
        target = tenant.targets.get(model)
        if target is None:
            raise ModelNotFound(f"The model '{model}' does not exist or you do not have access to it.", param="model")
        return target


def cache_salt(tenant_id: str) -> str:
    """A tenant's prefix-cache salt: its own, stable across gateways and restarts (so its cache stays warm), and
    not its id (engines log requests). Clients cannot send one: cache_salt is not a request field they may set."""
    return hashlib.blake2b(f"tenantgate cache salt/{tenant_id}".encode(), digest_size=16).hexdigest()


def _salted(every: dict[str, dict[str, Target]], salting_pools: set[str]) -> dict[str, dict[str, Target]]:
    """Each tenant's targets, those on an engine model another tenant can call too (in a pool that salts) with the
    tenant's cache salt: a split's variants each, as a variant is what a request runs on."""

    def leaves(target: Target) -> list[Target]:
        return [variant for _, variant in target.variants] if target.variants else [target]

    callers: dict[tuple[str, str], set[str]] = {}
    for tenant_id, targets in every.items():
        for target in targets.values():
            for leaf in leaves(target):
                callers.setdefault((leaf.pool, leaf.engine_model), set()).add(tenant_id)

    def salt(target: Target, tenant_id: str) -> Target:
        if target.variants:
            variants = tuple((bound, salt(variant, tenant_id)) for bound, variant in target.variants)
            return replace(target, variants=variants, cache_salt=variants[0][1].cache_salt)
        shared = len(callers[(target.pool, target.engine_model)]) > 1
        return replace(target, cache_salt=cache_salt(tenant_id)) if shared and target.pool in salting_pools else target

    return {tid: {name: salt(t, tid) for name, t in targets.items()} for tid, targets in every.items()}


def affinity_key(routing: RoutingConfig, tenant: Tenant, target: Target, session_id: str | None) -> str:
    """The ring key a request is routed by; ``target`` is what it runs on (a split's picked variant)."""
    if routing.affinity == "adapter":
        return target.model
    if routing.affinity == "session" and session_id:
        # A digest, not the id itself: a session id is client input of any length, and keys are kept (ring memo).
        return f"{tenant.id}/{hashlib.blake2b(sent_bytes(session_id), digest_size=12).hexdigest()}"
    return tenant.id


def sent_bytes(text: str) -> bytes:
    """A header's text as the bytes the client sent: aiohttp hands a header's bytes that are not UTF-8 on as lone
    surrogates (``b"\xff"`` is ``"\udcff"``), which ``str.encode`` refuses (an x-session-id, an API key or an admin
    token of such bytes was a 500 and a traceback); valid text encodes as before, so no key, hash or variant moves."""
    return text.encode("utf-8", "surrogateescape")


def keyed_targets(config: GatewayConfig) -> Iterator[tuple[Target, str]]:
    """What each tenant of ``config`` runs on (each variant of a split), with the ring key of its requests without
    a session id, as ingress derives it; in the config's order (tenants, each tenant's models, a split's variants
    as listed). The walk that home balancing and the fill plan both make, over one directory."""
    directory = TenantDirectory(config)
    for tenant_config in config.tenants:
        tenant = directory.tenant(tenant_config.id)
        assert tenant is not None  # the directory holds every tenant of the config it was built from
        for target in tenant.targets.values():
            for runs_on in [variant for _, variant in target.variants] or [target]:
                yield runs_on, affinity_key(config.routing, tenant, runs_on, None)
