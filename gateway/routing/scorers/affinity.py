"""Hysteresis for the key's home: any other replica pays ``affinity_margin_ms``, so a request leaves home only
when another replica is predicted faster by more than that. Without it two replicas within noise of each other
would trade the key back and forth, and each move costs a cold prefix (and, for a new replica, a cold adapter)."""

from __future__ import annotations

from gateway.routing.scorers.base import Candidate, ScorerSettings, scorer


@scorer("affinity")
class Affinity:
    def __init__(self, settings: ScorerSettings) -> None:
        self.margin_ms = settings.affinity_margin_ms

    def score(self, candidate: Candidate) -> float:
        return 0.0 if candidate.is_home else self.margin_ms
