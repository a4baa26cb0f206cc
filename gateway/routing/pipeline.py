"""One routing decision: candidates in the key's ring order, filters (filters.py), then the pool's picker
(pickers.py). Pure: it reads a snapshot of the replicas and returns a decision that says why at every step.

Reason codes, in the order the steps add them (also in docs/architecture.md):
- ``home``: the request goes to its key's home replica;
- ``spill:<why>``: the home was left out by a filter: ``spill:unhealthy``, ``spill:retry``, ``spill:replica_cap``;
- ``spill:over_capacity``: the home (or the first candidate) was over the bounded-load cap;
- ``spill:faster``: predicted_ttft left a home under the bound for a replica predicted faster by more than the
  affinity margin;
- ``spill:resident`` / ``spill:ring``: where a request that left home went (its adapter resident there, or the
  next replica on the ring);
- ``policy:round_robin`` / ``policy:least_loaded``: a baseline policy chose a replica other than the home;
- ``no_healthy_replica`` / ``no_replica_with_room``: nothing chosen; the pool is down, or every replica that is up
  is at its per-replica cap (``decision.unavailable`` is ``"down"`` or ``"full"``);
- ``retry``: added by dispatch to a decision made for a request's second attempt.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from gateway.routing.decision import NEW_KEY, KeyStanding, ReplicaLoad, RoutingDecision
from gateway.routing.filters import filter_replicas
from gateway.routing.pickers import PICKERS, PickInput
from gateway.routing.scorers import Scoring


class Router:
    """One pool's routing settings, bound once (its name, policy, bound and scorers): every decision of the pool
    passes them, and a call with five arguments fewer costs less. ``decide`` below builds one per call."""

    __slots__ = ("balance_factor", "capacity_floor", "picker", "policy", "pool", "scoring")

    def __init__(
        self, pool: str, policy: str, balance_factor: float, capacity_floor: int = 1, scoring: Scoring | None = None
    ) -> None:
        picker = PICKERS.get(policy)
        if picker is None:
            raise ValueError(f"unknown routing policy {policy!r}")
        self.pool, self.policy, self.picker = pool, policy, picker
        self.balance_factor, self.capacity_floor, self.scoring = balance_factor, capacity_floor, scoring

    def decide(
        self,
        order: Sequence[str],
        key: str,
        replicas: Sequence[ReplicaLoad],
        tick: int = 0,
        standing: KeyStanding = NEW_KEY,
        resident: frozenset[str] = frozenset(),
        avoid: Collection[str] = (),
        explain: bool = False,
        also_home: frozenset[str] = frozenset(),
        aligned: bool = True,
    ) -> RoutingDecision:
        """See ``decide``."""
        policy, scoring = self.policy, self.scoring
        assert policy != "predicted_ttft" or scoring is not None, "predicted_ttft needs the pool's scoring"
        if not aligned:
            by_id = {replica.id: replica for replica in replicas}
            replicas = [by_id[replica_id] for replica_id in order]
        decision = RoutingDecision(
            pool=self.pool,
            policy=policy,
            key=key,
            home=order[0] if order else "",
            snapshot=replicas,
            resident_on=resident,
        )
        candidates, decision.excluded = filter_replicas(replicas, avoid)
        decision.kept = candidates
        if not candidates:
            full = "replica_cap" in decision.excluded.values()
            decision.unavailable = "full" if full else "down"
            decision.reasons.append("no_replica_with_room" if full else "no_healthy_replica")
            return decision
        if candidates[0].id != decision.home:
            decision.reasons.append(f"spill:{decision.excluded[decision.home]}")
        given = PickInput(
            candidates, self.balance_factor, self.capacity_floor, tick, standing, resident, scoring, explain, also_home
        )
        self.picker(decision, given)
        if decision.chosen == decision.home:
            decision.reasons.insert(0, "home")
        return decision


def decide(
    order: Sequence[str],
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
    avoid: Collection[str] = (),
    scoring: Scoring | None = None,
    explain: bool = False,
    aligned: bool = False,
    also_home: frozenset[str] = frozenset(),
) -> RoutingDecision:
    """Choose a replica for ``key`` among ``order`` (the candidates in the key's preference order, home first;
    ``replicas`` describes each of them); ``decision.chosen`` is None only when the filters left none, and then
    ``decision.unavailable`` says why. ``avoid``: replicas this request already failed on. ``scoring``:
    predicted_ttft's scorers and model; ``explain``: keep each scorer's term per candidate, not only the sum.
    ``aligned``: ``replicas[i]`` describes ``order[i]`` (the pool's snapshot), so no lookup by id is needed.
    ``also_home``: the rest of the key's replica set from placement, where predicted_ttft charges no affinity
    margin either. A pool binds its settings once in a ``Router`` and calls its ``decide`` (and decides the plain
    case in one pass over its own records first: fleet/one_pass.py)."""
    router = Router(pool, policy, balance_factor, capacity_floor, scoring)
    return router.decide(order, key, replicas, tick, standing, resident, avoid, explain, also_home, aligned)
