"""The adapter loads a cold load would queue behind on the replica. A gateway loads adapters on a replica one at a
time (the replica's lock, this gateway's and across gateways the store's), and vLLM runs a load between engine steps:
a cold load placed where another load is running, or queued, starts only once they have ended, and its request waits
for them as well as for its own load. The cold regime's learned line prices the request's own load, at a typical
replica; this term adds what is left of the loads ahead of it there (``ReplicaLoad.loads_ahead_ms``: the running
load's expected time less what it has run, plus one expected load per load queued: costs.loads_ahead_ms), so a cold
load goes to a replica that is not loading when one is as good otherwise (docs/benchmarks.md, "Three gateways: the
lock's hand-over": cold loads placed behind a load begun 2-350 ms earlier, with one gateway or three).

Only a candidate where the request's adapter is cold pays it: one where it is warm or in host memory needs no load
of its own (its wait behind a running load is not priced here)."""

from __future__ import annotations

from gateway.routing.costs import Line, Regime
from gateway.routing.scorers.base import Linear, LinearScorer, ScorerSettings, scorer


@scorer("load_ahead")
class LoadAhead(LinearScorer):
    def __init__(self, settings: ScorerSettings) -> None:
        pass

    def coefficients(self, line: Line, regime: Regime) -> Linear:
        return Linear(per_ahead_ms=1.0) if regime == "cold" else Linear()
