"""What the router decided for one request, and why: kept whole so logs, metrics and /admin/route can show it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Literal, NamedTuple

from gateway.routing.costs import Regime

# Why a request found no replica: every replica is down (or left out for its retry), or the live ones are full.
Unavailable = Literal["down", "full"]


class ReplicaLoad(NamedTuple):
    """One replica as the router sees it at decision time (a named tuple: one is built per candidate per decision,
    and a tuple is built in a third of a frozen dataclass's time)."""

    id: str
    # Up by its probes, not ejected, not being re-warmed.
    healthy: bool
    in_flight: int
    # Slots held for active keys homed here (see reservations.py); they count as load for other keys.
    reserved: int = 0
    # The share of the capacity it may take (below 1 during slow start after it came back).
    weight: float = 1.0
    # At the gateway's hard per-replica limit of requests in flight (limits.max_in_flight_per_replica).
    at_cap: bool = False
    # What predicted_ttft weighs (routing/costs.py): the request's adapter likely on the GPU there, and its key
    # served there within routing.prefix_warm_s (its prefix likely still in the KV cache).
    on_gpu: bool = False
    key_recent: bool = False
    # Where the request's adapter is not resident and the eviction scorer is on: how likely the adapter a load
    # there would push out (the least recently used idle one, when the set is full) is wanted there again soon,
    # 0 to 1 (fleet/pool.py).
    evict_loss: float = 0.0
    # Where the request's adapter is cold: the adapter loads a load there would wait for, in milliseconds (what is
    # left of the one running, and the others queued for the replica; this gateway's and, as they share them, the
    # other gateways': costs.loads_ahead_ms). The load_ahead scorer weighs it.
    loads_ahead_ms: float = 0.0
    # Where the request's adapter would wait for one of the replica's GPU adapter slots (costs.gpu_slot_waits: every
    # slot taken by other adapters in use there) and the gpu_slot scorer is on: the expected wait, in milliseconds
    # (the pool's learned ``TtftModel.gpu_slot_ms``); else 0.
    gpu_slot_ms: float = 0.0


class KeyStanding(NamedTuple):
    """The affinity key as the router sees it at decision time (a named tuple: one is built per decision)."""

    # Requests of this key in flight in the pool: a key with none is not hot, so reservations do not bind it.
    in_flight: int = 0
    # The key holds the slot reserved for it at its home (see reservations.py).
    holds_reservation: bool = False


NEW_KEY = KeyStanding()


# A request's own decision keeps each candidate's total only; /admin/route's (explain) keeps every part.
NO_PARTS: Mapping[str, float] = MappingProxyType({})


class Prediction(NamedTuple):
    """predicted_ttft's figures for one candidate: its regime, the load it counted, each scorer's weighted term
    (milliseconds, by scorer name; empty unless the decision was explained), their sum, and whether it was predicted
    to wait for a GPU adapter slot. A named tuple: one is built per candidate per decision."""

    regime: Regime
    load: int
    parts: Mapping[str, float]
    total_ms: float
    # Predicted to wait for a GPU adapter slot there (``ReplicaLoad.gpu_slot_ms``): what its TTFT teaches is that wait.
    waits_gpu_slot: bool = False

    def as_json(self) -> dict[str, Any]:
        return {
            "regime": self.regime,
            "load": self.load,
            "parts": dict(self.parts),
            "total_ms": self.total_ms,
            "waits_gpu_slot": self.waits_gpu_slot,
        }


@dataclass(slots=True)  # one per request: slots build and read faster
class RoutingDecision:
    pool: str
    policy: str
    key: str
    home: str
    chosen: str | None = None
    # Reason codes, in the order the steps took them: "home", "spill:unhealthy", "spill:over_capacity", ...
    # (docs/architecture.md lists them all).
    reasons: list[str] = field(default_factory=list)
    # Each replica a filter left out, and why: "unhealthy", "retry" (this request failed there), "replica_cap".
    excluded: dict[str, str] = field(default_factory=dict)
    # Set when nothing was chosen: "down" (no replica up) or "full" (those up are at their per-replica cap).
    unavailable: Unavailable | None = None
    capacity: int | None = None
    # The key took the slot reserved for it at its home.
    used_reservation: bool = False
    # predicted_ttft: each replica under the bound, with its predicted TTFT and the parts of it (numbers only;
    # /admin/route and the status page build the text).
    predictions: dict[str, Prediction] = field(default_factory=dict)
    # What the decision read: each weighed replica, and where the request's adapter was resident. Kept as read,
    # so the views below (for /admin/route, logs and tests) cost nothing unless asked for.
    snapshot: Sequence[ReplicaLoad] = field(default=(), repr=False)
    resident_on: frozenset[str] = field(default=frozenset(), repr=False)
    # The replicas the filters kept, in the key's ring order (``candidates`` names them).
    kept: Sequence[ReplicaLoad] = field(default=(), repr=False)
    # predicted_ttft, a hot key: a replica where its adapter is cold came within the cold margin of the warm ones
    # (pickers.warm_or_cold): the pool warms the adapter there in the background, so the key's next requests find
    # it warm (issue 19).
    warm_ahead: str | None = None
    # The cold replica is predicted faster outright: without the margin the key would take it now (its load pushing
    # out the same adapter), so the warm-up need not wait for an idle one to push out (Pool.warm_ahead).
    warm_ahead_due: bool = False
    # A decision in one pass over the pool's records (fleet/one_pass.py) keeps no snapshot: every candidate was
    # kept, and this names them in the key's ring order.
    order: Sequence[str] = field(default=(), repr=False)

    @property
    def candidates(self) -> list[str]:
        """The replicas the filters kept, in the key's ring order."""
        return [replica.id for replica in self.kept] if self.kept else list(self.order)

    @property
    def loads(self) -> dict[str, int]:
        """Each weighed replica's load as routing counted it."""
        return {replica.id: replica.in_flight for replica in self.snapshot}

    @property
    def reserved(self) -> dict[str, int]:
        """Slots held for other keys, per weighed replica that had any."""
        return {replica.id: replica.reserved for replica in self.snapshot if replica.reserved}

    @property
    def resident(self) -> list[str]:
        """Replicas where the request's adapter was resident when it was decided (what spill:resident looked at)."""
        return sorted(self.resident_on)

    def as_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in ("snapshot", "resident_on", "kept", "order")
        }
        data["reasons"], data["excluded"], data["candidates"] = list(self.reasons), dict(self.excluded), self.candidates
        data["predictions"] = {replica: p.as_json() for replica, p in self.predictions.items()}
        data.update(loads=self.loads, reserved=self.reserved, resident=self.resident)
        return data

    def span_attributes(self) -> dict[str, Any]:
        """The decision as OpenTelemetry span attributes (scalars and lists of strings only)."""
        return {
            "tenantgate.route.policy": self.policy,
            "tenantgate.route.home": self.home,
            "tenantgate.route.chosen": self.chosen or "",
            "tenantgate.route.reasons": self.reasons,
            "tenantgate.route.capacity": -1 if self.capacity is None else self.capacity,
            "tenantgate.route.used_reservation": self.used_reservation,
            "tenantgate.route.excluded": [f"{replica}:{why}" for replica, why in self.excluded.items()],
        }


_bare = object.__new__


def plain_decision(
    pool: str,
    policy: str,
    key: str,
    home: str,
    chosen: str,
    reason: str,
    capacity: int,
    used_reservation: bool,
    predictions: dict[str, Prediction],
    resident_on: frozenset[str],
    warm_ahead: str | None,
    warm_ahead_due: bool,
    order: Sequence[str],
) -> RoutingDecision:
    """The decision the one pass takes (gateway/fleet/one_pass.py): a replica chosen for one ``reason``, nothing
    excluded, no snapshot, every candidate kept (``order``). Its fields are set here, not through the dataclass's
    ``__init__``: a class call goes through ``type.__call__`` and the slot wrapper's argument handling (about 2,400
    instructions a decision, callgrind); this call and its stores cost most of that back (net about 200 fewer), and
    name what a plain decision is. Every field is set (tests/gateway/routing/test_decision.py holds this list to the
    dataclass's fields)."""
    decision = _bare(RoutingDecision)
    decision.pool, decision.policy, decision.key, decision.home = pool, policy, key, home
    decision.chosen, decision.reasons, decision.excluded, decision.unavailable = chosen, [reason], {}, None
    decision.capacity, decision.used_reservation, decision.predictions = capacity, used_reservation, predictions
    decision.snapshot, decision.resident_on, decision.kept = (), resident_on, ()
    decision.warm_ahead, decision.warm_ahead_due, decision.order = warm_ahead, warm_ahead_due, order
    return decision
