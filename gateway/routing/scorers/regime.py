"""The cost of the request's regime on the replica at no load: the adapter's tier (running on the GPU, in host
memory, not loaded) and the prefill its prefix warmth leaves (routing/costs.py), as the pool has measured them."""

from __future__ import annotations

from gateway.routing.costs import Line, Regime
from gateway.routing.scorers.base import Linear, LinearScorer, ScorerSettings, scorer


@scorer("regime")
class RegimeCost(LinearScorer):
    def __init__(self, settings: ScorerSettings) -> None:
        pass

    def coefficients(self, line: Line, regime: Regime) -> Linear:
        return Linear(constant_ms=line.base_ms)
