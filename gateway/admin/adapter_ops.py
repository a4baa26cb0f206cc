"""Operator actions on one catalog adapter, shared by the admin API and the status page."""

from __future__ import annotations

from backends.base import AdapterRef
from backends.errors import BackendError
from gateway.config import AdapterConfig
from gateway.failures import to_gateway_error
from gateway.fleet.fleet import prewarm_homes
from gateway.state import Serving


async def warm_adapter(serving: Serving, adapter: AdapterConfig) -> list[str]:
    """Load it on its home replicas and warm it with a one-token request, as pre-warm does; returns the replicas."""
    pool = serving.fleet.pools[adapter.pool]
    ref = AdapterRef(adapter.engine_name or adapter.name, adapter.source)
    homes = sorted(prewarm_homes(serving.config, pool, adapter.name))
    try:
        for replica_id in homes:
            await pool.residency.warm(replica_id, ref, pinned=adapter.pinned, bounded=False)
    except BackendError as exc:
        raise to_gateway_error(exc) from exc
    return homes


async def unload_adapter(serving: Serving, adapter: AdapterConfig) -> list[str]:
    """Unload it from every replica of its pool (pinned or not) and forget it in the record; returns the replicas."""
    pool = serving.fleet.pools[adapter.pool]
    try:
        return await pool.residency.unload_everywhere(adapter.engine_name or adapter.name)
    except BackendError as exc:
        raise to_gateway_error(exc) from exc
