"""The pipeline's first step: which replicas may take this request at all. Each filter leaves replicas out for one
reason, and the decision keeps every one it left out and why, so "no replica" can say whether the pool is down or
full, and a spill can say what pushed the request off its home.

Filters run in this order and a replica is left out by the first that applies:
- ``unhealthy``: down by its probes, ejected by outlier detection, or being re-warmed after coming back;
- ``retry``: this request already failed there (a retry goes elsewhere);
- ``replica_cap``: at the gateway's hard per-replica limit of requests in flight.
The bound of bounded loads is not a filter: it depends on the load of the candidates the filters keep, so the
picker applies it (reason ``over_capacity``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from gateway.routing.decision import ReplicaLoad


def filter_replicas(order: Sequence[ReplicaLoad], avoid: Collection[str]) -> tuple[list[ReplicaLoad], dict[str, str]]:
    """The replicas of ``order`` that may take the request, in that order, and each left out with its reason."""
    candidates: list[ReplicaLoad] = []
    excluded: dict[str, str] = {}
    for replica in order:
        if not replica.healthy:
            excluded[replica.id] = "unhealthy"
        elif replica.id in avoid:
            excluded[replica.id] = "retry"
        elif replica.at_cap:
            excluded[replica.id] = "replica_cap"
        else:
            candidates.append(replica)
    return candidates, excluded
