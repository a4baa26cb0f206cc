"""What a cold load costs the replica's other requests: vLLM loads an adapter between engine steps, so every
request running or queued there waits as long as the load takes (the cold regime's learned cost at no load).
Only a candidate where the request's adapter is cold pays it; the affinity and regime terms price the request's
own wait, this one the wait it imposes on the tenants already there."""

from __future__ import annotations

from gateway.routing.scorers.base import Candidate, ScorerSettings, scorer


@scorer("cold_stall")
class ColdStall:
    def __init__(self, settings: ScorerSettings) -> None:
        pass

    def score(self, candidate: Candidate) -> float:
        if candidate.regime != "cold":
            return 0.0
        return candidate.line.base_ms * candidate.replica.in_flight
