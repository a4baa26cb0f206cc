"""The wait for one of the replica's GPU adapter slots. vLLM runs a request only while its adapter holds one of the
engine's ``max_loras`` GPU slots; a slot frees only once no running request uses its adapter, so a request whose
adapter is not in use there, on a replica whose slots are all held by adapters in use, waits in the engine's queue
while later requests for those adapters overtake it (docs/benchmarks.md, "Three gateways: the regimes each gateway
prices": every request that waited over 0.5 s in an engine's queue on the churn trace had waited for a GPU slot).
No regime's line grows with it: their cost grows with the requests on a replica, not with the distinct adapters
holding its slots.

The pool predicts the wait per candidate (``ReplicaLoad.gpu_slot_ms``: costs.gpu_slot_waits, from the adapters this
gateway and the others have in flight there, the engine's last scrape of those running, and its slot count) and
learns its length online (``TtftModel.gpu_slot_ms``, from ``routing.ttft_priors.gpu_slot_ms``). Every regime pays
it: a request whose adapter is likely in a slot by its recent use, not in use now, loses that slot the same way.
Off by default (not in the default ``routing.scorers``)."""

from __future__ import annotations

from gateway.routing.costs import Line, Regime
from gateway.routing.scorers.base import Linear, LinearScorer, ScorerSettings, scorer


@scorer("gpu_slot")
class GpuSlot(LinearScorer):
    def __init__(self, settings: ScorerSettings) -> None:
        pass

    def coefficients(self, line: Line, regime: Regime) -> Linear:
        return Linear(per_slot_ms=1.0)
