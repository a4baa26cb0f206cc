"""What happened in the last minutes, for the status page and `tenantgate status`: recent routing decisions,
and per adapter and minute the requests, their time to first token and the cold loads. Bounded in memory:
10 minutes, at most 256 TTFT samples per adapter and minute, the last 50 decisions."""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MINUTES = 10
_SAMPLES_PER_MINUTE = 256


@dataclass
class _Minute:
    at: int
    requests: int = 0
    cold_loads: int = 0
    ttft_ms: list[float] = field(default_factory=list)


class Activity:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        # The last decisions as (time, tenant, adapter, replica, reasons, status, ttft ms): read as dicts by
        # recent_decisions (the status page), stored as tuples because every request adds one.
        self._decisions: deque[tuple[float, str, str, str, list[str], int, float | None]] = deque(maxlen=50)
        self._adapters: dict[str, deque[_Minute]] = {}
        # Per adapter, its latest requests as (time, ok, ttft ms): what a rollout judges a new version by.
        self._outcomes: dict[str, deque[tuple[float, bool, float | None]]] = {}

    def _minute(self, adapter: str, now: float) -> _Minute:
        minute = int(now // 60)
        minutes = self._adapters.get(adapter)
        if minutes is None:
            minutes = self._adapters[adapter] = deque(maxlen=MINUTES)
        if not minutes or minutes[-1].at != minute:
            minutes.append(_Minute(minute))
        return minutes[-1]

    def request(
        self, tenant: str, adapter: str, replica: str, reasons: list[str], status: int, ttft_s: float | None
    ) -> None:
        """One request's record: every request calls it, so one clock read and no dict built."""
        now = self._clock()
        minute = self._minute(adapter, now)
        minute.requests += 1
        ttft_ms = None if ttft_s is None else 1000 * ttft_s
        outcomes = self._outcomes.get(adapter)
        if outcomes is None:
            outcomes = self._outcomes[adapter] = deque(maxlen=4096)
        outcomes.append((now, status < 500, ttft_ms))
        if ttft_ms is not None and len(minute.ttft_ms) < _SAMPLES_PER_MINUTE:
            minute.ttft_ms.append(ttft_ms)
        self._decisions.append((now, tenant, adapter, replica, reasons, status, ttft_ms))

    def recent_decisions(self) -> list[dict[str, Any]]:
        """The last 50 requests' decisions, newest first, as the status page shows them."""
        return [
            {"at": round(at, 3), "tenant": tenant, "adapter": adapter, "replica": replica, "reasons": reasons,
             "status": status, "ttft_ms": None if ttft_ms is None else round(ttft_ms, 1)}
            for at, tenant, adapter, replica, reasons, status, ttft_ms in reversed(self._decisions)
        ]  # fmt: skip

    def outcomes(self, adapter: str, since: float) -> list[tuple[float, bool, float | None]]:
        return [o for o in self._outcomes.get(adapter, ()) if o[0] >= since]

    def cold_load(self, adapter: str) -> None:
        self._minute(adapter, self._clock()).cold_loads += 1

    def adapters(self) -> dict[str, list[dict[str, Any]]]:
        """Per adapter, one entry per minute of the last ten that saw anything."""
        return summarize(self.samples())

    def samples(self) -> dict[str, list[dict[str, Any]]]:
        """Per adapter and minute of the last ten, the counts and the TTFT samples themselves: what ``summarize``
        reads, and what one worker of serve --workers merges with the others' (gateway/admin/merge.py)."""
        oldest = int(self._clock() // 60) - MINUTES
        return {
            adapter: [
                {"minute": m.at * 60, "requests": m.requests, "cold_loads": m.cold_loads, "ttft_ms": list(m.ttft_ms)}
                for m in minutes
                if m.at > oldest
            ]
            for adapter, minutes in sorted(self._adapters.items())
        }


def summarize(samples: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """``samples``' minutes with their TTFT samples read as p50 and p99."""
    return {
        adapter: [
            {
                "minute": m["minute"],
                "requests": m["requests"],
                "cold_loads": m["cold_loads"],
                "ttft_p50_ms": round(statistics.median(ttft), 1) if (ttft := m["ttft_ms"]) else None,
                "ttft_p99_ms": round(sorted(ttft)[int(0.99 * (len(ttft) - 1))], 1) if ttft else None,
            }
            for m in minutes
        ]
        for adapter, minutes in samples.items()
    }
