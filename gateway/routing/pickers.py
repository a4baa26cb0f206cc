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

from gateway.routing.costs import Regime, regime_of
from gateway.routing.decision import NO_PARTS, KeyStanding, Prediction, ReplicaLoad, RoutingDecision
from gateway.routing.scorers import Candidate, Linear, Scoring


@dataclass(slots=True)  # not frozen: built per decision, and a frozen dataclass costs 1 us more to build
class PickInput:
    """What a picker sees: the candidates in the key's ring order, and the numbers it may weigh."""

    candidates: Sequence[ReplicaLoad]
    balance_factor: float
    capacity_floor: int
    tick: int
    standing: KeyStanding
    resident: frozenset[str]
    # predicted_ttft's scorers and TTFT model (None for the other policies).
    scoring: Scoring | None = None
    # Keep each scorer's term per candidate, not only their sum (for /admin/route and the status page).
    explain: bool = False
    # The key's replica set from placement beyond its home (placement.py's table; empty without one): no
    # affinity margin there, as at home.
    also_home: frozenset[str] = frozenset()


def consistent_hash(decision: RoutingDecision, given: PickInput) -> None:
    decision.chosen = given.candidates[0].id


def bounded_consistent_hash(decision: RoutingDecision, given: PickInput) -> None:
    candidates, home = given.candidates, decision.home
    capacity = decision.capacity = _capacity(given)
    if given.standing.holds_reservation and candidates[0].id == home:
        decision.chosen = home
        decision.used_reservation = True
        return
    allowed = _within_bound(decision, given, capacity)
    if allowed[0] is not candidates[0]:
        decision.reasons.append("spill:over_capacity")
    decision.chosen = allowed[0].id
    if decision.chosen != home:
        decision.chosen, how = spill_target(allowed, given.resident)
        decision.reasons.append(how)


def predicted_ttft(decision: RoutingDecision, given: PickInput) -> None:
    """The lowest predicted TTFT among the candidates under the bound (the same bound as bounded_consistent_hash,
    over the load routing counts), each predicted as the sum of the pool's weighted scorers (routing/scorers/).
    A key holding its home's reservation may take it whatever the bound says, and the bound never forces a cold
    load: when every candidate under it has the adapter cold, those over it where it is warm compete too."""
    scoring = given.scoring
    assert scoring is not None, "predicted_ttft needs the pool's scoring"
    candidates, home, resident = given.candidates, decision.home, given.resident
    capacity = decision.capacity = _capacity(given)
    allowed = _within_bound(decision, given, capacity)
    reserved_home = given.standing.holds_reservation and candidates[0].id == home and allowed[0].id != home
    if reserved_home:
        del decision.excluded[home]
        allowed.insert(0, candidates[0])
    for replica in allowed:
        if replica.on_gpu or replica.id in resident:
            break
    else:
        # The bound left only replicas where the adapter is cold. A cold load stalls its replica for every request
        # there and evicts another adapter, so the bound does not force one: the warm candidates over it compete
        # too, and the prediction decides whether waiting there or loading elsewhere is faster.
        warm_over = [r for r in candidates if r not in allowed and (r.on_gpu or r.id in resident)]
        for replica in warm_over:
            del decision.excluded[replica.id]
        allowed = [r for r in candidates if r in allowed or r in warm_over]
    # The built-in scorers are linear: one row per regime sums them (scorers/base.py), and a request's own decision
    # keeps the chosen replica's prediction only (what the lease learns from). Explaining, or with a scorer that is
    # not linear, each scorer is asked per candidate; explaining keeps every candidate's prediction and parts.
    table = None if given.explain else scoring.table()
    if table is not None:
        chosen, regime, best_ms, ahead, due = lowest_predicted(
            allowed,
            table,
            home,
            resident,
            given.also_home,
            scoring.cold_margin_ms,
            given.standing.in_flight,
            given.capacity_floor,
            scoring.hold_copies,
        )
        best = chosen.id
        decision.predictions[best] = Prediction(regime, chosen.in_flight, NO_PARTS, best_ms, chosen.gpu_slot_ms > 0)
        decision.warm_ahead, decision.warm_ahead_due = ahead, due
    else:
        best = _score_each(decision, allowed, given, scoring)
    decision.chosen = best
    decision.used_reservation = reserved_home and best == home
    if best != home and candidates[0].id == home:
        decision.reasons.append("spill:over_capacity" if home in decision.excluded else "spill:faster")


def lowest_predicted(
    candidates: Sequence[ReplicaLoad],
    table: Mapping[Regime, Linear],
    home: str,
    resident: frozenset[str],
    also_home: frozenset[str],
    cold_margin_ms: float = 0.0,
    key_in_flight: int = 0,
    capacity_floor: int = 1,
    hold_copies: bool = False,
) -> tuple[ReplicaLoad, Regime, float, str | None, bool]:
    """The candidate with the lowest predicted TTFT by the scorers' summed table (scorers/base.py), its regime and
    its prediction: one lookup and two multiplications per candidate (a tie keeps the earlier one in ring order;
    the best candidate where the adapter is cold against the best where it is warm as ``warm_or_cold`` says, for
    a key with ``key_in_flight`` requests in flight). Last, the replica to warm the adapter on ahead of the key's
    next requests, or None, and whether it is due there (``warm_or_cold``). (fleet/one_pass.py scores a plain
    decision the same way, in its own loop.)"""
    # Each regime's row as three locals: per candidate, three local reads instead of three attribute reads.
    warm_c, warm_p, warm_o, _, warm_s = table["warm"]
    kv_cold_c, kv_cold_p, kv_cold_o, _, kv_cold_s = table["kv_cold"]
    host_c, host_p, host_o, _, host_s = table["host"]
    cold_c, cold_p, cold_o, cold_a, cold_s = table["cold"]  # only a cold load waits for the loads ahead of it
    best, best_ms = candidates[0], math.inf
    cold, cold_ms = best, math.inf  # the best candidate where the adapter is cold, kept apart
    warm_count = warm_load = 0
    regime: Regime
    best_regime: Regime = "cold"
    for replica in candidates:
        replica_id, _, load, _, _, _, on_gpu, key_recent, _, ahead_ms, slot_ms = replica  # cheaper than 6 reads
        # regime_of (costs.py), inline: this runs per candidate per decision.
        if on_gpu:
            if key_recent:
                regime = "warm"
                constant, per_request, off_home, per_slot = warm_c, warm_p, warm_o, warm_s
            else:
                regime = "kv_cold"
                constant, per_request, off_home, per_slot = kv_cold_c, kv_cold_p, kv_cold_o, kv_cold_s
        elif replica_id in resident:
            regime = "host"
            constant, per_request, off_home, per_slot = host_c, host_p, host_o, host_s
        else:
            ms = cold_c + cold_p * load + cold_a * ahead_ms + cold_s * slot_ms
            if replica_id != home and replica_id not in also_home:
                ms += cold_o
            if ms < cold_ms:  # strictly: a tie keeps the earlier candidate in the key's ring order
                cold, cold_ms = replica, ms
            continue
        warm_count += 1
        warm_load += load
        ms = constant + per_request * load + per_slot * slot_ms
        if replica_id != home and replica_id not in also_home:
            ms += off_home
        if ms < best_ms:
            best, best_ms, best_regime = replica, ms, regime
    if not warm_count:  # cold everywhere
        return cold, "cold", cold_ms, None, False
    hot = key_in_flight >= capacity_floor * warm_count and 3 * key_in_flight >= 2 * warm_load
    hold = hold_copies and warm_count >= 2
    take_cold, ahead = warm_or_cold(best_ms, cold.id, cold_ms, cold_margin_ms if hot else 0.0, hold)
    if take_cold:
        return cold, "cold", cold_ms, None, False
    return best, best_regime, best_ms, ahead, cold_ms < best_ms


def warm_or_cold(
    warm_ms: float, cold_id: str, cold_ms: float, cold_margin_ms: float, hold: bool = False
) -> tuple[bool, str | None]:
    """The best candidate where the request's adapter is warm (``warm_ms``) against the best where it is cold:
    whether the cold one is taken, and otherwise where to warm the adapter in the background, or None.

    ``cold_margin_ms`` is ``routing.cold_margin_ms`` for a hot key, one whose requests in flight reach the pool's
    ``capacity_floor`` on every replica where its adapter is warm (its demand fills what they take before the bound
    may spill it) and are two thirds of the load there (moving them is what relieves those replicas; heavy keys
    sharing one are spread by the scheduler's spills, as before), and 0 for another. A hot key takes a cold replica
    only when predicted faster by more than the margin (the load runs on the request's path and stalls the requests
    already there), and has its adapter warmed
    there in the background once the cold one comes within the margin: its warm replicas fill up while the load
    runs, so it starts before the cold one would win, and its requests spill there warm (issue 19). The warm-up
    is *due* once the cold replica is predicted faster outright (without the margin the key would take it now, and
    its load would push out the same adapter): the pool then warms it whatever that adapter's last use, and before
    that only where it pushes out nothing in use (``Pool.warm_ahead``). Another key
    takes the cold replica when predicted faster, as a spill always did: warming copies ahead for it would evict
    adapters other tenants still want (docs/benchmarks.md, hot and collide).

    ``hold`` (``routing.hold_copies``, for a key whose adapter is warm on two candidates or more): the cold one is
    never taken, however much faster, and is named to warm ahead once predicted faster (due), or within a hot key's
    margin. A key with copies already spills warm; the request that would take the next copy cold waits for its load
    there, and so does every request of the key that follows it while the load runs (the hot trace)."""
    if hold:
        return False, cold_id if cold_ms < warm_ms + cold_margin_ms else None
    if cold_ms + cold_margin_ms < warm_ms:
        return True, None
    return False, cold_id if cold_margin_ms and cold_ms < warm_ms + cold_margin_ms else None


def _score_each(decision: RoutingDecision, allowed: Sequence[ReplicaLoad], given: PickInput, scoring: Scoring) -> str:
    """predicted_ttft's scores asked of each scorer per candidate (explaining, or a scorer that is not linear):
    every candidate's prediction is kept, with each scorer's weighted term when explaining. Returns the best."""
    home, resident, explain = decision.home, given.resident, given.explain
    lines, weighted = scoring.model.lines, scoring.weighted
    best, best_ms = allowed[0].id, math.inf
    cold, cold_ms = best, math.inf  # the best candidate where the adapter is cold, kept apart (lowest_predicted)
    warm_count = warm_load = 0
    for replica in allowed:
        regime = regime_of(replica.on_gpu, replica.id in resident, replica.key_recent)
        candidate = Candidate(replica, regime, lines[regime], replica.id == home or replica.id in given.also_home)
        parts: Mapping[str, float] = NO_PARTS
        if explain:
            parts = {name: weight * score(candidate) for name, weight, score in weighted}
            total = sum(parts.values())
        else:
            total = 0.0
            for _, weight, score in weighted:
                total += weight * score(candidate)
        decision.predictions[replica.id] = Prediction(regime, replica.in_flight, parts, total, replica.gpu_slot_ms > 0)
        if regime == "cold":
            if total < cold_ms:  # strictly: a tie keeps the earlier candidate in the key's ring order
                cold, cold_ms = replica.id, total
            continue
        warm_count += 1
        warm_load += replica.in_flight
        if total < best_ms:
            best, best_ms = replica.id, total
    if not warm_count:
        return cold
    in_flight = given.standing.in_flight
    hot = in_flight >= given.capacity_floor * warm_count and 3 * in_flight >= 2 * warm_load
    hold = scoring.hold_copies and warm_count >= 2
    take_cold, decision.warm_ahead = warm_or_cold(best_ms, cold, cold_ms, scoring.cold_margin_ms if hot else 0.0, hold)
    decision.warm_ahead_due = decision.warm_ahead is not None and cold_ms < best_ms
    return cold if take_cold else best


def round_robin(decision: RoutingDecision, given: PickInput) -> None:
    ids = sorted(replica.id for replica in given.candidates)
    decision.chosen = ids[given.tick % len(ids)]
    if decision.chosen != decision.home:
        decision.reasons.append("policy:round_robin")


def least_loaded(decision: RoutingDecision, given: PickInput) -> None:
    decision.chosen = min(given.candidates, key=lambda replica: replica.in_flight).id
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
    total = 1
    for replica in given.candidates:
        total += replica.in_flight + replica.reserved
    return max(math.ceil(given.balance_factor * total / len(given.candidates)), given.capacity_floor)


def _within_bound(decision: RoutingDecision, given: PickInput, capacity: int) -> list[ReplicaLoad]:
    """The candidates under the bound, in ring order (never empty: some replica is under the mean), and each one
    over it recorded as ``over_capacity``. A key with requests in flight counts reserved slots against it too; a
    replica in slow start has its share of the capacity."""
    candidates = given.candidates
    count_reserved = given.standing.in_flight > 0
    allowed = []
    for replica in candidates:
        load = replica.in_flight + replica.reserved if count_reserved else replica.in_flight
        if load < (capacity if replica.weight >= 1 else max(1, math.ceil(capacity * replica.weight))):
            allowed.append(replica)
    if not allowed:  # every replica with room is in slow start: the plain bound still has a pick
        allowed = [r for r in candidates if (r.in_flight + r.reserved if count_reserved else r.in_flight) < capacity]
    if len(allowed) < len(candidates):
        excluded = decision.excluded
        for replica in candidates:
            if replica not in allowed:
                excluded[replica.id] = "over_capacity"
    return allowed


def spill_target(allowed: Sequence[ReplicaLoad], resident: frozenset[str]) -> tuple[str, str]:
    """Where a request that cannot go home goes, among the replicas the bound allows (in ring order): the first
    where its adapter is already resident (no cold load), else the next on the ring."""
    for replica in allowed:
        if replica.id in resident:
            return replica.id, "spill:resident"
    return allowed[0].id, "spill:ring"
