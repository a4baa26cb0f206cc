"""No empty slot: which adapters fill each replica's free slots, most important first.

A replica's plan is the adapters of the keys homed there (every replica of the key's set: the placement table's, else
the ring's home after balancing, as a request without a session id is routed): the adapters its requests will ask
for first. The order is the order the fill loads them
in when there are fewer slots than adapters: pinned, then ``prewarm``, then the busiest keys (``traffic``, requests
per second by key, when the gateway has measured it), then the config's order (tenants as listed, each tenant's
models as listed, a split's variants as listed). An adapter homed on a replica through several keys is planned
there once, at its most important place. Pure: no I/O; the fleet runs the fill (``PoolResidency.fill``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

from backends.base import AdapterRef
from gateway.config import GatewayConfig
from gateway.fleet.pool import Pool
from gateway.tenants.directory import keyed_targets


@dataclass(frozen=True)
class FillEntry:
    """One adapter ``key`` runs on: ``tier`` 0 pinned, 1 prewarm, 2 the rest; ``position`` its place in the
    config's order."""

    tier: int
    position: int
    key: str
    adapter: AdapterRef


def fill_entries(config: GatewayConfig, pools: Mapping[str, Pool]) -> dict[str, list[FillEntry]]:
    """Per pool of ``pools``, every (key, adapter) of its tenants, in the config's order (none with
    ``residency.fill_free_slots`` off). Built once per fleet; where each key lives is ``fill_order``'s."""
    if not config.residency.fill_free_slots:
        return {name: [] for name in pools}
    return keyed_adapters(config, pools)


def keyed_adapters(config: GatewayConfig, pools: Collection[str]) -> dict[str, list[FillEntry]]:
    """Per pool of ``pools``, every (key, adapter) of the tenants ``config`` serves there (run-time tenants too, in
    the served config), in the config's order, in one walk of the tenants."""
    entries: dict[str, list[FillEntry]] = {name: [] for name in pools}
    adapters = {adapter.name: adapter for adapter in config.adapters}
    for runs_on, key in keyed_targets(config):
        ref, planned = runs_on.adapter_ref, entries.get(runs_on.pool)
        if ref is None or planned is None:
            continue  # a base model has nothing to load; a pool not asked for
        adapter = adapters[runs_on.model]
        tier = 0 if adapter.pinned else 1 if adapter.prewarm else 2
        planned.append(FillEntry(tier, len(planned), key, ref))
    return entries


def fill_order(
    entries: Iterable[FillEntry],
    homes: Callable[[str], Iterable[str]],
    replica_ids: Iterable[str],
    traffic: Mapping[str, float] | None = None,
) -> dict[str, list[AdapterRef]]:
    """Per replica, the adapters of the entries whose key it is a home of (``homes``: a key's replica set), most
    important first (by tier, then ``traffic``'s requests per second by key, then the config's order), each
    adapter once. A sort: cheap enough to redo at every traffic interval."""
    traffic = traffic or {}
    plan: dict[str, list[AdapterRef]] = {replica_id: [] for replica_id in replica_ids}
    seen: dict[str, set[str]] = {replica_id: set() for replica_id in plan}
    for entry in sorted(entries, key=lambda e: (e.tier, -traffic.get(e.key, 0.0), e.position)):
        for replica_id in homes(entry.key):
            if replica_id in seen and entry.adapter.engine_name not in seen[replica_id]:
                seen[replica_id].add(entry.adapter.engine_name)
                plan[replica_id].append(entry.adapter)
    return plan


def fill_plan(
    config: GatewayConfig, pool: Pool, traffic: Mapping[str, float] | None = None
) -> dict[str, list[AdapterRef]]:
    """Per replica of ``pool``, the adapters its homed keys run on, most important first (empty with
    ``residency.fill_free_slots`` off)."""
    entries = fill_entries(config, {pool.name: pool})[pool.name]
    return fill_order(entries, pool.ring.replica_set, pool.replicas, traffic)
