"""The admin API's door: off unless a token is set, then Bearer-authenticated in constant time."""

from __future__ import annotations

import hmac

from aiohttp import web

from gateway.appkeys import ADMIN_TOKEN
from gateway.errors import AdminDisabled, AuthenticationFailed


def require_admin(request: web.Request) -> None:
    token = request.app[ADMIN_TOKEN]
    if not token:
        raise AdminDisabled("The admin API is disabled: no admin token is configured.")
    scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
    # surrogateescape: aiohttp keeps undecodable header bytes as surrogate escapes, which plain encode() refuses.
    presented_bytes = presented.strip().encode("utf-8", "surrogateescape")
    if scheme.lower() != "bearer" or not hmac.compare_digest(presented_bytes, token.encode()):
        raise AuthenticationFailed("A valid admin token is required.")
