"""The wait behind the requests already on the replica: the regime's learned cost per request ahead times the
replica's load as routing counts it (this gateway's own, or the engine's queue with ``load_view: engine``)."""

from __future__ import annotations

from gateway.routing.costs import Line, Regime
from gateway.routing.scorers.base import Linear, LinearScorer, ScorerSettings, scorer


@scorer("queue")
class QueueWait(LinearScorer):
    def __init__(self, settings: ScorerSettings) -> None:
        pass

    def coefficients(self, line: Line, regime: Regime) -> Linear:
        return Linear(per_request_ms=line.per_request_ms)
