"""The common decision of the bounded policies in one pass over the snapshot: every candidate up, at full weight,
under its per-replica cap, not one this request failed on, and (unless a reservation decides) under the bound.

Then no filter leaves a replica out and the bound excludes none, so the general pipeline's steps (filters.py, then
the picker's bound, its cold-load rule and its score in pickers.py) reduce to one loop over the candidates that
checks each and keeps the load total and the highest load, and the picker's last step: ``bounded_consistent_hash``
keeps the home; ``predicted_ttft`` takes the lowest predicted TTFT by the scorers' summed table, scored in that same
loop (``pickers.lowest_predicted``, the function the general picker scores with). Anything else (a replica down, in
slow start, at its cap or over the bound, a retry, a scorer that is not linear, an explanation) returns None or is
not tried, and the general pipeline decides. A property test holds the two to the same decision.

Why: a decision runs once per request and its cost was per candidate per step (about 1 us a candidate in all,
where the target is 20 us at p99 for the whole decision).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from gateway.routing.costs import Regime
from gateway.routing.decision import NO_PARTS, KeyStanding, Prediction, ReplicaLoad, RoutingDecision
from gateway.routing.pickers import lowest_predicted
from gateway.routing.scorers import Linear

# A named tuple's own __new__ without its Python-level argument handling (every field is passed, in order).
_new = tuple.__new__


def decide_plain(
    order: Sequence[str],
    key: str,
    replicas: Sequence[ReplicaLoad],
    pool: str,
    policy: str,
    balance_factor: float,
    capacity_floor: int,
    standing: KeyStanding,
    resident: frozenset[str],
    table: Mapping[Regime, Linear] | None,
    also_home: frozenset[str],
    cold_margin_ms: float = 0.0,
) -> RoutingDecision | None:
    """The decision when the case is plain (see the module docstring), else None. ``replicas[i]`` describes
    ``order[i]``; ``table``: predicted_ttft's summed scorers (None for bounded_consistent_hash)."""
    if not replicas:
        return None
    home = order[0]
    count_reserved = standing.in_flight > 0
    if table is None:  # bounded_consistent_hash
        plain, total, most = _plain_bounded(replicas, count_reserved)
    else:  # predicted_ttft: scored in the same pass
        best, regime, best_ms, plain, total, most, ahead, due = lowest_predicted(
            replicas,
            table,
            home,
            resident,
            also_home,
            count_reserved,
            cold_margin_ms,
            standing.in_flight,
            capacity_floor,
        )
    if not plain:
        return None
    capacity = math.ceil(balance_factor * total / len(replicas))
    if capacity < capacity_floor:
        capacity = capacity_floor
    if table is None:
        if most >= capacity and not standing.holds_reservation:  # a reservation takes home whatever the bound says
            return None
        return _decision(
            order, key, replicas, pool, policy, resident, home, "home", capacity, standing.holds_reservation
        )
    if most >= capacity:
        return None
    chosen = best.id
    decision = _decision(
        order,
        key,
        replicas,
        pool,
        policy,
        resident,
        chosen,
        "home" if chosen == home else "spill:faster",
        capacity,
        False,
    )
    decision.predictions[chosen] = _new(Prediction, (regime, best.in_flight, NO_PARTS, best_ms))
    decision.warm_ahead, decision.warm_ahead_due = ahead, due
    return decision


def _plain_bounded(replicas: Sequence[ReplicaLoad], count_reserved: bool) -> tuple[bool, int, int]:
    """lowest_predicted's second half for a policy that does not score: whether every candidate is up, at full
    weight and under its cap, the load total and the highest load the bound judges."""
    total, most = 1, 0
    for _, healthy, load, reserved, weight, at_cap, _, _, _ in replicas:
        if not healthy or at_cap or weight < 1.0:
            return False, 0, 0
        total += load + reserved
        if count_reserved:
            load += reserved
        if load > most:
            most = load
    return True, total, most


def _decision(
    order: Sequence[str],
    key: str,
    replicas: Sequence[ReplicaLoad],
    pool: str,
    policy: str,
    resident: frozenset[str],
    chosen: str,
    reason: str,
    capacity: int,
    used_reservation: bool,
) -> RoutingDecision:
    # Positional: RoutingDecision's fields in order (pool, policy, key, home, chosen, reasons, excluded, unavailable,
    # capacity, used_reservation, predictions, snapshot, resident_on, kept); every candidate was kept.
    return RoutingDecision(
        pool, policy, key, order[0], chosen, [reason], {}, None, capacity, used_reservation, {}, replicas,
        resident, replicas,
    )  # fmt: skip
