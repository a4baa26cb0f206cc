"""No empty slot: which adapters fill each replica's free slots, most important first.

A replica's plan is the adapters of the keys homed there (the ring's home after balancing, as a request without a
session id is routed): the adapters its requests will ask for first. The order is the order the fill loads them
in when there are fewer slots than adapters: pinned, then ``prewarm``, then the busiest keys (``traffic``, requests
per second by key, when the gateway has measured it), then the config's order (tenants as listed, each tenant's
models as listed, a split's variants as listed). An adapter homed on a replica through several keys is planned
there once, at its most important place. Pure: no I/O; the fleet runs the fill (``PoolResidency.fill``).
"""

from __future__ import annotations

from collections.abc import Mapping

from backends.base import AdapterRef
from gateway.config import GatewayConfig
from gateway.fleet.pool import Pool
from gateway.tenants.directory import TenantDirectory, affinity_key


def fill_plan(
    config: GatewayConfig, pool: Pool, traffic: Mapping[str, float] | None = None
) -> dict[str, list[AdapterRef]]:
    """Per replica of ``pool``, the adapters its homed keys run on, most important first (empty with
    ``residency.fill_free_slots`` off)."""
    plan: dict[str, list[AdapterRef]] = {replica_id: [] for replica_id in pool.replicas}
    if not config.residency.fill_free_slots:
        return plan
    traffic = traffic or {}
    adapters = {adapter.name: adapter for adapter in config.adapters}
    directory = TenantDirectory(config)
    ranked: list[tuple[tuple[int, float, int], str, AdapterRef]] = []
    for tenant_config in config.tenants:
        tenant = directory.tenant(tenant_config.id)
        assert tenant is not None  # the directory holds every tenant of the config it was built from
        for target in tenant.targets.values():
            for runs_on in [variant for _, variant in target.variants] or [target]:
                ref = runs_on.adapter_ref
                if ref is None or runs_on.pool != pool.name:
                    continue  # a base model has nothing to load; another pool fills its own
                key = affinity_key(config.routing, tenant, runs_on, None)
                adapter = adapters[runs_on.model]
                tier = 0 if adapter.pinned else 1 if adapter.prewarm else 2
                ranked.append(((tier, -traffic.get(key, 0.0), len(ranked)), pool.ring.home(key), ref))
    for _, replica_id, ref in sorted(ranked, key=lambda entry: entry[0]):
        planned = plan[replica_id]
        if all(ref.engine_name != other.engine_name for other in planned):
            planned.append(ref)
    return plan
