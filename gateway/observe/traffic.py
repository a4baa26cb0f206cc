"""Traffic per affinity key: requests and tokens per second, as an exponentially weighted moving average.

The request path only counts: a request when it is placed (``placed``), what it used when it ends (``ended``): a
few additions in a dict. Every interval ``fold`` turns the counts into
rates and mixes them into the average with weight ``1 - exp(-elapsed / window_s)``, so a key's rate weighs the
last ``window_s`` seconds most and a key that stops decays towards zero (it is dropped below ``_FORGET`` requests
per second). The number of keys is bounded twice, because session keys are unbounded in number: at most
``max_keys_per_interval`` distinct keys are counted within one interval (a newcomer past it counts only in its
pool's total), and after a fold only the ``max_keys`` busiest are kept. Each pool's total is exact either way.

A key's requests in flight on average (``in_flight``) come from the same counts, by Little's law: its requests per
second as placed times the seconds each ended request held a seat. Not the busy seconds per second themselves: a
key whose requests queue holds no more seats than its replica gives it, so its busy seconds per second stop at
those seats however far its demand passes them, and the plan could not tell a key its replica cannot serve from
one it can. Placement sizes a heavy key's replica set by it against the requests a replica runs at once (its
seats: gateway/placement/plan.py).

Rates are linear in the counts, so the fleet's figure is the sum of every gateway's (``merge``): averaging each
gateway's counts and summing the averages is averaging the fleet's counts. Pure: no I/O, no clock but the one
given.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

K = TypeVar("K", bound=Hashable)

# A key below this many requests per second (about one an hour) is forgotten.
_FORGET = 1 / 3600


@dataclass(frozen=True)
class Rate:
    requests_per_s: float
    tokens_per_s: float
    # Requests the scheduler sent off the key's replica set for demand (over its home's bound, or predicted faster
    # elsewhere): what a replica set grows on (gateway/placement/plan.py).
    spills_per_s: float = 0.0
    # The key's requests in flight on average: the seconds its requests held an engine's seat per second (a
    # stream's from its first byte to its last, so that a wait in an engine's queue does not count as demand; a
    # whole answer's from its arrival).
    in_flight: float = 0.0

    def __add__(self, other: Rate) -> Rate:
        return Rate(
            self.requests_per_s + other.requests_per_s,
            self.tokens_per_s + other.tokens_per_s,
            self.spills_per_s + other.spills_per_s,
            self.in_flight + other.in_flight,
        )


ZERO = Rate(0.0, 0.0)


@dataclass(frozen=True)
class PoolTraffic:
    """One pool's traffic: its total (every key) and its busiest keys' rates."""

    total: Rate = ZERO
    keys: Mapping[str, Rate] = field(default_factory=dict)


# pool name -> its traffic
Traffic = Mapping[str, PoolTraffic]


class TrafficMeter:
    def __init__(
        self,
        window_s: float,
        max_keys: int,
        max_keys_per_interval: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window_s = window_s
        self.max_keys = max_keys
        self.max_keys_per_interval = max_keys_per_interval
        self._clock = clock
        self._folded_at = clock()
        self._first: float | None = None  # the first request's placing: what the window counts from
        # (pool, key) -> [requests placed, tokens, spills, busy seconds, requests ended] now
        self._counts: dict[tuple[str, str], list[float]] = {}
        self._totals: dict[str, list[float]] = {}  # pool -> [requests, tokens] this interval, every key
        # The average, the busiest max_keys (``in_flight`` there: the busy seconds per second; ``view`` makes it
        # the requests in flight, with the requests ended per second beside it).
        self._keys: dict[tuple[str, str], Rate] = {}
        self._ended: dict[tuple[str, str], float] = {}
        self._pool_totals: dict[str, Rate] = {}
        self.dropped_keys = 0  # newcomers past max_keys_per_interval, counted only in their pool's total

    def measured_s(self) -> float:
        """How long this meter has counted traffic, from its first request (0 before it): the average covers less
        than ``window_s`` of traffic before that. Counted from the gateway's start, a gateway idle for a window
        before its traffic came took the first seconds of a moving average for a whole window's."""
        return 0.0 if self._first is None else self._clock() - self._first

    def record(self, pool: str, key: str, tokens: float, spilled: bool = False, busy_s: float = 0.0) -> None:
        """One whole request (``placed`` and ``ended`` at once)."""
        self.placed(pool, key)
        self.ended(pool, key, tokens, spilled, busy_s)

    def placed(self, pool: str, key: str) -> None:
        """A request of ``key`` in ``pool`` placed now: counted as it arrives, not as it ends. Counted at its end, a
        request that waits in an engine's queue counts late, and under a queue the rate lags the demand exactly
        where the plan must act (collide: the heavy tenants read 1.4-4.1 of their 7.2 requests per second while
        they queued, docs/benchmarks.md). The request path: a dict lookup and two additions."""
        if self._first is None:
            self._first = self._clock()
        total = self._totals.get(pool)
        if total is None:
            total = self._totals[pool] = [0.0, 0.0]
        total[0] += 1
        counts = self._counts.get((pool, key))
        if counts is None:
            if len(self._counts) >= self.max_keys_per_interval:
                self.dropped_keys += 1
                return
            counts = self._counts[(pool, key)] = [0.0, 0.0, 0.0, 0.0, 0.0]
        counts[0] += 1

    def ended(self, pool: str, key: str, tokens: float, spilled: bool = False, busy_s: float = 0.0) -> None:
        """The request of ``key`` placed before ended: it used ``tokens`` (prompt and completion), was ``spilled``
        off the key's replica set for demand, and held ``busy_s`` seconds (what is known only at its end)."""
        total = self._totals.get(pool)
        if total is None:
            total = self._totals[pool] = [0.0, 0.0]
        total[1] += tokens
        counts = self._counts.get((pool, key))
        if counts is None:
            if len(self._counts) >= self.max_keys_per_interval:
                return  # a newcomer past the bound: counted in its pool's total only, as when it was placed
            counts = self._counts[(pool, key)] = [0.0, 0.0, 0.0, 0.0, 0.0]
        counts[1] += tokens
        counts[3] += busy_s
        counts[4] += 1
        if spilled:
            counts[2] += 1

    def fold(self) -> Traffic:
        """Mix the counts since the last fold into the average and start counting afresh; returns the average."""
        now = self._clock()
        elapsed = max(now - self._folded_at, 1e-9)
        self._folded_at = now
        weight = 1 - math.exp(-elapsed / self.window_s)
        counts, self._counts = self._counts, {}
        totals, self._totals = self._totals, {}
        self._keys = _mixed(self._keys, counts, elapsed, weight)
        if len(self._keys) > self.max_keys:
            self._keys = dict(busiest(self._keys.items(), self.max_keys))
        ended = self._ended
        self._ended = {
            item: old + weight * ((counts[item][4] if item in counts else 0.0) / elapsed - old)
            for item in self._keys
            if (old := ended.get(item, 0.0)) or item in counts
        }
        self._pool_totals = {
            pool: rate
            for pool, rate in _mixed(self._pool_totals, totals, elapsed, weight, forget=0.0).items()
            if rate.requests_per_s > 0 or rate.tokens_per_s > 0
        }
        return self.view()

    def view(self) -> Traffic:
        """The average as of the last fold, per pool."""
        keys: dict[str, dict[str, Rate]] = {}
        for item, rate in self._keys.items():
            ended = self._ended.get(item, 0.0)
            if ended > 0 and rate.in_flight:  # Little's law: placed per second x seat seconds per ended request
                rate = Rate(rate.requests_per_s, rate.tokens_per_s, rate.spills_per_s,
                            rate.requests_per_s * rate.in_flight / ended)  # fmt: skip
            keys.setdefault(item[0], {})[item[1]] = rate
        pools = set(keys) | set(self._pool_totals)
        return {pool: PoolTraffic(self._pool_totals.get(pool, ZERO), keys.get(pool, {})) for pool in pools}


def _mixed(
    average: Mapping[K, Rate], counts: Mapping[K, list[float]], elapsed: float, weight: float, forget: float = _FORGET
) -> dict[K, Rate]:
    """``average`` moved ``weight`` of the way towards the rates ``counts`` over ``elapsed`` seconds show."""
    mixed: dict[K, Rate] = {}
    for item in average.keys() | counts.keys():
        old = average.get(item, ZERO)
        requests, tokens, *more = counts.get(item, (0.0, 0.0))  # a pool's total counts no spills nor busy time
        spilled, busy = (more[0], more[1]) if more else (0.0, 0.0)
        rate = Rate(
            old.requests_per_s + weight * (requests / elapsed - old.requests_per_s),
            old.tokens_per_s + weight * (tokens / elapsed - old.tokens_per_s),
            old.spills_per_s + weight * (spilled / elapsed - old.spills_per_s),
            old.in_flight + weight * (busy / elapsed - old.in_flight),
        )
        if rate.requests_per_s >= forget:
            mixed[item] = rate
    return mixed


def busiest(rates: Iterable[tuple[K, Rate]], count: int) -> list[tuple[K, Rate]]:
    """The ``count`` busiest by requests per second, then tokens per second, busiest first (ties by key)."""
    return heapq.nsmallest(count, rates, key=lambda item: (-item[1].requests_per_s, -item[1].tokens_per_s, item[0]))


def merge(views: Iterable[Traffic], max_keys: int) -> Traffic:
    """The fleet's traffic from every gateway's: rates add up; the ``max_keys`` busiest keys are kept (over all
    pools, as each gateway keeps them)."""
    totals: dict[str, Rate] = {}
    keys: dict[tuple[str, str], Rate] = {}
    for view in views:
        for pool, traffic in view.items():
            totals[pool] = totals.get(pool, ZERO) + traffic.total
            for key, rate in traffic.keys.items():
                keys[(pool, key)] = keys.get((pool, key), ZERO) + rate
    per_pool: dict[str, dict[str, Rate]] = {pool: {} for pool in totals}
    for (pool, key), rate in busiest(keys.items(), max_keys):
        per_pool.setdefault(pool, {})[key] = rate
    return {pool: PoolTraffic(totals.get(pool, ZERO), per_pool[pool]) for pool in per_pool}
