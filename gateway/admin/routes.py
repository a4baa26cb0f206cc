"""Operator endpoints under /admin: off unless a token is set, then Bearer-authenticated in constant time."""

from __future__ import annotations

from aiohttp import web

from gateway.admin import placement as admin_placement
from gateway.admin import rollout
from gateway.admin import tenants as admin_tenants
from gateway.admin import ui as admin_ui
from gateway.admin.adapter_ops import unload_adapter, warm_adapter
from gateway.admin.answers import AdminRoutes
from gateway.admin.auth import FAILED_LOGINS, FailedLogins, require_admin
from gateway.admin.placement import key_placement
from gateway.admin.siblings import SIBLINGS
from gateway.admin.status import engine_load_json, residency_json
from gateway.appkeys import STATE
from gateway.config import AdapterConfig
from gateway.errors import InvalidRequest, ModelNotFound
from gateway.reload import admin_reload
from gateway.tenants.directory import affinity_key


async def route(request: web.Request) -> web.Response:
    """The decision the gateway would take now for a tenant (and one of its models), without sending anything."""
    require_admin(request)
    serving = request.app[STATE].serving
    tenants = serving.tenants
    tenant = tenants.tenant(request.query.get("tenant", ""))
    if tenant is None:
        raise InvalidRequest("Unknown tenant: pass ?tenant=ID.", param="tenant")
    target = tenants.resolve(tenant, request.query.get("adapter"))
    pool = serving.fleet.pools[target.pool]
    key = affinity_key(serving.config.routing, tenant, target, request.query.get("session"))
    decision = pool.explain(key, target.engine_model if target.adapter is not None else None)
    engine_load = {
        replica_id: engine_load_json(replica.engine_load)
        for replica_id, replica in pool.replicas.items()
        if replica.engine_load is not None
    }
    # Where the ring alone would put the key: differs from "home" when balancing moved it (README, Routing).
    ring_home = pool.ring.ring_home(key)
    return web.json_response(
        {"tenant": tenant.id, "model": target.model, **decision.as_json(), "ring_home": ring_home,
         "placement": key_placement(serving.fleet, pool, key), "engine_load": engine_load}
    )  # fmt: skip


def _adapter(request: web.Request) -> AdapterConfig:
    name = request.match_info["name"]
    adapter = next((a for a in request.app[STATE].serving.config.adapters if a.name == name), None)
    if adapter is None:
        raise ModelNotFound(f"No adapter {name!r} in the catalog.", param="name")
    return adapter


async def warm(request: web.Request) -> web.Response:
    """Load an adapter on its home replicas and warm it with a one-token request, as pre-warm does at start."""
    require_admin(request)
    adapter = _adapter(request)
    homes = await warm_adapter(request.app[STATE].serving, adapter)
    return web.json_response({"adapter": adapter.name, "pool": adapter.pool, "warmed_on": homes})


async def unload(request: web.Request) -> web.Response:
    """Unload an adapter from every replica of its pool (pinned or not) and forget it in the record."""
    require_admin(request)
    adapter = _adapter(request)
    unloaded = await unload_adapter(request.app[STATE].serving, adapter)
    return web.json_response({"adapter": adapter.name, "pool": adapter.pool, "unloaded_from": unloaded})


async def residency(request: web.Request) -> web.Response:
    """The residency record per pool and replica as this gateway sees it, with idle times; under serve --workers
    merged over every worker (gateway/admin/merge.py)."""
    require_admin(request)
    siblings = request.app.get(SIBLINGS)
    if siblings is not None:
        return web.json_response(await siblings.merged("residency"))
    return web.json_response(residency_json(request.app[STATE].serving.fleet))


async def reload_config(request: web.Request) -> web.Response:
    """Re-read the config file and swap it in whole, or refuse it whole (400) and keep the old one."""
    require_admin(request)
    return await admin_reload(request)


def add_routes(app: web.Application) -> None:
    admin = AdminRoutes(app)
    app[FAILED_LOGINS] = FailedLogins(app[STATE].config.admin.failed_logins_per_minute)
    admin.get("/admin/route", route)
    admin.post("/admin/reload", reload_config)
    admin_tenants.add_routes(app)
    admin_placement.add_routes(app)
    admin_ui.add_routes(app)
    rollout.add_routes(app)
    admin.get("/admin/residency", residency)
    admin.post("/admin/adapters/{name}/warm", warm)
    admin.delete("/admin/adapters/{name}/residency", unload)
