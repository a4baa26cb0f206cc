"""The routing pipeline: a filter (healthy replicas, in the key's ring order), then the pool's policy picks one.

``bounded_consistent_hash`` (default) is consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam
2017; HAProxy's hash-balance-factor): walk the key's preference order and take the first replica whose in-flight
load is under ``ceil(balance_factor x mean)``, the mean over healthy replicas counting this request. Some replica
is always under the mean, so a pick always exists; a hot key spills clockwise while other keys stay home as long
as their home has room. A request that must leave home goes to the first allowed replica where its adapter is
resident (``spill:resident``), else to the next on the ring (``spill:ring``). With home reservations
(reservations.py) the mean counts reserved slots too; a key holding a reservation at a healthy home takes it
without the check, and a key that already has requests in flight must find a replica whose in flight + reserved
is under the cap. The cap never falls below ``capacity_floor``: below a few requests in flight an engine batches
one more almost for free, and a spill can cost a cold adapter load. The others are baselines for comparison:
``consistent_hash`` (no bound), ``round_robin`` and ``least_loaded``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gateway.routing.decision import NEW_KEY, KeyStanding, ReplicaLoad, RoutingDecision
from gateway.routing.ring import Ring


def decide(
    ring: Ring,
    key: str,
    replicas: Sequence[ReplicaLoad],
    *,
    pool: str,
    policy: str,
    balance_factor: float,
    capacity_floor: int = 1,
    tick: int = 0,
    standing: KeyStanding = NEW_KEY,
    resident: frozenset[str] = frozenset(),
) -> RoutingDecision:
    """Choose a replica for ``key``; ``decision.chosen`` is None only when no replica is healthy."""
    by_id = {replica.id: replica for replica in replicas}
    order = ring.preference(key)
    decision = RoutingDecision(pool=pool, policy=policy, key=key, home=order[0] if order else "")
    decision.loads = {replica.id: replica.in_flight for replica in replicas}
    decision.reserved = {replica.id: replica.reserved for replica in replicas if replica.reserved}
    decision.resident = sorted(resident)
    candidates = [replica_id for replica_id in order if by_id[replica_id].healthy]
    decision.healthy = candidates
    if not candidates:
        decision.reasons.append("no_healthy_replica")
        return decision
    if candidates[0] != decision.home:
        decision.reasons.append("spill:unhealthy")

    if policy == "consistent_hash":
        decision.chosen = candidates[0]
    elif policy == "bounded_consistent_hash":
        effective = {r: by_id[r].in_flight + by_id[r].reserved for r in candidates}
        mean = (sum(effective.values()) + 1) / len(candidates)
        capacity = max(math.ceil(balance_factor * mean), capacity_floor)
        decision.capacity = capacity
        if standing.holds_reservation and candidates[0] == decision.home:
            decision.chosen = decision.home
            decision.used_reservation = True
        else:
            load = effective if standing.in_flight else {r: by_id[r].in_flight for r in candidates}
            allowed = [r for r in candidates if load[r] < _scaled(capacity, by_id[r].weight)]
            if not allowed:  # every replica with room is in slow start: the plain bound still has a pick
                allowed = [r for r in candidates if load[r] < capacity]
            if allowed[0] != candidates[0]:
                decision.reasons.append("spill:over_capacity")
            decision.chosen = allowed[0]
            if decision.chosen != decision.home:
                decision.chosen, how = spill_target(allowed, resident)
                decision.reasons.append(how)
    elif policy == "round_robin":
        decision.chosen = sorted(candidates)[tick % len(candidates)]
    elif policy == "least_loaded":
        decision.chosen = min(candidates, key=lambda replica_id: by_id[replica_id].in_flight)
    else:
        raise ValueError(f"unknown routing policy {policy!r}")

    if decision.chosen == decision.home:
        decision.reasons.insert(0, "home")
    elif policy in ("round_robin", "least_loaded"):
        decision.reasons.append(f"policy:{policy}")
    return decision


def _scaled(capacity: int, weight: float) -> int:
    return capacity if weight >= 1 else max(1, math.ceil(capacity * weight))


def spill_target(allowed: Sequence[str], resident: frozenset[str]) -> tuple[str, str]:
    """Where a request that cannot go home goes, among the replicas the bound allows (in ring order): the first
    where its adapter is already resident (no cold load), else the next on the ring."""
    for replica_id in allowed:
        if replica_id in resident:
            return replica_id, "spill:resident"
    return allowed[0], "spill:ring"
