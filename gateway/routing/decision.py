"""What the router decided for one request, and why: kept whole so logs, metrics and /admin/route can show it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
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


@dataclass(frozen=True)
class KeyStanding:
    """The affinity key as the router sees it at decision time."""

    # Requests of this key in flight in the pool: a key with none is not hot, so reservations do not bind it.
    in_flight: int = 0
    # The key holds the slot reserved for it at its home (see reservations.py).
    holds_reservation: bool = False


NEW_KEY = KeyStanding()


@dataclass(frozen=True, slots=True)
class Prediction:
    """predicted_ttft's figures for one candidate: its regime, the load it counted, each scorer's weighted term
    (milliseconds, by scorer name) and their sum."""

    regime: Regime
    load: int
    parts: dict[str, float]
    total_ms: float


@dataclass
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
    loads: dict[str, int] = field(default_factory=dict)
    reserved: dict[str, int] = field(default_factory=dict)
    # The key took the slot reserved for it at its home.
    used_reservation: bool = False
    # Replicas where the request's adapter was resident when it was decided (what spill:resident looked at).
    resident: list[str] = field(default_factory=list)
    # The replicas the filters kept, in the key's ring order.
    candidates: list[str] = field(default_factory=list)
    # predicted_ttft: each replica under the bound, with its predicted TTFT and the parts of it (numbers only;
    # /admin/route and the status page build the text).
    predictions: dict[str, Prediction] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)

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
