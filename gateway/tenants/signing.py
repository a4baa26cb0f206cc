"""Signed registry entries: whoever can write to Redis or PUBLISH on its channel cannot make a tenant or a key.

Redis decides who is a tenant. Every registry change, as stored and as published, is an envelope
``{"change", "version", "mac"}``: ``version`` is the registry's count of changes when it was made (1, 2, ...) and
``mac`` an HMAC-SHA256, under a key only the gateways hold, of the change and its version. An envelope whose MAC
does not verify is forged; one whose version is not above the last one a gateway applied to the same entity (a
key, a tenant, an adapter, a split) is a replay, such as an ``add_key`` published again after its
``revoke_key``. Both are refused and logged (``tenantgate_registry_refused_total{reason}``).

Stored entries could still be deleted or swapped for older signed ones, which a gateway that starts afterwards
would otherwise believe; so the registry also keeps a signed head: the latest version and a digest of every
entity's version. A gateway reads the entries and the head together and refuses a set that does not match it
(``altered``), and a head older than what it has already applied (``stale``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from typing import Any

_ENTRY = b"tenantgate registry entry\n"
_HEAD = b"tenantgate registry head\n"


class Refused(Exception):
    """An envelope or head that is not to be applied; ``reason`` is the metric's label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


_REGISTRY_PURPOSE = b"tenantgate registry signing key"


def derived_key(admin_token: str, purpose: bytes = _REGISTRY_PURPOSE) -> bytes:
    """A key for one ``purpose`` derived from the admin token (HMAC-SHA256 of the purpose under the token), for
    when none is configured: every gateway of a deployment holds the token, and it already allows every registry
    change and admin action. By default the registry's signing key; the status page's sessions use their own
    purpose (gateway/admin/sessions.py), so one key never signs both."""
    return hmac.new(admin_token.encode(), purpose, hashlib.sha256).digest()


def entity(change: Mapping[str, Any]) -> str:
    """What a change is about: the latest change of each entity is its whole state."""
    kind = change["kind"]
    if kind in ("add_key", "revoke_key"):
        return f"key:{change['key_hash']}"
    if kind in ("add_tenant", "remove_tenant"):
        return f"tenant:{change['tenant_id']}"
    if kind in ("add_adapter", "retire_adapter"):
        return f"adapter:{change['name']}"
    if kind == "set_split":
        return f"split:{change['split']['name']}"
    raise Refused("forged", f"unknown change kind {kind!r}")


def known_entity(change: Mapping[str, Any]) -> str:
    """``entity``, for a signed change: one of a kind or shape this version does not know (a KeyError, or a forged
    refusal, out of ``entity`` before) is "invalid", refused alone: a gateway of another version signed it."""
    try:
        return entity(change)
    except (Refused, KeyError, TypeError) as exc:
        kind = str(change.get("kind"))[:40]
        raise Refused("invalid", f"a {kind!r} change this version cannot read: {exc!r}") from exc


def digest(versions: Mapping[str, int]) -> str:
    """Every entity's version, in one hash: what the head signs."""
    lines = "".join(f"{name}\t{version}\n" for name, version in sorted(versions.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


def _canonical(payload: Mapping[str, Any]) -> bytes:
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


class Signer:
    """Signs and checks envelopes and heads; with no key it signs nothing and every envelope is refused."""

    def __init__(self, key: bytes | None) -> None:
        self._key = key

    @property
    def can_sign(self) -> bool:
        return self._key is not None

    def _mac(self, domain: bytes, payload: Mapping[str, Any]) -> str:
        assert self._key is not None
        return hmac.new(self._key, domain + _canonical(payload), hashlib.sha256).hexdigest()

    def _check(self, domain: bytes, payload: Mapping[str, Any], mac: object) -> None:
        if self._key is None:
            raise Refused("forged", "no registry key is configured: nothing from Redis can be checked")
        if not isinstance(mac, str) or not hmac.compare_digest(mac, self._mac(domain, payload)):
            raise Refused("forged", "its signature does not verify")

    def envelope(self, change: dict[str, Any], version: int) -> dict[str, Any]:
        return {"change": change, "version": version, "mac": self._mac(_ENTRY, {"change": change, "version": version})}

    def open(self, raw: str | bytes) -> tuple[dict[str, Any], int]:
        """The change and its version, if ``raw`` is an envelope this key signed (``Refused`` otherwise: "forged"),
        of a kind and shape this version knows (else "invalid": a gateway of another version signed it)."""
        change, version = self.open_signed(raw)
        known_entity(change)
        return change, version

    def open_signed(self, raw: str | bytes) -> tuple[dict[str, Any], int]:
        """``open`` without the check of the change's kind and shape."""
        try:
            envelope = json.loads(raw)
            change, version, mac = envelope["change"], envelope["version"], envelope["mac"]
            if not isinstance(change, dict) or type(version) is not int or version < 1:
                raise TypeError
        except (ValueError, TypeError, KeyError, RecursionError) as exc:  # the last: nested past the parser
            raise Refused("forged", "not a signed registry entry") from exc
        self._check(_ENTRY, {"change": change, "version": version}, mac)
        return change, version

    def head(self, version: int, versions: Mapping[str, int]) -> dict[str, Any]:
        payload = {"version": version, "digest": digest(versions)}
        return {**payload, "mac": self._mac(_HEAD, payload)}

    def open_head(self, raw: str | bytes) -> tuple[int, str]:
        """The head's version and digest, if this key signed it."""
        try:
            head = json.loads(raw)
            version, signed_digest, mac = head["version"], head["digest"], head["mac"]
            if type(version) is not int or not isinstance(signed_digest, str):
                raise TypeError
        except (ValueError, TypeError, KeyError, RecursionError) as exc:  # the last: nested past the parser
            raise Refused("altered", "the registry's head is not a signed head") from exc
        try:
            self._check(_HEAD, {"version": version, "digest": signed_digest}, mac)
        except Refused as exc:
            raise Refused("altered", f"the registry's head: {exc}") from exc
        return version, signed_digest
