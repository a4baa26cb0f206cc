"""The pipeline's last step: the pool's policy picks one of the replicas the filters kept.

``bounded_consistent_hash`` (default) is consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam
2017; HAProxy's hash-balance-factor): walk the key's preference order and take the first replica whose in-flight
load is under ``ceil(balance_factor x mean)``, the mean over the candidates counting this request. Some replica
is always under the mean, so a pick always exists; a hot key spills clockwise while other keys stay home as long
as their home has room. A request that must leave home goes to the first allowed replica where its adapter is
resident (``spill:resident``), else to the next on the ring (``spill:ring``). With home reservations
(reservations.py) the mean counts reserved slots too; a key holding a reservation at a healthy home takes it
without the check, and a key that already has requests in flight must find a replica whose in flight + reserved
is under the cap. The cap never falls below ``capacity_floor``: below a few requests in flight an engine batches
one more almost for free, and a spill can cost a cold adapter load. The others are baselines for comparison:
``consistent_hash`` (no bound), ``round_robin`` and ``least_loaded``.

A picker sets ``decision.chosen`` (always, given at least one candidate) and appends its reason codes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gateway.routing.decision import KeyStanding, ReplicaLoad, RoutingDecision


@dataclass(slots=True)  # not frozen: built per decision, and a frozen dataclass costs 1 us more to build
class PickInput:
    """What a picker sees: the candidates in the key's ring order, and the numbers it may weigh."""

    candidates: Sequence[str]
    by_id: Mapping[str, ReplicaLoad]
    balance_factor: float
    capacity_floor: int
    tick: int
    standing: KeyStanding
    resident: frozenset[str]


def consistent_hash(decision: RoutingDecision, given: PickInput) -> None:
    decision.chosen = given.candidates[0]


def bounded_consistent_hash(decision: RoutingDecision, given: PickInput) -> None:
    candidates, by_id = given.candidates, given.by_id
    effective = {r: by_id[r].in_flight + by_id[r].reserved for r in candidates}
    mean = (sum(effective.values()) + 1) / len(candidates)
    capacity = max(math.ceil(given.balance_factor * mean), given.capacity_floor)
    decision.capacity = capacity
    if given.standing.holds_reservation and candidates[0] == decision.home:
        decision.chosen = decision.home
        decision.used_reservation = True
        return
    load = effective if given.standing.in_flight else {r: by_id[r].in_flight for r in candidates}
    allowed = [r for r in candidates if load[r] < _scaled(capacity, by_id[r].weight)]
    if not allowed:  # every replica with room is in slow start: the plain bound still has a pick
        allowed = [r for r in candidates if load[r] < capacity]
    if len(allowed) < len(candidates):
        room = set(allowed)
        decision.excluded.update((r, "over_capacity") for r in candidates if r not in room)
    if allowed[0] != candidates[0]:
        decision.reasons.append("spill:over_capacity")
    decision.chosen = allowed[0]
    if decision.chosen != decision.home:
        decision.chosen, how = spill_target(allowed, given.resident)
        decision.reasons.append(how)


def round_robin(decision: RoutingDecision, given: PickInput) -> None:
    decision.chosen = sorted(given.candidates)[given.tick % len(given.candidates)]
    if decision.chosen != decision.home:
        decision.reasons.append("policy:round_robin")


def least_loaded(decision: RoutingDecision, given: PickInput) -> None:
    by_id = given.by_id
    decision.chosen = min(given.candidates, key=lambda replica_id: by_id[replica_id].in_flight)
    if decision.chosen != decision.home:
        decision.reasons.append("policy:least_loaded")


Picker = Callable[[RoutingDecision, PickInput], None]

PICKERS: dict[str, Picker] = {
    "bounded_consistent_hash": bounded_consistent_hash,
    "consistent_hash": consistent_hash,
    "round_robin": round_robin,
    "least_loaded": least_loaded,
}


def _scaled(capacity: int, weight: float) -> int:
    return capacity if weight >= 1 else max(1, math.ceil(capacity * weight))


def spill_target(allowed: Sequence[str], resident: frozenset[str]) -> tuple[str, str]:
    """Where a request that cannot go home goes, among the replicas the bound allows (in ring order): the first
    where its adapter is already resident (no cold load), else the next on the ring."""
    for replica_id in allowed:
        if replica_id in resident:
            return replica_id, "spill:resident"
    return allowed[0], "spill:ring"
