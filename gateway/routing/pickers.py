"""The pipeline's last step: the pool's policy picks one of the replicas the filters kept.

``bounded_consistent_hash`` is consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam
2017; HAProxy's hash-balance-factor): walk the key's preference order and take the first replica whose in-flight
load is under ``ceil(balance_factor x mean)``, the mean over the candidates counting this request. Some replica
is always under the mean, so a pick always exists; a hot key spills clockwise while other keys stay home as long
as their home has room. A request that must leave home goes to the first allowed replica where its adapter is
resident (``spill:resident``), else to the next on the ring (``spill:ring``). With home reservations
(reservations.py) the mean counts reserved slots too; a key holding a reservation at a healthy home takes it
without the check, and a key that already has requests in flight must find a replica whose in flight + reserved
is under the cap. The cap never falls below ``capacity_floor``: below a few requests in flight an engine batches
one more almost for free, and a spill can cost a cold adapter load.

``predicted_ttft`` (default) keeps the same bound and, among the replicas under it, takes the one with the lowest
predicted time to first token: the wait behind its load, its regime's cost (adapter on GPU, in host memory or not
loaded; the key's prefix warm or cold there) as the pool has learned them (costs.py), the stall a cold load
imposes on the requests already there, and a margin for leaving home (scorers/). It leaves home with
``spill:faster`` when another replica is predicted faster by more than that; the bound never forces a cold load.
The others are baselines for comparison: ``bounded_consistent_hash``, ``consistent_hash`` (no bound),
``round_robin`` and ``least_loaded``.

A picker sets ``decision.chosen`` (always, given at least one candidate) and appends its reason codes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gateway.routing.costs import regime_of
from gateway.routing.decision import KeyStanding, Prediction, ReplicaLoad, RoutingDecision
from gateway.routing.scorers import Candidate, Scoring


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
    # predicted_ttft's scorers and TTFT model (None for the other policies).
    scoring: Scoring | None = None
    # Keep each scorer's term per candidate, not only their sum (for /admin/route and the status page).
    explain: bool = False


def consistent_hash(decision: RoutingDecision, given: PickInput) -> None:
    decision.chosen = given.candidates[0]


def bounded_consistent_hash(decision: RoutingDecision, given: PickInput) -> None:
    candidates = given.candidates
    capacity = decision.capacity = _capacity(given)
    if given.standing.holds_reservation and candidates[0] == decision.home:
        decision.chosen = decision.home
        decision.used_reservation = True
        return
    allowed = _within_bound(decision, given, capacity)
    if allowed[0] != candidates[0]:
        decision.reasons.append("spill:over_capacity")
    decision.chosen = allowed[0]
    if decision.chosen != decision.home:
        decision.chosen, how = spill_target(allowed, given.resident)
        decision.reasons.append(how)


def predicted_ttft(decision: RoutingDecision, given: PickInput) -> None:
    """The lowest predicted TTFT among the candidates under the bound (the same bound as bounded_consistent_hash,
    over the load routing counts), each predicted as the sum of the pool's weighted scorers (routing/scorers/).
    A key holding its home's reservation may take it whatever the bound says, and the bound never forces a cold
    load: when every candidate under it has the adapter cold, those over it where it is warm compete too."""
    assert given.scoring is not None, "predicted_ttft needs the pool's scoring"
    candidates, by_id, home = given.candidates, given.by_id, decision.home
    capacity = decision.capacity = _capacity(given)
    allowed = _within_bound(decision, given, capacity)
    reserved_home = given.standing.holds_reservation and candidates[0] == home and allowed[0] != home
    if reserved_home:
        del decision.excluded[home]
        allowed.insert(0, home)
    scoring, resident = given.scoring, given.resident
    if not any(by_id[r].on_gpu or r in resident for r in allowed):
        # The bound left only replicas where the adapter is cold. A cold load stalls its replica for every request
        # there and evicts another adapter, so the bound does not force one: the warm candidates over it compete
        # too, and the prediction decides whether waiting there or loading elsewhere is faster.
        warm_over = [r for r in candidates if r not in allowed and (by_id[r].on_gpu or r in resident)]
        for replica_id in warm_over:
            del decision.excluded[replica_id]
        allowed = [r for r in candidates if r in allowed or r in warm_over]
    lines, weighted, explain = scoring.model.lines, scoring.weighted, given.explain
    best, best_ms = allowed[0], math.inf
    predictions = decision.predictions
    for replica_id in allowed:
        replica = by_id[replica_id]
        regime = regime_of(replica.on_gpu, replica_id in resident, replica.key_recent)
        candidate = Candidate(replica, regime, lines[regime], replica_id == home)
        if explain:
            parts = {name: weight * score(candidate) for name, weight, score in weighted}
            total = sum(parts.values())
        else:  # a request's own decision keeps the total; /admin/route's (explain) keeps every part
            parts, total = {}, 0.0
            for _, weight, score in weighted:
                total += weight * score(candidate)
        predictions[replica_id] = Prediction(regime, replica.in_flight, parts, total)
        if total < best_ms:  # strictly: a tie keeps the earlier candidate in the key's ring order
            best, best_ms = replica_id, total
    decision.chosen = best
    decision.used_reservation = reserved_home and best == home
    if best != home and home in candidates:
        decision.reasons.append("spill:over_capacity" if home not in allowed else "spill:faster")


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
    "predicted_ttft": predicted_ttft,
}


def _capacity(given: PickInput) -> int:
    """The bound: ``ceil(balance_factor x mean)`` of in flight + reserved over the candidates, counting this
    request, never below ``capacity_floor``."""
    by_id = given.by_id
    total = sum(by_id[r].in_flight + by_id[r].reserved for r in given.candidates)
    return max(math.ceil(given.balance_factor * (total + 1) / len(given.candidates)), given.capacity_floor)


def _within_bound(decision: RoutingDecision, given: PickInput, capacity: int) -> list[str]:
    """The candidates under the bound, in ring order (never empty: some replica is under the mean), and each one
    over it recorded as ``over_capacity``. A key with requests in flight counts reserved slots against it too; a
    replica in slow start has its share of the capacity."""
    candidates, by_id = given.candidates, given.by_id
    if given.standing.in_flight:
        load = {r: by_id[r].in_flight + by_id[r].reserved for r in candidates}
    else:
        load = {r: by_id[r].in_flight for r in candidates}
    allowed = [r for r in candidates if load[r] < _scaled(capacity, by_id[r].weight)]
    if not allowed:  # every replica with room is in slow start: the plain bound still has a pick
        allowed = [r for r in candidates if load[r] < capacity]
    if len(allowed) < len(candidates):
        room = set(allowed)
        decision.excluded.update((r, "over_capacity") for r in candidates if r not in room)
    return allowed


def _scaled(capacity: int, weight: float) -> int:
    return capacity if weight >= 1 else max(1, math.ceil(capacity * weight))


def spill_target(allowed: Sequence[str], resident: frozenset[str]) -> tuple[str, str]:
    """Where a request that cannot go home goes, among the replicas the bound allows (in ring order): the first
    where its adapter is already resident (no cold load), else the next on the ring."""
    for replica_id in allowed:
        if replica_id in resident:
            return replica_id, "spill:resident"
    return allowed[0], "spill:ring"
