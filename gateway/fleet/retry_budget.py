"""A retry budget (as in Finagle and Envoy): retries may be at most a ratio of recent requests, plus a small
floor, so that when a whole pool fails, retries cannot multiply the load on it."""

from __future__ import annotations

import time
from collections.abc import Callable


class RetryBudget:
    def __init__(
        self, ratio: float, min_per_s: float, window_s: int = 10, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ratio, self.min_per_s, self.window_s = ratio, min_per_s, window_s
        self._clock = clock
        # Per-second buckets over the window: [second, requests, retries]
        self._buckets: list[list[int]] = [[-1, 0, 0] for _ in range(window_s)]

    def _bucket(self) -> list[int]:
        second = int(self._clock())
        bucket = self._buckets[second % self.window_s]
        if bucket[0] != second:
            bucket[:] = [second, 0, 0]
        return bucket

    def request(self) -> None:
        self._bucket()[1] += 1

    def try_spend(self) -> bool:
        """Take one retry from the budget; False when the budget is spent."""
        now = int(self._clock())
        live = [b for b in self._buckets if now - b[0] < self.window_s]
        requests, retries = sum(b[1] for b in live), sum(b[2] for b in live)
        if retries >= max(self.ratio * requests, self.min_per_s * self.window_s):
            return False
        self._bucket()[2] += 1
        return True
