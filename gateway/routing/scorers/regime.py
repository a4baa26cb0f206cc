"""The cost of the request's regime on the replica at no load: the adapter's tier (running on the GPU, in host
memory, not loaded) and the prefill its prefix warmth leaves (routing/costs.py), as the pool has measured them."""

from __future__ import annotations

from gateway.routing.scorers.base import Candidate, ScorerSettings, scorer


@scorer("regime")
class RegimeCost:
    def __init__(self, settings: ScorerSettings) -> None:
        pass

    def score(self, candidate: Candidate) -> float:
        return candidate.line.base_ms
