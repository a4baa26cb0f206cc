"""Admin API for tenants, keys and adapters at run time (gateway/tenants/registry.py): add or remove a tenant,
add or revoke a key, add or retire an adapter.
Keys travel and are stored only as ``sha256:`` hashes; a plain key sent here is hashed at once and never kept."""

from __future__ import annotations

import logging
import re
import secrets
from typing import Any

from aiohttp import web

from backends.errors import BackendError
from gateway import adapter_sources
from gateway.admin.answers import AdminRoutes
from gateway.admin.auth import require_admin
from gateway.admin.body import json_object
from gateway.appkeys import STATE
from gateway.config import ConfigError
from gateway.errors import InvalidRequest, ModelNotFound
from gateway.residency.store import StoreUnavailable
from gateway.tenants.identity import hash_key

log = logging.getLogger(__name__)
_KEY_HASH = re.compile(r"^sha256:[0-9a-f]{64}$")


async def _change(request: web.Request, change: dict[str, Any]) -> dict[str, Any]:
    state = request.app[STATE]
    try:
        await state.registry.change(change, state.base_config)
    except ConfigError as exc:
        raise InvalidRequest("The change was refused: " + "; ".join(exc.problems)) from exc
    except StoreUnavailable as exc:
        raise InvalidRequest(f"The change was not made: the shared registry is unreachable ({exc}).") from exc
    state.refresh_tenants()
    return {"status": "ok", **{k: v for k, v in change.items() if k not in ("tenant", "adapter")}}


def _key(body: dict[str, Any], min_chars: int) -> tuple[str, str | None]:
    """(the key's hash, the key itself when the gateway made it). A plain key must be at least ``min_chars`` long
    (admin.min_api_key_chars); a body with neither key nor hash gets a generated one, returned once and never
    stored. A key_hash is taken as given: how strong its key is stays the operator's business."""
    api_key, key_hash = body.get("api_key"), body.get("key_hash")
    if api_key is not None:
        if not isinstance(api_key, str) or len(api_key) < min_chars:
            raise InvalidRequest(
                f"'api_key' must be a string of at least {min_chars} characters (or send no key: one is generated).",
                param="api_key",
            )
        return hash_key(api_key), None
    if key_hash is not None:
        if not isinstance(key_hash, str) or not _KEY_HASH.match(key_hash):
            raise InvalidRequest("'key_hash' must be sha256:<64 hex>.", param="key_hash")
        return key_hash, None
    generated = "tg-" + secrets.token_urlsafe(32)
    return hash_key(generated), generated


async def add_tenant(request: web.Request) -> web.Response:
    require_admin(request)
    tenant = await json_object(request)
    return web.json_response(
        await _change(request, {"kind": "add_tenant", "tenant": tenant, "tenant_id": tenant.get("id")})
    )


async def remove_tenant(request: web.Request) -> web.Response:
    require_admin(request)
    tenant_id = request.match_info["tenant_id"]
    if tenant_id not in request.app[STATE].registry.state.tenants:
        raise InvalidRequest(
            f"No tenant {tenant_id!r} was added at run time; one from the config file is removed by editing the file "
            "and reloading (or its keys revoked here).",
            param="tenant_id",
        )
    return web.json_response(await _change(request, {"kind": "remove_tenant", "tenant_id": tenant_id}))


async def add_key(request: web.Request) -> web.Response:
    require_admin(request)
    tenant_id = request.match_info["tenant_id"]
    if request.app[STATE].serving.tenants.tenant(tenant_id) is None:
        raise InvalidRequest(f"No tenant {tenant_id!r}.", param="tenant_id")
    min_chars = request.app[STATE].config.admin.min_api_key_chars
    key_hash, generated = _key(await json_object(request, empty_is={}), min_chars)
    answer = await _change(request, {"kind": "add_key", "tenant_id": tenant_id, "key_hash": key_hash})
    if generated is None:
        return web.json_response(answer)
    # The only time the key is seen: the gateway keeps its hash alone.
    return web.json_response({**answer, "api_key": generated})


async def revoke_key(request: web.Request) -> web.Response:
    require_admin(request)
    key_hash = request.match_info["key_hash"]
    if not _KEY_HASH.match(key_hash):
        raise InvalidRequest("The key must be given as sha256:<64 hex>.", param="key_hash")
    return web.json_response(await _change(request, {"kind": "revoke_key", "key_hash": key_hash}))


def _allowed_source(request: web.Request, source: str) -> str:
    """A new adapter's source, normalised, if adapter_sources allows it (gateway/adapter_sources.py). Without
    configured roots, a path must lie in a directory that holds one of the config file's own adapters."""
    base = request.app[STATE].base_config
    roots = base.adapter_sources.roots or adapter_sources.directories_of(a.source for a in base.adapters)
    try:
        kept = adapter_sources.normalised(source)
        if not roots and not adapter_sources.is_url(kept):
            raise adapter_sources.SourceRefused("no adapter_sources.roots are configured, nor adapters in the file")
        adapter_sources.check(kept, roots, base.adapter_sources.schemes)
    except adapter_sources.SourceRefused as exc:
        raise InvalidRequest(f"The adapter's source is refused: {exc}.", param="source") from exc
    return kept


async def add_adapter(request: web.Request) -> web.Response:
    """A catalog entry (the config file's schema); tenants get it through add_tenant or a config reload."""
    require_admin(request)
    adapter = await json_object(request)
    if isinstance(adapter.get("source"), str):
        adapter["source"] = _allowed_source(request, adapter["source"])
    return web.json_response(
        await _change(request, {"kind": "add_adapter", "adapter": adapter, "name": adapter.get("name")})
    )


async def retire_adapter(request: web.Request) -> web.Response:
    """Out of the catalog and every tenant's list, then unloaded from every replica that holds it."""
    require_admin(request)
    name = request.match_info["name"]
    serving = request.app[STATE].serving
    adapter = next((a for a in serving.config.adapters if a.name == name), None)
    if adapter is None:
        raise ModelNotFound(f"No adapter {name!r} in the catalog.", param="name")
    answer = await _change(request, {"kind": "retire_adapter", "name": name})
    pool = serving.fleet.pools[adapter.pool]
    try:
        await pool.residency.unload_everywhere(adapter.engine_name or adapter.name)
    except BackendError as exc:  # retired all the same; reconciliation and the eviction timer finish the job
        log.warning("retired %s but could not unload it everywhere: %s", name, exc)
    return web.json_response(answer)


def add_routes(app: web.Application) -> None:
    admin = AdminRoutes(app)
    admin.post("/admin/catalog/adapters", add_adapter)
    admin.delete("/admin/catalog/adapters/{name}", retire_adapter)
    admin.post("/admin/tenants", add_tenant)
    admin.delete("/admin/tenants/{tenant_id}", remove_tenant)
    admin.post("/admin/tenants/{tenant_id}/keys", add_key)
    admin.delete("/admin/keys/{key_hash}", revoke_key)
