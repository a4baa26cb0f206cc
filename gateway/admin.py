"""Operator endpoints under /admin: off unless a token is set, then Bearer-authenticated in constant time."""

from __future__ import annotations

import hmac

from aiohttp import web

from gateway.appkeys import ADMIN_TOKEN, CONFIG, FLEET, TENANTS
from gateway.errors import AdminDisabled, AuthenticationFailed, InvalidRequest
from gateway.ingress import affinity_key


def _require_admin(request: web.Request) -> None:
    token = request.app[ADMIN_TOKEN]
    if not token:
        raise AdminDisabled("The admin API is disabled: no admin token is configured.")
    scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(presented.strip().encode(), token.encode()):
        raise AuthenticationFailed("A valid admin token is required.")


async def route(request: web.Request) -> web.Response:
    """The decision the gateway would take now for a tenant (and one of its models), without sending anything."""
    _require_admin(request)
    tenants = request.app[TENANTS]
    tenant = tenants.tenant(request.query.get("tenant", ""))
    if tenant is None:
        raise InvalidRequest("Unknown tenant: pass ?tenant=ID.", param="tenant")
    target = tenants.resolve(tenant, request.query.get("adapter"))
    pool = request.app[FLEET].pools[target.pool]
    key = affinity_key(request.app[CONFIG].routing, tenant, target, request.query.get("session"))
    decision = pool.explain(key)
    return web.json_response({"tenant": tenant.id, "model": target.model, **decision.as_json()})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/admin/route", route)
