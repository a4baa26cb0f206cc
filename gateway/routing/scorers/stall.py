"""What a cold load costs the replica's other requests: vLLM loads an adapter between engine steps, so every
request running or queued there waits as long as the load takes (the cold regime's learned cost at no load).
Only a candidate where the request's adapter is cold pays it; the affinity and regime terms price the request's
own wait, this one the wait it imposes on the tenants already there."""

from __future__ import annotations

from gateway.routing.costs import Line, Regime
from gateway.routing.scorers.base import Linear, LinearScorer, ScorerSettings, scorer


@scorer("cold_stall")
class ColdStall(LinearScorer):
    def __init__(self, settings: ScorerSettings) -> None:
        pass

    def coefficients(self, line: Line, regime: Regime) -> Linear:
        return Linear(per_request_ms=line.base_ms) if regime == "cold" else Linear()
