"""Hysteresis for the key's home: any other replica pays ``affinity_margin_ms``, so a request leaves home only
when another replica is predicted faster by more than that. Without it two replicas within noise of each other
would trade the key back and forth, and each move costs a cold prefix (and, for a new replica, a cold adapter).
The rest of the key's replica set from placement (a hot adapter warmed on a second replica) counts as home
(``Candidate.is_home``)."""

from __future__ import annotations

from gateway.routing.costs import Line, Regime
from gateway.routing.scorers.base import Linear, LinearScorer, ScorerSettings, scorer


@scorer("affinity")
class Affinity(LinearScorer):
    def __init__(self, settings: ScorerSettings) -> None:
        self.margin_ms = settings.affinity_margin_ms

    def coefficients(self, line: Line, regime: Regime) -> Linear:
        return Linear(off_home_ms=self.margin_ms)
