"""Locust load test of the gateway's OpenAI endpoint: tenants as users, each with its own key and adapter.

Every simulated user is one tenant's application: it picks a tenant by Zipf popularity (a few hot tenants, a long
tail), keeps a session whose prompts share a prefix (so the engines' prefix caches matter), and alternates
streaming and non-streaming completions and chats. Tenants arrive over time (adapter churn): at first only the
popular half is active, the rest join as the run goes on. Requests are named "tenant/adapter kind", so locust's
tables and CSVs have a row per tenant and adapter.

Run it through `make loadtest` (which starts a simulated fleet and the gateway); the environment says where:
TENANTGATE_TENANTS (how many tenants, named t00, t01, ...; key key-tNN, adapter lora-tNN), LOADTEST_SHAPE
(steady or burst), LOADTEST_SECONDS.

Locust times each request in this process, so its cyclic garbage collector is held off from the test's start to
its stop (loadtests/collector.py, as the routing benchmarks' replays): a collection's pause would be read as the
gateway's latency by every request in flight. The run's garbage stays until it stops (LOADTEST_SECONDS bounds it).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
from typing import Any

from locust import FastHttpUser, LoadTestShape, between, events, task

from loadtests.collector import collector_held

TENANTS = [f"t{i:02d}" for i in range(int(os.environ.get("TENANTGATE_TENANTS", "12")))]
WEIGHTS = [1 / (rank + 1) ** 1.1 for rank in range(len(TENANTS))]
SECONDS = float(os.environ.get("LOADTEST_SECONDS", "60"))
STARTED = time.monotonic()
SESSION_TURNS = 20


def arrived_tenants() -> int:
    """Adapter churn: half the tenants at the start, all of them by half-time."""
    elapsed = time.monotonic() - STARTED
    share = 0.5 + min(0.5, elapsed / max(1.0, SECONDS))
    return max(1, int(len(TENANTS) * share))


class TenantApp(FastHttpUser):
    wait_time = between(0.05, 0.3)

    def on_start(self) -> None:
        self.new_session()

    def new_session(self) -> None:
        """A (possibly new) tenant's session: users move on every SESSION_TURNS requests, so tenants that arrived
        later get traffic too."""
        active = arrived_tenants()
        self.tenant = random.choices(TENANTS[:active], WEIGHTS[:active])[0]
        self.adapter = f"lora-{self.tenant}"
        self.headers = {"Authorization": f"Bearer key-{self.tenant}", "Content-Type": "application/json"}
        self.session = f"{self.tenant}-session-{random.randrange(1000)}"
        self.prefix = f"You are {self.tenant}'s assistant. Context for {self.session}: " + "policy text " * 20
        self.turn = getattr(self, "turn", 0)

    def _post(self, path: str, body: dict[str, Any], kind: str) -> None:
        self.turn += 1
        name = f"{self.tenant}/{self.adapter} {kind}"
        headers = {**self.headers, "x-session-id": self.session}
        with self.client.post(path, data=json.dumps(body), headers=headers, name=name, catch_response=True) as reply:
            if reply.status_code != 200:
                reply.failure(f"{reply.status_code}: {(reply.text or '')[:200]}")
            elif body.get("stream") and "[DONE]" not in (reply.text or ""):
                reply.failure("stream ended without [DONE]")
            else:
                reply.success()
        if self.turn % SESSION_TURNS == 0:  # after the request: its body named this session's adapter
            self.new_session()

    @task(3)
    def completion(self) -> None:
        stream = self.turn % 2 == 1
        body = {
            "model": self.adapter,
            "prompt": f"{self.prefix} question {self.turn}",
            "max_tokens": 16,
            "stream": stream,
        }
        self._post("/v1/completions", body, "completion stream" if stream else "completion")

    @task(1)
    def chat(self) -> None:
        messages = [{"role": "system", "content": self.prefix}, {"role": "user", "content": f"turn {self.turn}"}]
        self._post("/v1/chat/completions", {"model": self.adapter, "messages": messages, "max_tokens": 16}, "chat")


class Burst(LoadTestShape):
    """Steady, then a burst at a third of the run (twice the users), then steady again."""

    use_common_options = True

    def tick(self) -> tuple[int, float] | None:
        elapsed = time.monotonic() - STARTED
        if elapsed > SECONDS:
            return None
        options = self.runner.environment.parsed_options if self.runner else None
        users = int(options.num_users) if options is not None else 8
        burst = SECONDS / 3 <= elapsed < SECONDS / 2
        return (users * 2 if burst else users, users)


if os.environ.get("LOADTEST_SHAPE", "steady") != "burst":
    del Burst  # no shape class: locust runs -u users for -t seconds


def _fail_on_errors(environment: Any, **_: Any) -> None:
    """A run with failed requests exits non-zero, so `make loadtest` and CI notice."""
    if environment.stats.total.num_failures:
        environment.process_exit_code = 1


events.quitting.add_listener(_fail_on_errors)  # type: ignore[no-untyped-call]

# The collector held while the test runs: entered at its start, left at its stop (or when locust quits mid-run).
_held = contextlib.ExitStack()


def _hold_collector(**_: Any) -> None:
    _held.close()  # a second start without a stop (locust's web UI restarts a test): one hold at a time
    _held.enter_context(collector_held())


def _release_collector(**_: Any) -> None:
    _held.close()


events.test_start.add_listener(_hold_collector)  # type: ignore[no-untyped-call]
events.test_stop.add_listener(_release_collector)  # type: ignore[no-untyped-call]
events.quitting.add_listener(_release_collector)  # type: ignore[no-untyped-call]
