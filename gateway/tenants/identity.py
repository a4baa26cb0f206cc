"""Who is calling: a tenant by its API key, or by a trusted header from a trusted network.

API keys are stored only as ``sha256:<hex>``. A presented key is hashed and looked up by its digest, so no
comparison ever touches the secret itself.
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Mapping, Sequence

from multidict import MultiMapping

from gateway.config import AuthConfig
from gateway.errors import AuthenticationFailed, InvalidRequest
from gateway.tenants.directory import Tenant, TenantDirectory, sent_bytes


def hash_key(api_key: str) -> str:
    """The stored form of an API key, hashed as the bytes that were sent (``sent_bytes``)."""
    return "sha256:" + hashlib.sha256(sent_bytes(api_key)).hexdigest()


def identify(directory: TenantDirectory, headers: Mapping[str, str], peer: str | None, auth: AuthConfig) -> Tenant:
    """The caller: by the trusted header when it comes from a trusted network, else by its API key. From a trusted
    network the header must be there once (a repeated one is refused, not read first-wins), and a key sent with it
    must not be another tenant's: a proxy that forwards a client's key and sets the header can never be made to
    act for one tenant on another's key. (A credential that is no tenant's key, such as the ingress's own token
    passed through, says nothing: the header decides.)"""
    if auth.trusted_header and peer is not None and within(peer, auth.trusted_networks):
        claimed = _all(headers, auth.trusted_header)
        if len(claimed) > 1:
            raise InvalidRequest(f"The {auth.trusted_header} header is repeated: send it once.")
        if claimed:
            tenant = directory.by_id.get(claimed[0])
            if tenant is None:
                raise AuthenticationFailed("Unknown tenant in the trusted header.")
            keyed = _key_tenant(directory, _authorization(headers))
            if keyed is not None and keyed.id != tenant.id:
                raise AuthenticationFailed(f"The API key and the {auth.trusted_header} header name different tenants.")
            return tenant
    return authenticate(directory, _authorization(headers))


def _key_tenant(directory: TenantDirectory, authorization: str | None) -> Tenant | None:
    """The tenant whose API key this is, if it is one."""
    api_key = bearer(authorization)
    return None if api_key is None else directory.by_key_hash.get(hash_key(api_key))


def _all(headers: Mapping[str, str], name: str) -> list[str]:
    """Every value of a header (aiohttp's headers are a multi-mapping; a plain mapping holds one)."""
    if isinstance(headers, MultiMapping) or hasattr(headers, "getall"):  # aiohttp's, or the own server's Head
        return list(headers.getall(name, []))
    for key in (name.lower(), name):  # the own server's names are lower-cased (gateway/serving/incoming.py)
        if key in headers:
            return [headers[key]]
    return []


def _authorization(headers: Mapping[str, str]) -> str | None:
    """The Authorization header: aiohttp's headers are case-insensitive, the own server's names lower-cased, and a
    plain mapping's as written."""
    value = headers.get("authorization")
    return value if value is not None else headers.get("Authorization")


def authenticate(directory: TenantDirectory, authorization: str | None) -> Tenant:
    api_key = bearer(authorization)
    if api_key is None:
        raise AuthenticationFailed("Missing API key: send 'Authorization: Bearer <key>'.")
    tenant = directory.by_key_hash.get(hash_key(api_key))
    if tenant is None:
        raise AuthenticationFailed("Incorrect API key provided.")
    return tenant


def bearer(authorization: str | None) -> str | None:
    """The credential of an ``Authorization: Bearer <credential>`` header (the scheme in any case), or None: no
    header, another scheme or an empty credential. The one reading of the header, for API keys and operator tokens."""
    scheme, _, credential = (authorization or "").partition(" ")
    credential = credential.strip()
    return credential if scheme.lower() == "bearer" and credential else None


def within(address: str, networks: Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network]) -> bool:
    """Whether ``address`` (a peer's, or one named in a header) is in one of ``networks``; an address that does not
    parse is in none."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in network for network in networks)
