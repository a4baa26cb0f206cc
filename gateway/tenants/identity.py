"""Who is calling: a tenant by its API key, or by a trusted header from a trusted network.

API keys are stored only as ``sha256:<hex>``. A presented key is hashed and looked up by its digest, so no
comparison ever touches the secret itself.
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Mapping

from gateway.config import AuthConfig
from gateway.errors import AuthenticationFailed
from gateway.tenants.directory import Tenant, TenantDirectory


def hash_key(api_key: str) -> str:
    """The stored form of an API key. aiohttp hands undecodable header bytes over as surrogate escapes, which
    plain ``encode()`` refuses (a 500 once): they are hashed as the bytes that were sent."""
    return "sha256:" + hashlib.sha256(api_key.encode("utf-8", "surrogateescape")).hexdigest()


def identify(directory: TenantDirectory, headers: Mapping[str, str], peer: str | None, auth: AuthConfig) -> Tenant:
    """The caller: by the trusted header when it comes from a trusted network, else by its API key."""
    if auth.trusted_header and peer is not None:
        claimed = headers.get(auth.trusted_header)
        if claimed is not None and _within(peer, auth):
            tenant = directory.by_id.get(claimed)
            if tenant is None:
                raise AuthenticationFailed("Unknown tenant in the trusted header.")
            return tenant
    return authenticate(directory, headers.get("Authorization"))


def authenticate(directory: TenantDirectory, authorization: str | None) -> Tenant:
    scheme, _, api_key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not api_key.strip():
        raise AuthenticationFailed("Missing API key: send 'Authorization: Bearer <key>'.")
    tenant = directory.by_key_hash.get(hash_key(api_key.strip()))
    if tenant is None:
        raise AuthenticationFailed("Incorrect API key provided.")
    return tenant


def _within(peer: str, auth: AuthConfig) -> bool:
    try:
        address = ipaddress.ip_address(peer)
    except ValueError:
        return False
    return any(address in network for network in auth.trusted_networks)
