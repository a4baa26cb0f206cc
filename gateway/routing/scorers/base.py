"""What a scorer is: a small class that says, in milliseconds, what one term of a candidate's predicted TTFT is.

predicted_ttft (routing/pickers.py) sums each configured scorer's term times its weight (``routing.scorers``) and
takes the candidate with the lowest sum among those under the bound. A scorer is registered under its name by its
module (``@scorer("name")``); adding one is one module here and its import in ``__init__``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from gateway.routing.costs import Line, Regime, TtftModel
from gateway.routing.decision import ReplicaLoad


class Candidate(NamedTuple):
    """One replica under the bound as a scorer sees it."""

    replica: ReplicaLoad
    regime: Regime
    # The pool's learned TTFT line for that regime (routing/costs.py).
    line: Line
    is_home: bool


class Scorer(Protocol):
    def score(self, candidate: Candidate) -> float:
        """This term of the candidate's predicted TTFT, in milliseconds (before its weight)."""
        ...


@dataclass(frozen=True)
class ScorerSettings:
    """What scorers may be configured with (routing config, passed on by the pool)."""

    # Leaving the key's home must be predicted faster by more than this.
    affinity_margin_ms: float = 10.0


ScorerFactory = Callable[[ScorerSettings], Scorer]
SCORERS: dict[str, ScorerFactory] = {}


def scorer(name: str) -> Callable[[ScorerFactory], ScorerFactory]:
    def register(factory: ScorerFactory) -> ScorerFactory:
        SCORERS[name] = factory
        return factory

    return register


@dataclass(frozen=True)
class Scoring:
    """A pool's scorers with their weights, and the TTFT model they read. ``weighted``: each term's name, weight
    and bound ``score``, looked up once here rather than per candidate."""

    terms: tuple[tuple[str, float, Scorer], ...]
    model: TtftModel
    weighted: tuple[tuple[str, float, Callable[[Candidate], float]], ...] = field(init=False)

    def __post_init__(self) -> None:
        weighted = tuple((name, weight, term.score) for name, weight, term in self.terms)
        object.__setattr__(self, "weighted", weighted)


def build_scoring(weights: Mapping[str, float], settings: ScorerSettings, model: TtftModel) -> Scoring:
    """The scorers named in ``weights`` (unknown names are refused: config validates them first)."""
    unknown = sorted(set(weights) - set(SCORERS))
    if unknown:
        raise ValueError(f"unknown scorers {unknown}; known: {sorted(SCORERS)}")
    terms = tuple((name, weight, SCORERS[name](settings)) for name, weight in weights.items() if weight)
    return Scoring(terms, model)
