"""Who is calling, and which models they may call.

API keys are stored only as ``sha256:<hex>``. A presented key is hashed and looked up by its digest, so no
comparison ever touches the secret itself. A model the tenant may not use gets the same 404 as one that does not
exist, so one tenant cannot learn another's adapter names.
"""

from __future__ import annotations

import hashlib
import ipaddress
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

from gateway.config import AdapterConfig, AuthConfig, GatewayConfig, RoutingConfig
from gateway.errors import AuthenticationFailed, ModelNotFound


def _within(peer: str, auth: AuthConfig) -> bool:
    try:
        address = ipaddress.ip_address(peer)
    except ValueError:
        return False
    return any(address in network for network in auth.trusted_networks)


def hash_key(api_key: str) -> str:
    """The stored form of an API key."""
    return "sha256:" + hashlib.sha256(api_key.encode()).hexdigest()


@dataclass(frozen=True)
class Target:
    """What a request runs on: a pool, and the adapter in it (None for the base model). A split's target has
    ``variants`` (cumulative weight share, target) instead, and ``pick`` chooses one per end user."""

    model: str
    pool: str
    engine_model: str
    adapter: AdapterConfig | None
    variants: tuple[tuple[float, Target], ...] = ()

    def pick(self, tenant_id: str, user: str | None) -> Target:
        """The variant for this end user: a hash of tenant, split and user, so the same user always gets the same
        one; without a user, each request draws afresh."""
        if not self.variants:
            return self
        key = f"{tenant_id}/{self.model}/{user if user is not None else secrets.token_hex(8)}"
        point = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") / 2**64
        return next((target for bound, target in self.variants if point < bound), self.variants[-1][1])


@dataclass(frozen=True)
class Tenant:
    id: str
    targets: dict[str, Target]
    default_model: str


class TenantDirectory:
    def __init__(self, config: GatewayConfig) -> None:
        adapters = {adapter.name: adapter for adapter in config.adapters}
        pools_by_base = {pool.base_model: pool for pool in config.pools}
        pools = {pool.name: pool for pool in config.pools}
        self._by_key_hash: dict[str, Tenant] = {}
        self._by_id: dict[str, Tenant] = {}

        def target(name: str) -> Target:
            if name in adapters:
                adapter = adapters[name]
                return Target(name, adapter.pool, adapter.engine_name or adapter.name, adapter)
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
            splits[split.name] = Target(split.name, first.pool, first.engine_model, first.adapter, tuple(variants))
        for tenant_config in config.tenants:
            targets: dict[str, Target] = {}
            for name in tenant_config.adapters:
                targets[name] = splits[name] if name in splits else target(name)
            for base in tenant_config.base_models:
                targets[base] = Target(base, pools_by_base[base].name, pools[pools_by_base[base].name].base_model, None)
            tenant = Tenant(tenant_config.id, targets, next(iter(targets)))
            self._by_id[tenant.id] = tenant
            for key_hash in tenant_config.api_keys:
                self._by_key_hash[key_hash] = tenant

    def authenticate(self, authorization: str | None) -> Tenant:
        scheme, _, api_key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not api_key.strip():
            raise AuthenticationFailed("Missing API key: send 'Authorization: Bearer <key>'.")
        tenant = self._by_key_hash.get(hash_key(api_key.strip()))
        if tenant is None:
            raise AuthenticationFailed("Incorrect API key provided.")
        return tenant

    def identify(self, headers: Mapping[str, str], peer: str | None, auth: AuthConfig) -> Tenant:
        """The caller: by the trusted header when it comes from a trusted network, else by its API key."""
        if auth.trusted_header and peer is not None:
            claimed = headers.get(auth.trusted_header)
            if claimed is not None and _within(peer, auth):
                tenant = self._by_id.get(claimed)
                if tenant is None:
                    raise AuthenticationFailed("Unknown tenant in the trusted header.")
                return tenant
        return self.authenticate(headers.get("Authorization"))

    def tenant(self, tenant_id: str) -> Tenant | None:
        return self._by_id.get(tenant_id)

    @staticmethod
    def resolve(tenant: Tenant, model: str | None) -> Target:
        """The tenant's target for ``model``; an absent model means the tenant's first adapter."""
        if model is None:
            return tenant.targets[tenant.default_model]
        target = tenant.targets.get(model)
        if target is None:
            raise ModelNotFound(f"The model '{model}' does not exist or you do not have access to it.", param="model")
        return target


def affinity_key(routing: RoutingConfig, tenant: Tenant, target: Target, session_id: str | None) -> str:
    """The ring key a request is routed by; ``target`` is what it runs on (a split's picked variant)."""
    if routing.affinity == "adapter":
        return target.model
    if routing.affinity == "session" and session_id:
        # A digest, not the id itself: a session id is client input of any length, and keys are kept (ring memo).
        return f"{tenant.id}/{hashlib.blake2b(session_id.encode(), digest_size=12).hexdigest()}"
    return tenant.id
