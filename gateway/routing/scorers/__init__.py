"""Scorers for the predicted_ttft policy: each module registers one (scorers/base.py says what one is)."""

from gateway.routing.scorers import affinity, eviction, gpu_slot, load_ahead, queue, regime, stall
from gateway.routing.scorers.base import (
    SCORERS,
    Candidate,
    Linear,
    LinearScorer,
    Scorer,
    ScorerSettings,
    Scoring,
    build_scoring,
)

__all__ = [
    "SCORERS",
    "Candidate",
    "Linear",
    "LinearScorer",
    "Scorer",
    "ScorerSettings",
    "Scoring",
    "affinity",
    "build_scoring",
    "eviction",
    "gpu_slot",
    "load_ahead",
    "queue",
    "regime",
    "stall",
]
