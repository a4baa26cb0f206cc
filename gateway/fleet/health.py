"""One replica's health as the router sees it: active probes with thresholds, passive outlier ejection, and
slow start after it comes back. Pure bookkeeping over a monotonic clock; the pool calls it and acts on it. Which
failures count toward an ejection is outlier.py's rule."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.config import HealthConfig, OutlierConfig
from gateway.fleet.outlier import EngineProgress, Failure, Reason, SuspectLedger, judge

# routing_state's two common answers, built once.
_OUT = (False, 0.0)
_IN_FULL = (True, 1.0)


@dataclass
class ReplicaHealth:
    health: HealthConfig
    outlier: OutlierConfig
    slow_start_s: float
    clock: Callable[[], float] = time.monotonic
    consecutive_failures: int = 0
    # When the last failure was counted (clock time): a success only clears failures from before it started.
    last_failure_at: float = -math.inf
    ejections: int = 0
    ejected_until: float = 0.0
    # How long the latest ejection was set for (base_ejection_s doubled per ejection, up to max_ejection_s).
    last_ejection_s: float = 0.0
    # Since when it takes traffic again (slow start counts from here); -inf: since before the gateway started.
    serving_since: float = -math.inf
    # Why it was last ejected, and how many ejections each reason caused (the metric's counter).
    ejection_reason: Reason | None = None
    ejections_by_reason: dict[str, int] = field(default_factory=dict)
    # Suspect failures held back until evidence points at the replica, and the engine's progress (outlier.py).
    suspects: SuspectLedger = field(default_factory=SuspectLedger)
    progress: EngineProgress = field(init=False)
    # From when it takes traffic at its full weight: max(serving_since, ejected_until) + slow_start_s, or never
    # (inf) while its probes, a re-warm or a drain keep it out. Restated by everything that moves one of those; the
    # pool reads it per candidate per decision: one comparison instead of a call to routing_state.
    full_weight_at: float = field(init=False)
    # What the probes say, after thresholds (``up``); back from down and being re-warmed (``returning``); drained
    # by an operator (``drained``): properties, so that setting one restates full_weight_at.
    _up: bool = field(default=True, init=False)
    _returning: bool = field(default=False, init=False)
    _drained: bool = field(default=False, init=False)
    _probe_streak: int = field(default=0, repr=False)
    _probed: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        self.progress = EngineProgress(self.outlier.stall_after_s)
        self._restate()

    def _restate(self) -> None:
        if not self._up or self._returning or self._drained:
            self.full_weight_at = math.inf
        else:
            self.full_weight_at = max(self.serving_since, self.ejected_until) + max(0.0, self.slow_start_s)

    @property
    def up(self) -> bool:
        """What the probes say, after thresholds. A replica starts up: the gateway probes it once before serving."""
        return self._up

    @up.setter
    def up(self, value: bool) -> None:
        self._up = value
        self._restate()

    @property
    def returning(self) -> bool:
        """Back from down and being re-warmed: not taking traffic until that is done."""
        return self._returning

    @returning.setter
    def returning(self, value: bool) -> None:
        self._returning = value
        self._restate()

    @property
    def drained(self) -> bool:
        """Drained by an operator: no new requests; those in flight finish."""
        return self._drained

    @drained.setter
    def drained(self, value: bool) -> None:
        self._drained = value
        self._restate()

    def available(self, now: float | None = None) -> bool:
        """Takes traffic at ``now`` (health's clock; read when not given)."""
        if not self.up or self.returning or self.drained:
            return False
        return (self.clock() if now is None else now) >= self.ejected_until

    @property
    def ejected(self) -> bool:
        return self.clock() < self.ejected_until

    def weight(self, now: float | None = None) -> float:
        """The share of its capacity it may take at ``now`` (health's clock; read when not given): 1, or growing
        from 0.1 during slow start."""
        if self.slow_start_s <= 0:
            return 1.0
        since = max(self.serving_since, self.ejected_until)
        elapsed = (self.clock() if now is None else now) - since
        return 1.0 if elapsed >= self.slow_start_s else max(0.1, elapsed / self.slow_start_s)

    def routing_state(self, now: float) -> tuple[bool, float]:
        """``available(now)`` and ``weight(now)`` in one call (read per candidate per routing decision)."""
        if not self.up or self.returning or self.drained or now < self.ejected_until:
            return _OUT
        since = self.serving_since if self.serving_since > self.ejected_until else self.ejected_until
        elapsed = now - since
        if elapsed >= self.slow_start_s:
            return _IN_FULL
        return True, max(0.1, elapsed / self.slow_start_s)

    def probed(self, ok: bool) -> str | None:
        """Take one probe result; returns "down" or "up" when the state flips, else None. The first probe (before
        the gateway serves) sets the state outright."""
        if not self._probed:
            self._probed, self.up = True, ok
            return None
        if ok == self.up:
            self._probe_streak = 0
            return None
        self._probe_streak += 1
        if self._probe_streak < (self.health.healthy_after if ok else self.health.unhealthy_after):
            return None
        self._probe_streak = 0
        self.up = ok
        return "up" if ok else "down"

    def back_in_service(self) -> None:
        """Its probes pass again and it has been re-warmed: that outweighs an ejection from before it went down
        (the backoff count stays, so a flapping replica is ejected for longer next time)."""
        self.returning = False
        self.consecutive_failures = 0
        self.ejected_until = 0.0
        self.serving_since = self.clock()
        self._restate()

    def request_succeeded(self, started_at: float = math.inf) -> None:
        """A request that started at ``started_at`` (clock time) succeeded. It clears the failures in a row only
        if none was counted since it started: a long stream that ends well says nothing of the requests the
        replica has refused meanwhile."""
        if started_at >= self.last_failure_at:
            self.consecutive_failures = 0
        self.suspects.succeeded(started_at)

    def attempt_failed(self, failure: Failure, may_eject: bool) -> Reason | None:
        """A request failed here: count it if outlier.py's rule says the replica is to blame. The reason when this
        failure ejects the replica, else None (``may_eject``: the pool's cap)."""
        counted, reason = judge(failure, self.suspects, self.progress, self.clock())
        ejected = False
        for _ in range(counted):
            ejected = self.request_failed(may_eject, reason) or ejected
        return reason if ejected else None

    def request_failed(self, may_eject: bool, reason: Reason | None = None) -> bool:
        """Count a failure against the replica; True when it ejects the replica (``may_eject``: the pool's cap)."""
        self.consecutive_failures += 1
        self.last_failure_at = self.clock()
        if self.consecutive_failures < self.outlier.consecutive_failures or self.ejected or not may_eject:
            return False
        duration = min(self.outlier.base_ejection_s * 2**self.ejections, self.outlier.max_ejection_s)
        self.ejections += 1
        self.last_ejection_s = duration
        self.ejected_until = self.clock() + duration
        self._restate()
        self.ejection_reason = reason
        if reason is not None:
            self.ejections_by_reason[reason] = self.ejections_by_reason.get(reason, 0) + 1
        self.consecutive_failures = 0
        return True
