"""The wait behind the requests already on the replica: the regime's learned cost per request ahead times the
replica's load as routing counts it (this gateway's own, or the engine's queue with ``load_view: engine``)."""

from __future__ import annotations

from gateway.routing.scorers.base import Candidate, ScorerSettings, scorer


@scorer("queue")
class QueueWait:
    def __init__(self, settings: ScorerSettings) -> None:
        pass

    def score(self, candidate: Candidate) -> float:
        return candidate.line.per_request_ms * candidate.replica.in_flight
