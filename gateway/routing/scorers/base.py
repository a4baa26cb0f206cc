"""What a scorer is: a small class that says, in milliseconds, what one term of a candidate's predicted TTFT is.

predicted_ttft (routing/pickers.py) sums each configured scorer's term times its weight (``routing.scorers``) and
takes the candidate with the lowest sum among those under the bound. A scorer is registered under its name by its
module (``@scorer("name")``); adding one is one module here and its import in ``__init__``.

Most terms are linear in the candidate's load, given its regime's learned line: a ``LinearScorer`` says only its
coefficients (``Linear``), and its ``score`` follows from them. When every configured scorer is linear (the
built-in ones are), ``Scoring.table`` sums their weighted coefficients once per regime, and a decision scores a
candidate with one lookup and two multiplications instead of a call per scorer (the decision's cost is per
candidate, and this is most of it). A scorer that is not linear (it implements ``score`` alone) is still welcome:
every decision then calls each scorer per candidate.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from gateway.routing.costs import REGIMES, Line, Regime, TtftModel
from gateway.routing.decision import ReplicaLoad


class Candidate(NamedTuple):
    """One replica under the bound as a scorer sees it."""

    replica: ReplicaLoad
    regime: Regime
    # The pool's learned TTFT line for that regime (routing/costs.py).
    line: Line
    # The key's home, or another replica of its placement replica set.
    is_home: bool


class Scorer(Protocol):
    def score(self, candidate: Candidate) -> float:
        """This term of the candidate's predicted TTFT, in milliseconds (before its weight)."""
        ...


class Linear(NamedTuple):
    """A term in milliseconds: ``constant_ms + per_request_ms x load + per_ahead_ms x loads_ahead_ms + per_slot_ms
    x gpu_slot_ms``, plus ``off_home_ms`` on any replica but the key's home. ``loads_ahead_ms``: the adapter loads a
    cold load there would wait for (``ReplicaLoad.loads_ahead_ms``); ``gpu_slot_ms``: the expected wait for a GPU
    adapter slot there (``ReplicaLoad.gpu_slot_ms``)."""

    constant_ms: float = 0.0
    per_request_ms: float = 0.0
    off_home_ms: float = 0.0
    per_ahead_ms: float = 0.0
    per_slot_ms: float = 0.0

    def at(self, load: int, is_home: bool, loads_ahead_ms: float = 0.0, gpu_slot_ms: float = 0.0) -> float:
        return (
            self.constant_ms
            + self.per_request_ms * load
            + self.per_ahead_ms * loads_ahead_ms
            + self.per_slot_ms * gpu_slot_ms
            + (0.0 if is_home else self.off_home_ms)
        )


class LinearScorer:
    """A scorer whose term is linear in the candidate's load for a given regime and line."""

    def coefficients(self, line: Line, regime: Regime) -> Linear:
        raise NotImplementedError

    def score(self, candidate: Candidate) -> float:
        replica = candidate.replica
        return self.coefficients(candidate.line, candidate.regime).at(
            replica.in_flight, candidate.is_home, replica.loads_ahead_ms, replica.gpu_slot_ms
        )


@dataclass(frozen=True)
class ScorerSettings:
    """What scorers may be configured with (routing config, passed on by the pool)."""

    # Leaving the key's home must be predicted faster by more than this.
    affinity_margin_ms: float = 10.0
    # The eviction scorer: what losing a victim that is wanted again costs, in cold loads of the cold regime's base.
    eviction_cost: float = 2.0
    # Not a scorer's: a candidate where the adapter is cold wins over one where it is warm only when predicted
    # faster by more than this (pickers.warm_or_cold).
    cold_margin_ms: float = 0.0
    # Not a scorer's either: a key whose adapter is warm on two replicas or more takes no cold one on the request
    # path (pickers.warm_or_cold).
    hold_copies: bool = False


ScorerFactory = Callable[[ScorerSettings], Scorer]
SCORERS: dict[str, ScorerFactory] = {}


def scorer(name: str) -> Callable[[ScorerFactory], ScorerFactory]:
    def register(factory: ScorerFactory) -> ScorerFactory:
        SCORERS[name] = factory
        return factory

    return register


class Scoring:
    """A pool's scorers with their weights, and the TTFT model they read. ``weighted``: each term's name, weight
    and bound ``score``, looked up once here rather than per candidate."""

    __slots__ = (
        "_linear",
        "_table",
        "_table_version",
        "cold_margin_ms",
        "hold_copies",
        "model",
        "rows",
        "terms",
        "weighted",
    )

    def __init__(
        self,
        terms: tuple[tuple[str, float, Scorer], ...],
        model: TtftModel,
        cold_margin_ms: float = 0.0,
        hold_copies: bool = False,
    ) -> None:
        self.terms = terms
        self.model = model
        self.cold_margin_ms = cold_margin_ms
        self.hold_copies = hold_copies
        self.weighted: tuple[tuple[str, float, Callable[[Candidate], float]], ...] = tuple(
            (name, weight, term.score) for name, weight, term in terms
        )
        linear = [(weight, term) for _, weight, term in terms if isinstance(term, LinearScorer)]
        self._linear = linear if len(linear) == len(terms) else None
        self._table: Mapping[Regime, Linear] = {}
        self._table_version = -1
        # The table as one plain tuple, each regime's row in REGIMES order (``table`` sets it): what the one pass
        # (gateway/fleet/one_pass.py) unpacks at each decision. A plain tuple, not four ``Linear``s: unpacking a
        # named tuple is not specialised by the interpreter (it iterates), 800 instructions a row against 100.
        self.rows: tuple[float, ...] = ()

    def table(self) -> Mapping[Regime, Linear] | None:
        """Per regime, the weighted sum of every scorer's coefficients for the model's lines now (rebuilt when a
        line moves); None when some scorer is not linear."""
        if self._linear is None:
            return None
        model = self.model
        if self._table_version != model.version:
            table: dict[Regime, Linear] = {}
            for regime in REGIMES:
                line = model.lines[regime]
                parts = [(weight, term.coefficients(line, regime)) for weight, term in self._linear]
                table[regime] = Linear(
                    sum(weight * part.constant_ms for weight, part in parts),
                    sum(weight * part.per_request_ms for weight, part in parts),
                    sum(weight * part.off_home_ms for weight, part in parts),
                    sum(weight * part.per_ahead_ms for weight, part in parts),
                    sum(weight * part.per_slot_ms for weight, part in parts),
                )
            self._table, self._table_version = table, model.version
            self.rows = tuple(value for regime in REGIMES for value in table[regime])
        return self._table


def build_scoring(weights: Mapping[str, float], settings: ScorerSettings, model: TtftModel) -> Scoring:
    """The scorers named in ``weights`` (unknown names are refused: config validates them first)."""
    unknown = sorted(set(weights) - set(SCORERS))
    if unknown:
        raise ValueError(f"unknown scorers {unknown}; known: {sorted(SCORERS)}")
    terms = tuple((name, weight, SCORERS[name](settings)) for name, weight in weights.items() if weight)
    return Scoring(terms, model, settings.cold_margin_ms, settings.hold_copies)
