"""`tenantgate serve --workers N`: real processes on 127.0.0.1, a real redis-server and a simulated replica. Two
workers serve one port; a killed worker is replaced while the other takes every connection; /metrics sums the
workers' counters; SIGTERM drains both; more than one worker without Redis is refused."""

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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import yaml
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from loadtests.fleet import ADMIN_TOKEN, api_key, gateway_config
from loadtests.processes import free_port, healthy
from tests.redis_server import RedisServer
from tests.servers import EngineProcess

BODY = {"model": "a1", "prompt": "x", "max_tokens": 1}
AUTH = {"Authorization": f"Bearer {api_key('acme')}"}


@dataclass
class Supervised:
    url: str
    process: subprocess.Popen[bytes]
    log: Path
    config_path: Path
    redis_url: str
    port: int

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.startswith("{")]

    def workers_seen(self) -> set[int]:
        return {o["worker"] for o in self.lines() if o["logger"] == "tenantgate.access"}

    def listening(self) -> int:
        return sum(o["message"].startswith("tenantgate listening") for o in self.lines())

    def worker_pids_if_any(self) -> bool:
        return Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").exists()

    def worker_pids(self) -> set[int]:
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split()
        return {int(pid) for pid in children}


def _config(sim: EngineProcess, redis_url: str | None, port: int, **options: Any) -> dict[str, Any]:
    extra: dict[str, Any] = {"shutdown": {"drain_delay_s": 0.5, "drain_timeout_s": 30}}
    if redis_url is not None:
        extra["state"] = {"redis_url": redis_url}
    replicas = options.pop("replicas", {"r0": sim.url})
    tenants = options.pop("tenants", {"acme": ["a1"]})
    adapters = {"a1": sim.adapters["a1"]}
    return gateway_config(replicas, tenants, adapters, port=port, extra=extra, **options)


@contextlib.contextmanager
def supervised(
    tmp_path: Path, sim: EngineProcess, workers: int = 2, *, sighup_at_start: bool = False, **options: Any
) -> Iterator[Supervised]:
    port = free_port()
    with RedisServer(log_path=tmp_path / "redis.log") as redis:
        path = tmp_path / "gateway.yaml"
        path.write_text(yaml.safe_dump(_config(sim, redis.url, port, **options)))
        log = tmp_path / "gateway.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--workers", str(workers)],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "TENANTGATE_ADMIN_TOKEN": ADMIN_TOKEN},
            )  # fmt: skip
        gateway = Supervised(f"http://127.0.0.1:{port}", process, log, path, redis.url, port)
        try:
            if sighup_at_start:  # as soon as both workers exist, before they serve
                while not (log.exists() and gateway.worker_pids_if_any() and len(gateway.worker_pids()) == workers):
                    time.sleep(0.001)
                process.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 60
            while not healthy(gateway.url, "/readyz") or gateway.listening() < workers:
                assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.1)
            yield gateway
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _one_request(url: str, tenant: str = "acme") -> int:
    """One completion on a new connection (the kernel picks which worker accepts it)."""
    auth = {"Authorization": f"Bearer {api_key(tenant)}"}
    with httpx.Client(base_url=url, headers=auth, timeout=30) as client:
        return client.post("/v1/completions", json=BODY).status_code


def _samples(url: str, name: str) -> list[Sample]:
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10).text
    return [
        sample for family in text_string_to_metric_families(text) for sample in family.samples if sample.name == name
    ]


def _until_gauges_of(gateway: Supervised, pids: set[int]) -> None:
    deadline = time.monotonic() + 10
    while {int(s.labels["pid"]) for s in _samples(gateway.url, "tenantgate_client_connections")} != pids:
        assert time.monotonic() < deadline, pids
        time.sleep(0.1)


def _requests_total(url: str) -> float:
    return sum(s.value for s in _samples(url, "tenantgate_requests_total") if s.labels.get("tenant") == "acme")


def test_more_than_one_worker_without_redis_is_refused(sim_engine: EngineProcess, tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(_config(sim_engine, None, free_port())))
    result = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--workers", "2"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "TENANTGATE_ADMIN_TOKEN": ADMIN_TOKEN},
    )  # fmt: skip
    assert result.returncode == 1
    [line] = [json.loads(text) for text in result.stderr.splitlines()]
    assert "state.redis_url" in line["message"], line


def test_two_workers_serve_one_port_and_a_killed_one_is_replaced(sim_engine: EngineProcess, tmp_path: Path) -> None:
    with supervised(tmp_path, sim_engine) as gateway:
        served = 0
        for _ in range(300):  # bounded: until each worker has accepted a connection
            assert _one_request(gateway.url) == 200
            served += 1
            if gateway.workers_seen() == {0, 1}:
                break
        assert gateway.workers_seen() == {0, 1}
        # /metrics, whichever worker answers, counts both workers' requests.
        assert _requests_total(gateway.url) == served

        # Gauges are per worker (a pid label): each worker's connection gauge is set by its sweep, once a second.
        _until_gauges_of(gateway, gateway.worker_pids())

        # One client sends requests one after another, each on a new connection, while a worker is killed.
        outcomes: list[int | str] = []
        stop = threading.Event()

        def client() -> None:
            while not stop.is_set():
                try:
                    outcomes.append(_one_request(gateway.url))
                except httpx.HTTPError as exc:
                    outcomes.append(type(exc).__name__)

        sender = threading.Thread(target=client)
        sender.start()
        try:
            before = gateway.worker_pids()
            killed = min(before)
            os.kill(killed, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while len(replaced := gateway.worker_pids() - {killed}) < 2:  # bounded: the supervisor restarts it
                assert time.monotonic() < deadline, gateway.log.read_text()[-3000:]
                time.sleep(0.05)
            assert replaced != before
            count = len(outcomes)
            while len(outcomes) < count + 20:  # bounded by the client's own timeouts
                time.sleep(0.05)
        finally:
            stop.set()
            sender.join(timeout=60)
        failed = [outcome for outcome in outcomes if outcome != 200]
        # Only a request in flight on the killed worker may fail: one client, one request at a time.
        assert len(failed) <= 1, failed
        assert any("exited" in o["message"] and o["level"] == "WARNING" for o in gateway.lines())
        # The killed worker's counts stay in the sum (counters never go back).
        total = _requests_total(gateway.url)
        ok = served + outcomes.count(200)
        assert ok <= total <= ok + len(failed)
        # Gauges are per worker, the living ones only: the killed worker's are gone.
        _until_gauges_of(gateway, gateway.worker_pids())  # the killed worker's are gone, its replacement's there


def test_sigterm_drains_every_worker(sim_engine: EngineProcess, tmp_path: Path) -> None:
    requests = 6
    with supervised(tmp_path, sim_engine) as gateway:
        pids = gateway.worker_pids()

        async def in_flight_then_sigterm() -> list[str]:
            async def one() -> str:
                client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key=api_key("acme"), max_retries=0)
                async with client:
                    answer = await client.completions.create(model="a1", prompt="x", max_tokens=2)
                    return answer.choices[0].finish_reason or ""

            async with httpx.AsyncClient() as http:
                # A paused engine queues every request: all are in flight, on both workers, when SIGTERM comes.
                await http.post(sim_engine.url + "/sim/control", json={"paused": True})
                try:
                    answers = asyncio.gather(*(one() for _ in range(requests)))
                    for _ in range(600):  # bounded: until every request waits in the engine
                        if (await http.get(sim_engine.url + "/sim/stats")).json()["waiting"] == requests:
                            break
                        await asyncio.sleep(0.02)
                    gateway.process.send_signal(signal.SIGTERM)
                    await asyncio.sleep(1)  # past the drain delay: the listeners are closed
                finally:
                    await http.post(sim_engine.url + "/sim/control", json={"paused": False})
                return await answers

        finish_reasons = asyncio.run(in_flight_then_sigterm())
        assert gateway.process.wait(timeout=60) == 0
        assert finish_reasons == ["length"] * requests  # every in-flight request finished whole
        for pid in pids:  # every worker has exited
            assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
        assert len([o for o in gateway.lines() if o["logger"] == "tenantgate.access"]) == requests


def test_workers_drain_and_leave_when_the_supervisor_is_killed(sim_engine: EngineProcess, tmp_path: Path) -> None:
    with supervised(tmp_path, sim_engine) as gateway:
        pids = gateway.worker_pids()
        os.kill(gateway.process.pid, signal.SIGKILL)  # no supervisor to restart or stop them: they are sent SIGTERM
        gateway.process.wait()
        deadline = time.monotonic() + 30
        while alive := {pid for pid in pids if Path(f"/proc/{pid}").exists()}:
            assert time.monotonic() < deadline, alive
            time.sleep(0.05)
        assert sum(o["message"] == "shut down" for o in gateway.lines()) == 2  # each drained, as on SIGTERM


def _until_both_workers_served(gateway: Supervised, send: Callable[[], int]) -> list[int]:
    statuses = []
    for _ in range(300):  # bounded: until each worker has accepted a connection
        statuses.append(send())
        if gateway.workers_seen() == {0, 1}:
            return statuses
    raise AssertionError("one worker took every connection")


def test_a_tenants_requests_through_both_workers_go_to_one_home(sim_engine: EngineProcess, tmp_path: Path) -> None:
    # Two replica names for the one simulated engine: the ring still has to choose a home between them.
    replicas = {"r0": sim_engine.url, "r1": sim_engine.url.replace("127.0.0.1", "localhost")}
    with supervised(tmp_path, sim_engine, replicas=replicas) as gateway:
        statuses = _until_both_workers_served(gateway, lambda: _one_request(gateway.url))
        assert set(statuses) == {200}
        access = [o for o in gateway.lines() if o["logger"] == "tenantgate.access"]
        assert {o["worker"] for o in access} == {0, 1}
        assert len({o["replica"] for o in access}) == 1, access


def test_a_rate_limit_holds_across_workers(sim_engine: EngineProcess, tmp_path: Path) -> None:
    per_minute = 10
    limits = {"acme": {"limits": {"requests_per_minute": per_minute}}}
    with supervised(tmp_path, sim_engine, tenant_options=limits) as gateway:
        started = time.monotonic()
        statuses = _until_both_workers_served(gateway, lambda: _one_request(gateway.url))
        statuses += [_one_request(gateway.url) for _ in range(3 * per_minute)]
        refilled = (time.monotonic() - started) / 60 * per_minute
    # One bucket in Redis for both: each worker's own would have let through twice the limit.
    assert statuses.count(200) <= per_minute + refilled + 1, statuses
    assert set(statuses) == {200, 429}


def test_sighup_to_the_supervisor_reloads_every_worker(sim_engine: EngineProcess, tmp_path: Path) -> None:
    with supervised(tmp_path, sim_engine) as gateway:
        assert _one_request(gateway.url, "newco") == 401  # a tenant the file does not name yet
        tenants = {"acme": ["a1"], "newco": ["a1"]}
        gateway.config_path.write_text(
            yaml.safe_dump(_config(sim_engine, gateway.redis_url, gateway.port, tenants=tenants))
        )
        gateway.process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while sum("reloaded" in o["message"] for o in gateway.lines()) < 2:  # bounded: both workers reload
            assert time.monotonic() < deadline, gateway.log.read_text()[-3000:]
            time.sleep(0.05)
        for _ in range(300):  # bounded: until each worker has served the new tenant
            assert _one_request(gateway.url, "newco") == 200  # whichever worker accepts it knows the tenant
            access = [o for o in gateway.lines() if o["logger"] == "tenantgate.access" and o["status"] == 200]
            if {o["worker"] for o in access if o["tenant"] == "newco"} == {0, 1}:
                break
        else:
            raise AssertionError("one worker took every connection")


def test_a_reload_while_workers_start_ends_none_of_them(sim_engine: EngineProcess, tmp_path: Path) -> None:
    with supervised(tmp_path, sim_engine, sighup_at_start=True) as gateway:
        assert _one_request(gateway.url) == 200
        assert not any("exited" in o["message"] for o in gateway.lines())  # SIGHUP's default would have ended them
