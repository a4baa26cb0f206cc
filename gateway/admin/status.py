"""The gateway's state as one JSON document (``GET /admin/state``): what the status page shows and what
`tenantgate status` prints. Read-only and cheap: no engine or Redis calls."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from backends.base import EngineLoad
from gateway.observe.metrics import GatewayMetrics
from gateway.state import Serving


def snapshot(serving: Serving, metrics: GatewayMetrics, store_up: bool) -> dict[str, Any]:
    now = time.time()
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
                 "predicted": {r: asdict(p) for r, p in decision.predictions.items()}}
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
        "adapters": metrics.activity.adapters(),
        "decisions": list(metrics.activity.decisions)[::-1],
    }


def engine_load_json(load: EngineLoad | None) -> dict[str, Any] | None:
    """The engine's last scrape as JSON (its running adapters as a sorted list)."""
    if load is None:
        return None
    return {**asdict(load), "running_adapters": sorted(load.running_adapters)}
