"""What a cold load costs the adapter it pushes out. A replica whose adapter set is full drops one to load another
(the engine's least recently used idle one: vLLM's host cache is an LRU, and the gateway's unload only forgets a
name), and if that adapter is wanted there again soon its next request pays a cold load too. A candidate where the
request's adapter is cold pays ``eviction_cost`` cold loads (the cold regime's learned base) times the chance that
its victim is wanted there again soon (``ReplicaLoad.evict_loss``, from the victim's recent request rate:
fleet/pool.py); a free slot, or a victim nobody asks for, costs nothing. So a cold load goes where it pushes out an
adapter nobody is asking for rather than one a tenant is about to use.

Not linear in the load (the victim's loss is per replica): with it configured, every decision asks each scorer per
candidate (scorers/base.py), a few microseconds more. Off by default (docs/benchmarks.md, collide and churn)."""

from __future__ import annotations

from gateway.routing.scorers.base import Candidate, ScorerSettings, scorer


@scorer("eviction")
class EvictionCost:
    def __init__(self, settings: ScorerSettings) -> None:
        self.cost = settings.eviction_cost

    def score(self, candidate: Candidate) -> float:
        if candidate.regime != "cold":
            return 0.0
        return self.cost * candidate.line.base_ms * candidate.replica.evict_loss
