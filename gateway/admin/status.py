"""The gateway's state as one JSON document (``GET /admin/state``): what the status page shows and what
`tenantgate status` prints. Read-only and cheap: no engine or Redis calls."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from backends.base import EngineLoad
from gateway.admin.placement import key_placement
from gateway.fleet.fleet import Fleet
from gateway.fleet.health import ReplicaHealth
from gateway.observe.metrics import GatewayMetrics
from gateway.state import Serving


def snapshot(serving: Serving, metrics: GatewayMetrics, store_up: bool, samples: bool = False) -> dict[str, Any]:
    """``samples``: each adapter's minutes with their TTFT samples rather than percentiles (what one worker of
    serve --workers merges with the others': gateway/admin/merge.py)."""
    now = time.time()
    clock = time.monotonic()
    pools: dict[str, Any] = {}
    for name, pool in serving.fleet.pools.items():
        life = pool.residency
        tenants = []
        for tenant_config in serving.config.tenants:
            tenant = serving.tenants.tenant(tenant_config.id)
            targets = [t for t in tenant.targets.values() if t.pool == name] if tenant else []
            if not targets:
                continue
            decision = pool.explain(tenant_config.id, targets[0].engine_model if targets[0].adapter else None)
            tenants.append(
                {"id": tenant_config.id, "home": decision.home, "ring_home": pool.ring.ring_home(tenant_config.id),
                 "now": decision.chosen, "position": round(pool.ring.position(tenant_config.id), 6),
                 "placement": key_placement(serving.fleet, pool, tenant_config.id),
                 "predicted": {r: p.as_json() for r, p in decision.predictions.items()}}
            )  # fmt: skip
        pools[name] = {
            "policy": pool.config.policy,
            "max_adapters": life.max_adapters,
            "ring": [[round(start, 6), round(end, 6), replica] for start, end, replica in pool.ring.arcs()],
            "tenants": tenants,
            "replicas": [
                {
                    "id": replica_id,
                    "healthy": replica.healthy,
                    "up": replica.health.up,
                    "drained": replica.health.drained,
                    "ejected": replica.health.ejected,
                    "ejection_reason": replica.health.ejection_reason,
                    "in_flight": replica.in_flight,
                    "load_view": pool.routed_load(replica_id, clock),
                    "engine_load": engine_load_json(replica.engine_load),
                    "adapters": {
                        adapter: {
                            "idle_s": round(max(0.0, now - used), 1),
                            "pinned": adapter in life.views[replica_id].pinned,
                            "in_flight": life.views[replica_id].in_flight.get(adapter, 0),
                        }
                        for adapter, used in sorted(life.views[replica_id].resident.items())
                    },
                    "loading": sorted(a for (r, a) in life.loading if r == replica_id),
                }
                for replica_id, replica in pool.replicas.items()
            ],
            "adapters": sorted(a.engine_name or a.name for a in serving.config.adapters if a.pool == name),
        }
    return {
        "at": round(now, 3),
        "store": "up" if store_up else "down",
        "pools": pools,
        "adapters": metrics.activity.samples() if samples else metrics.activity.adapters(),
        "decisions": metrics.activity.recent_decisions(),
    }


def engine_load_json(load: EngineLoad | None) -> dict[str, Any] | None:
    """The engine's last scrape as JSON (its running adapters as a sorted list)."""
    if load is None:
        return None
    return {**asdict(load), "running_adapters": sorted(load.running_adapters)}


def residency_json(fleet: Fleet) -> dict[str, Any]:
    """The residency record per pool and replica as this gateway sees it, with idle times (``/admin/residency``)."""
    now = time.time()
    pools = {}
    for name, pool in fleet.pools.items():
        life = pool.residency
        pools[name] = {
            "max_adapters": life.max_adapters,
            "counters": asdict(life.counters),
            "replicas": {
                replica_id: {
                    "healthy": pool.replicas[replica_id].healthy,
                    **_outlier_state(pool.replicas[replica_id].health),
                    "adapters": {
                        adapter: {
                            "idle_s": round(max(0.0, now - used), 3),
                            "pinned": adapter in view.pinned,
                            "in_flight": view.in_flight.get(adapter, 0),
                        }
                        for adapter, used in sorted(view.resident.items())
                    },
                    "loading": sorted(a for (r, a) in life.loading if r == replica_id),
                }
                for replica_id, view in life.views.items()
            },
        }
    return {"store": "up" if fleet.store_up else "down", "pools": pools}


def _outlier_state(health: ReplicaHealth) -> dict[str, object]:
    """Health's view of a replica: up by its probes?, ejected now?, why it was last ejected, how often, for how long
    yet and for how long the latest ejection was set, and its slow-start weight (the share of its capacity it may
    take)."""
    return {
        "up": health.up,
        "ejected": health.ejected,
        "ejection_reason": health.ejection_reason,
        "ejections": health.ejections,
        "ejected_for_s": round(max(0.0, health.ejected_until - health.clock()), 3),
        "last_ejection_s": health.last_ejection_s,
        "weight": round(health.weight(), 3),
    }
