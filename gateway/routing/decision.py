"""What the router decided for one request, and why: kept whole so logs, metrics and /admin/route can show it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica as the router sees it at decision time."""

    id: str
    healthy: bool
    in_flight: int


@dataclass
class RoutingDecision:
    pool: str
    policy: str
    key: str
    home: str
    chosen: str | None = None
    # Reason codes, in the order the steps took them: "home", "spill:unhealthy", "spill:over_capacity", ...
    reasons: list[str] = field(default_factory=list)
    capacity: int | None = None
    loads: dict[str, int] = field(default_factory=dict)
    healthy: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)
