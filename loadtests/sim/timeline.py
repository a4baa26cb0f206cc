"""What each request waited for on the simulated engine, served as JSON at ``GET /sim/timeline`` (benchmarks only).

Two bounded logs, in the monotonic clock's seconds (``time.monotonic``: a client on the same host can line them up
with its own send times): the engine's stalls (an adapter read from disk, ``load``, or copied into a GPU slot,
``swap``: vLLM runs both between steps, so every request on the replica waits through them) and, per request at its
first token, when it arrived, when a step admitted it and which reasons it waited for (``batch``: a seat,
``lora_slot``: a GPU adapter slot, ``kv``: KV blocks). ``loadtests/bench_routing.py --tail`` splits the slowest
requests' time to first token by them: which regime makes the tail.
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any

# A 30 s benchmark trace at 24 requests/s puts about 180 requests on each of 4 replicas: room for minutes of it.
KEPT = 8192


def prompt_digest(prompt: str) -> str:
    """A short digest of a prompt: how a client finds its request in the timeline (its prompts are unique)."""
    return hashlib.blake2b(prompt.encode(), digest_size=8).hexdigest()


@dataclass(frozen=True)
class RequestSeen:
    adapter: str | None
    digest: str
    arrived: float
    admitted: float
    first_token: float
    waited_for: tuple[str, ...]


@dataclass
class Timeline:
    # (start, end, kind: load | swap, adapter), oldest first.
    stalls: deque[tuple[float, float, str, str]] = field(default_factory=lambda: deque(maxlen=KEPT))
    requests: deque[RequestSeen] = field(default_factory=lambda: deque(maxlen=KEPT))

    def stall(self, start: float, end: float, kind: str, adapter: str) -> None:
        self.stalls.append((round(start, 5), round(end, 5), kind, adapter))

    def as_json(self) -> dict[str, Any]:
        return {
            "stalls": [list(stall) for stall in self.stalls],
            "requests": [
                {"adapter": r.adapter, "digest": r.digest, "arrived": round(r.arrived, 5),
                 "admitted": round(r.admitted, 5), "first_token": round(r.first_token, 5),
                 "waited_for": list(r.waited_for)}
                for r in self.requests
            ],
        }  # fmt: skip
