"""Which failed requests count against a replica (passive outlier detection), decided here and nowhere else.

The rule: count what says the replica is sick, not what the request caused.

- **Always counted** (blame ``replica``): the connection was refused or reset, or a stream was cut off. Failed
  health probes take a replica down on their own (``health.py``).
- **Counted only on evidence** (blame ``suspect``): an engine 5xx, or a timeout of the pool's own deadline. Either
  may be the request's doing (a prompt that makes the engine fail, a long generation that runs past the timeout;
  a non-streaming one sends no byte before it, so "before the first byte" cannot tell the two apart). It counts
  when the evidence points at the replica:
  1. the same request then succeeded on another replica (dispatch retries an engine 5xx once and says so; a timeout
     is not retried, so only 2 and 3 count it);
  2. the engine's own metrics show it stalled: its counter of generated tokens has not moved for
     ``outlier.stall_after_s`` while it reported requests running or waiting at every scrape (``EngineProgress``);
  3. the suspect failures on the replica since its last success span at least two tenants (then all of them
     count, ``SuspectLedger``).
  A suspect failure that failed the same way on another replica too is the request's: neither counts.
- **Never counted** (blame ``none``): a 4xx, an error the engine names as the client's (its error type, e.g.
  vLLM's ``BadRequestError``, whatever its status), a full adapter cache, an adapter that would not load, the
  tenant's own shorter deadline or the request's deadline passing before it was sent.

So a tenant alone cannot eject a replica by what it sends, and a broken replica is still ejected when it serves a
single tenant (tenant affinity): its 5xx succeed elsewhere on retry, its hangs show as a stall. ``failures.py``
gives each engine failure its blame; ``Pool.report`` applies this rule through ``ReplicaHealth.attempt_failed``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from backends.base import EngineLoad

Blame = Literal["replica", "suspect", "none"]

# Why a failure was counted: the ``reason`` of an ejection (log line, /admin/residency, metric label).
Reason = Literal["unreachable", "failed_here_only", "stalled", "several_tenants"]


@dataclass(frozen=True, slots=True)
class Failure:
    """One failed attempt on a replica, as dispatch reports it."""

    blame: Blame
    tenant: str
    # The same request then succeeded on another replica.
    succeeded_elsewhere: bool = False


@dataclass
class EngineProgress:
    """Whether the engine is making progress, from its own metrics as the gateway scrapes them: the time it was last
    seen generating a token or idle (nothing running or waiting)."""

    stall_after_s: float
    progress_at: float = -math.inf
    scraped_at: float = -math.inf
    busy: bool = False
    _tokens: float | None = field(default=None, repr=False)

    def scraped(self, load: EngineLoad | None, now: float) -> None:
        """Take one scrape (None: it failed, or the engine reports no token counter: nothing is known)."""
        if load is None or load.generated_tokens is None:
            self._tokens, self.scraped_at = None, -math.inf
            return
        self.busy = load.running + load.waiting > 0
        if self._tokens is None or load.generated_tokens != self._tokens or not self.busy:
            self.progress_at = now
        self._tokens, self.scraped_at = load.generated_tokens, now

    def stalled(self, now: float) -> bool:
        """The last scrape is recent and shows requests in the engine, and no token was generated for
        ``stall_after_s`` before it."""
        fresh = now - self.scraped_at <= self.stall_after_s
        return fresh and self.busy and self.scraped_at - self.progress_at >= self.stall_after_s


@dataclass
class SuspectLedger:
    """The suspect failures on one replica not counted yet, and the tenants of every suspect failure since the
    replica's last success that cleared its failures."""

    tenants: set[str] = field(default_factory=set)
    pending: int = 0
    last_at: float = -math.inf

    def add(self, tenant: str, now: float) -> int:
        """Note a suspect failure; how many failures count now (this one and those held back), 0 if none."""
        self.tenants.add(tenant)
        self.pending += 1
        self.last_at = now
        if len(self.tenants) < 2:
            return 0
        counted, self.pending = self.pending, 0
        return counted

    def succeeded(self, started_at: float) -> None:
        """A request that started at ``started_at`` succeeded: it clears suspicions noted before it started."""
        if started_at >= self.last_at:
            self.tenants.clear()
            self.pending = 0


def judge(failure: Failure, ledger: SuspectLedger, progress: EngineProgress, now: float) -> tuple[int, Reason | None]:
    """How many failures count against the replica for ``failure`` (0 or more, suspicions held back included), and
    why."""
    if failure.blame == "none":
        return 0, None
    if failure.blame == "replica":
        return 1, "unreachable"
    if failure.succeeded_elsewhere:
        return 1, "failed_here_only"
    if progress.stalled(now):
        return 1, "stalled"
    counted = ledger.add(failure.tenant, now)
    return counted, "several_tenants" if counted else None
