"""One replica of a pool as the pool keeps it: its endpoint, health, this gateway's requests in flight there and the
engine's own load signals as last scraped."""

from __future__ import annotations

import math
from dataclasses import dataclass

from backends.base import Endpoint, EngineLoad
from gateway.fleet.health import ReplicaHealth


@dataclass
class Replica:
    endpoint: Endpoint
    health: ReplicaHealth
    in_flight: int = 0
    # The engine's own load signals, as last scraped (None until the first scrape answers, or if the last failed).
    engine_load: EngineLoad | None = None
    # When that scrape answered (monotonic seconds) and this gateway's requests in flight there at that moment.
    scraped_at: float = -math.inf
    in_flight_at_scrape: int = 0

    def load_view(self, now: float, max_age_s: float | None) -> int:
        """The load routing counts here. With the engine's view (``max_age_s`` set): the replica's load as the
        engine last reported it (every gateway's requests) plus this gateway's change since, never below this
        gateway's own count. This gateway's own count without it, or when the scrape is stale or missing."""
        own = self.in_flight
        load = self.engine_load
        if max_age_s is None or load is None or now - self.scraped_at > max_age_s:
            return own
        return max(own, round(load.running + load.waiting) + own - self.in_flight_at_scrape)

    @property
    def healthy(self) -> bool:
        """Takes traffic now: up by its probes, not being re-warmed, not ejected."""
        return self.health.available()
