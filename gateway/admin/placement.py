"""Homes from traffic, for operators: each key's replica set and why (``GET /admin/placement``, also in
``/admin/route`` and the status page), and the run-time freeze and pins every gateway's leader applies
(``POST /admin/placement/freeze``, ``PUT``/``DELETE /admin/placement/pins/{pool}/{key}``). The freeze and pins
are written to the placement store (Redis: every gateway's leader reads them at its next interval, and
``GET /admin/placement`` on any gateway shows them at once); refused with a 503 while it does not answer, and with
a 404 unless ``routing.home_placement`` is ``traffic``."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from aiohttp import web

from gateway.admin.answers import AdminRoutes
from gateway.admin.auth import require_admin
from gateway.admin.body import json_object
from gateway.appkeys import PLACER, STATE
from gateway.errors import InvalidRequest, RouteNotFound, StoreUnreachable
from gateway.fleet.fleet import Fleet, homed_keys
from gateway.fleet.pool import Pool
from gateway.placement.placer import Placer
from gateway.residency.store import StoreUnavailable


def key_placement(fleet: Fleet, pool: Pool, key: str) -> dict[str, Any]:
    """Where ``key`` lives in ``pool``: the replica set requests go to, the planned one (new members warming
    included; none for a key the plan left without a slot, ``unplanned``) and why; ``why`` is "balanced" or "ring"
    for a key the table does not place."""
    homes = fleet.homes
    routed = pool.ring.replica_set(key)
    unplanned = key in pool.unplanned
    planned = () if unplanned else homes.planned.get(pool.name, {}).get(key, routed)
    default = "balanced" if fleet.config.routing.home_placement != "ring" else "ring"
    return {
        "replicas": list(routed),
        "planned": list(planned),
        "warming": [r for r in planned if r not in routed],
        "unplanned": unplanned,
        "why": homes.why.get(pool.name, {}).get(key, default),
        "version": homes.version,
    }


def _placer(request: web.Request) -> Placer:
    placer = request.app[PLACER]
    if request.app[STATE].config.routing.home_placement != "traffic":
        raise RouteNotFound("Homes from traffic are off: routing.home_placement is not `traffic`.")
    return placer


async def placement(request: web.Request) -> web.Response:
    """The homes table this gateway routes by: per pool, every key it places or that the config names."""
    require_admin(request)
    placer = _placer(request)
    store_up = await placer.read_operator() and placer.store_up  # this read's answer, not only the last tick's
    state = request.app[STATE]
    fleet, config = state.serving.fleet, state.config
    pools: dict[str, Any] = {}
    for name, pool in fleet.pools.items():
        keys = sorted({*fleet.homes.planned.get(name, {}), *(t.id for t in config.tenants)})
        pools[name] = {key: key_placement(fleet, pool, key) for key in keys}
    return web.json_response(
        {
            "version": placer.table.version,
            "leader": placer.table.leader,
            "leads": placer.leads,
            "store": "up" if store_up else "down",
            "frozen": placer.frozen(config.placement),
            "pins": {name: placer.pins(config.placement, name) for name in fleet.pools},
            "pools": pools,
        }
    )


async def freeze(request: web.Request) -> web.Response:
    """``{"frozen": true}`` keeps the table as it is (no moves, no growth; pins still apply); false lets the plan run
    again."""
    require_admin(request)
    placer = _placer(request)
    body = await json_object(request)
    frozen = body.get("frozen")
    if not isinstance(frozen, bool):
        raise InvalidRequest('Pass {"frozen": true} or {"frozen": false}.', param="frozen")
    await _stored(placer.store.set_frozen(frozen))
    return web.json_response({"frozen": frozen})


async def pin(request: web.Request) -> web.Response:
    """``PUT {"replica": ID}`` pins the key's home in the pool to that replica; ``DELETE`` unpins it."""
    require_admin(request)
    placer = _placer(request)
    pool_name, key = request.match_info["pool"], request.match_info["key"]
    pool = request.app[STATE].serving.fleet.pools.get(pool_name)
    if pool is None:
        raise InvalidRequest(f"No pool {pool_name!r}.", param="pool")
    replica: str | None = None
    if request.method == "PUT":
        # A key no request to the pool is routed by (a typo) would pin nothing, and count as an adapter on its
        # replica in the leader's plan; unpinning takes any key (a tenant since removed may have left a pin).
        if key not in homed_keys(request.app[STATE].config).get(pool_name, set()):
            known = "a tenant, or under adapter affinity a model, it serves"
            raise InvalidRequest(f"{key!r} is no key of pool {pool_name!r}: {known}.", param="key")
        body = await json_object(request)
        replica = body.get("replica")
        if not isinstance(replica, str) or replica not in pool.replicas:
            raise InvalidRequest(f'Pass {{"replica": ID}}, one of {sorted(pool.replicas)}.', param="replica")
    await _stored(placer.store.set_pin(pool_name, key, replica))
    return web.json_response({"pool": pool_name, "key": key, "pinned_to": replica})


async def _stored(write: Awaitable[None]) -> None:
    """Write a freeze or pin to the placement store; while it does not answer, the change is refused (503)."""
    try:
        await write
    except StoreUnavailable as exc:
        raise StoreUnreachable(f"Not changed: the placement store is unreachable ({exc}).") from exc


def add_routes(app: web.Application) -> None:
    admin = AdminRoutes(app)
    admin.get("/admin/placement", placement)
    admin.post("/admin/placement/freeze", freeze)
    admin.put("/admin/placement/pins/{pool}/{key}", pin)
    admin.delete("/admin/placement/pins/{pool}/{key}", pin)
