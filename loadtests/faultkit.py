"""A fault-injection kit for tests and the soak: processes that can be killed and brought back on the same port,
simulated replicas whose faults can be switched on, and steady multi-tenant traffic that counts every outcome.

"Lost" is what must never happen: a request that got no response, one that hung past its deadline, or a stream
that ended without [DONE]-level completion and without an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx
import openai
import yaml

from loadtests.fleet import ADMIN_TOKEN, api_key
from loadtests.processes import free_port, healthy, sim_command, stop


class Restartable:
    """A server process on a fixed port: ``start`` waits until it answers its health path; ``kill`` is a crash."""

    def __init__(self, cmd: Sequence[str], url: str, log_path: Path, health_path: str, env: dict[str, str]) -> None:
        self.cmd, self.url, self.log_path, self.health_path, self.env = list(cmd), url, log_path, health_path, env
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Self:
        """``with process:``: started (as ``start``), stopped at the end whatever happened."""
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout_s: float = 30) -> Restartable:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env}, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while not healthy(self.url, self.health_path):
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                self.stop()
                raise RuntimeError(f"{self.cmd[0]} did not become healthy at {self.url}:\n{tail}")
            time.sleep(0.1)
        return self

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def signal(self, signum: int) -> None:
        assert self.process is not None
        os.killpg(self.process.pid, signum)

    def wait(self, timeout_s: float) -> int:
        assert self.process is not None
        return self.process.wait(timeout=timeout_s)

    def stop(self) -> None:
        if self.process is not None:
            stop(self.process)


class SimReplica(Restartable):
    def __init__(self, root: Path, name: str, sim_args: Sequence[str]) -> None:
        port = free_port()
        cmd = sim_command(port, "--model", "tiny-llama", *sim_args)
        super().__init__(cmd, f"http://127.0.0.1:{port}", root / f"sim-{name}.log", "/health", {})

    def faults(self, **settings: Any) -> None:
        """Switch faults on or off (loadtests/sim/faults.py): hang, delay_s, error_status, cut_stream_after,
        failing_adapters, failing_marker, reported_completion_tokens."""
        self._control({"faults": settings})

    def pause(self, paused: bool) -> None:
        """Hold the engine's step loop (True) or let it run: inference hangs, requests queue, /health and /metrics
        still answer (a wedged engine whose HTTP server lives on)."""
        self._control({"paused": paused})

    def _control(self, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        request = urllib.request.Request(self.url + "/sim/control", data, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10):
            pass

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + "/sim/stats", timeout=10) as response:
            stats: dict[str, Any] = json.load(response)
            return stats


class GatewayUnderTest(Restartable):
    """`tenantgate serve` on a config file that the test may rewrite (then SIGHUP or POST /admin/reload)."""

    def __init__(self, root: Path, config: dict[str, Any], name: str = "gateway") -> None:
        self.config_path = root / f"{name}.yaml"
        self.write_config(config)
        url = f"http://127.0.0.1:{config['listen']['port']}"
        cmd = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(self.config_path)]
        super().__init__(cmd, url, root / f"{name}.log", "/readyz", {"TENANTGATE_ADMIN_TOKEN": ADMIN_TOKEN})

    def write_config(self, config: dict[str, Any]) -> None:
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))

    def admin(self, method: str, path: str, json: Any = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        return httpx.request(method, self.url + path, headers=headers, json=json, timeout=60)

    def home_of(self, tenant: str) -> str:
        home: str = self.admin("GET", f"/admin/route?tenant={tenant}").json()["home"]
        return home


@contextlib.contextmanager
def sim_replicas(root: Path, count: int, *sim_args: str) -> Iterator[dict[str, SimReplica]]:
    replicas = {f"r{i}": SimReplica(root, f"r{i}", [*sim_args, "--seed", str(i)]) for i in range(count)}
    try:
        for replica in replicas.values():
            replica.start()
        yield replicas
    finally:
        for replica in replicas.values():
            replica.stop()


@dataclass
class Outcomes:
    """What steady traffic saw: ``ok``, ``error_event`` (a started stream ended with an OpenAI error event),
    ``http_<status>`` (an error response), and ``lost`` (never acceptable)."""

    counts: Counter[str] = field(default_factory=Counter)
    by_tenant: dict[str, Counter[str]] = field(default_factory=dict)
    lost_details: list[str] = field(default_factory=list)
    # (time.monotonic() when the outcome was known, tenant, outcome), in order: the soak places them in its faults.
    timeline: list[tuple[float, str, str]] = field(default_factory=list)

    def add(self, tenant: str, outcome: str, detail: str = "") -> None:
        self.timeline.append((time.monotonic(), tenant, outcome))
        self.counts[outcome] += 1
        self.by_tenant.setdefault(tenant, Counter())[outcome] += 1
        if outcome == "lost":
            self.lost_details.append(f"{tenant}: {detail}")

    @property
    def total(self) -> int:
        return sum(self.counts.values())


class SteadyTraffic:
    """Each tenant sends requests one after another (alternating streaming and not) through the openai SDK, on
    a background thread, until stopped; every request's outcome is counted."""

    def __init__(self, gateway_url: str, tenants: dict[str, str], *, deadline_s: float, max_tokens: int = 12) -> None:
        self.gateway_url, self.tenants, self.deadline_s, self.max_tokens = gateway_url, tenants, deadline_s, max_tokens
        self.outcomes = Outcomes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="steady traffic", daemon=True)

    def __enter__(self) -> SteadyTraffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=self.deadline_s + 30)

    def wait_for(self, completed: int, timeout_s: float = 60) -> None:
        """Block until ``completed`` more requests have an outcome (bounded)."""
        target, deadline = self.outcomes.total + completed, time.monotonic() + timeout_s
        while self.outcomes.total < target:
            if time.monotonic() > deadline:
                raise TimeoutError(f"traffic stalled at {self.outcomes.total} outcomes: {self.outcomes.counts}")
            time.sleep(0.02)

    async def _run(self) -> None:
        await asyncio.gather(*(self._tenant(tenant, model) for tenant, model in self.tenants.items()))

    async def _tenant(self, tenant: str, model: str) -> None:
        # The client's own timeout is the deadline plus a margin: an answer later than that counts as lost.
        client = openai.AsyncOpenAI(
            base_url=self.gateway_url + "/v1", api_key=api_key(tenant), max_retries=0, timeout=self.deadline_s + 5
        )
        async with client:
            index = 0
            while not self._stop.is_set():
                outcome, detail = await self._one(client, model, stream=index % 2 == 1, index=index)
                self.outcomes.add(tenant, outcome, detail)
                index += 1

    async def _one(self, client: openai.AsyncOpenAI, model: str, *, stream: bool, index: int) -> tuple[str, str]:
        prompt = f"request {index}"
        try:
            if not stream:
                answer = await client.completions.create(model=model, prompt=prompt, max_tokens=self.max_tokens)
                return ("ok", "") if answer.choices else ("lost", "no choices")
            chunks = await client.completions.create(
                model=model, prompt=prompt, max_tokens=self.max_tokens, stream=True
            )
            finished = False
            async for chunk in chunks:
                finished = finished or any(c.finish_reason for c in chunk.choices)
            return ("ok", "") if finished else ("lost", "stream ended without finishing or an error event")
        except openai.APIStatusError as exc:
            return f"http_{exc.status_code}", ""
        except openai.APIConnectionError as exc:  # no answer at all, or none within the deadline
            return "lost", repr(exc)
        except openai.APIError as exc:  # the SDK raises this for an error event inside a stream
            return ("error_event", "") if stream else ("lost", repr(exc))
        except Exception as exc:  # e.g. the connection dropped mid-stream without an error event
            return "lost", repr(exc)


def reload_via_admin(gateway: GatewayUnderTest) -> dict[str, Any]:
    answer = gateway.admin("POST", "/admin/reload")
    body: dict[str, Any] = answer.json()
    if answer.status_code != 200:
        raise RuntimeError(f"reload refused: {body}")
    return body
