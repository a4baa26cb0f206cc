"""The one pass's decision (routing/decision.py's plain_decision) sets every field of RoutingDecision: it does not
go through the dataclass's __init__, so a field added there and not here would be missing on each request."""

from __future__ import annotations

from dataclasses import fields

from gateway.routing.decision import plain_decision


def test_a_plain_decision_sets_every_field() -> None:
    decision = plain_decision("p", "predicted_ttft", "k", "r0", "r1", "spill:faster", 8, False, {}, frozenset(),
                              None, False, ("r0", "r1"))  # fmt: skip
    for field in fields(decision):
        getattr(decision, field.name)  # an unset slot raises AttributeError
    assert decision.reasons == ["spill:faster"] and decision.candidates == ["r0", "r1"] and decision.excluded == {}
