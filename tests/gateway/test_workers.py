"""`tenantgate serve --workers N`: real processes on 127.0.0.1, a real redis-server and a simulated replica. Two
workers serve one port; a killed worker is replaced while the other takes every connection, and only its own
requests in flight fail; /metrics sums the workers' counters; the admin API answers for both; the engine is scraped
and probed once per interval, not once per worker; SIGTERM drains both; more than one worker without Redis is
refused."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from backends.base import EngineLoad
from gateway import workers as supervisor_module
from gateway.admin.status_cli import render
from gateway.config import GatewayConfig
from gateway.fleet import host_scrape
from gateway.workers import Supervisor, WorkerSockets
from loadtests.fleet import ADMIN_TOKEN, BASE_MODEL, api_key, gateway_config
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

    def answered_since(self, since: datetime, pid: int) -> int:
        """Requests the worker with this pid answered after ``since``, until it exited (its access lines, told from
        its replacement's by coming before the supervisor's line about its exit)."""
        lines = self.lines()
        [started] = [i for i, o in enumerate(lines) if o["message"].endswith(f"(pid {pid})")]
        number = int(lines[started]["message"].split()[1])
        [exited] = [i for i, o in enumerate(lines) if o["message"].startswith(f"worker {number} (pid {pid}) exited")]
        return sum(
            o["logger"] == "tenantgate.access"
            and o.get("worker") == number
            and datetime.fromisoformat(o["time"]) > since
            for o in lines[started:exited]
        )

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
    routing = options.pop("routing", {})
    adapters = {"a1": sim.adapters["a1"]}
    config = gateway_config(replicas, tenants, adapters, port=port, extra=extra, **options)
    config["routing"].update(routing)
    return config


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
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "TENANTGATE_ADMIN_TOKEN": ADMIN_TOKEN},
            )
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
        # /metrics, whichever worker answers, counts both workers' requests up to now (each flushes when asked),
        # those answered within the last moment included (no worker's timer has flushed them yet).
        for _ in range(5):
            for _ in range(10):
                assert _one_request(gateway.url) == 200
                served += 1
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

        scraped = _requests_total(gateway.url)  # every worker flushed its counts for this scrape
        scraped_at = datetime.now(UTC)
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
        # The killed worker's counts up to its last flush stay in the sum: counters never go back, and what is
        # missing is at most what the killed worker answered after the scrape before the kill (it was killed
        # outright, without its exit's flush: gateway/observe/shared_metrics.py).
        total = _requests_total(gateway.url)
        ok = served + outcomes.count(200)
        assert scraped <= total <= ok + len(failed)
        assert ok - total <= gateway.answered_since(scraped_at, killed)
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


def _admin(gateway: Supervised, path: str) -> dict[str, Any]:
    answer = httpx.get(gateway.url + path, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10)
    assert answer.status_code == 200, answer.text
    document: dict[str, Any] = answer.json()
    return document


def _replica(state: dict[str, Any], replica: str = "r0") -> dict[str, Any]:
    found: list[dict[str, Any]] = [r for r in state["pools"]["llama"]["replicas"] if r["id"] == replica]
    assert len(found) == 1
    return found[0]


def _engine(sim: EngineProcess) -> dict[str, Any]:
    stats: dict[str, Any] = httpx.get(sim.url + "/sim/stats", timeout=10).json()
    return stats


def test_two_workers_scrape_the_engine_once_and_both_route_on_it(sim_engine: EngineProcess, tmp_path: Path) -> None:
    interval = 0.1
    routing = {"load_view": "engine", "load_scrape_interval_s": interval}
    with supervised(tmp_path, sim_engine, routing=routing) as gateway:
        first, started = _engine(sim_engine)["metrics_scrapes"], time.monotonic()
        while _engine(sim_engine)["metrics_scrapes"] < first + 20:  # bounded by the deadline
            assert time.monotonic() < started + 30
            time.sleep(0.05)
        # One scraper sleeps an interval between its scrapes: 20 take at least 19 intervals (with each worker
        # scraping for itself, they took 10).
        assert time.monotonic() - started >= 15 * interval
        state = _admin(gateway, "/admin/state")
        assert [w["scrapes_engines"] for w in state["workers"]].count(True) == 1, state["workers"]

        async def queued_at_the_engine(count: int) -> None:
            """``count`` requests sent straight to the paused engine (another gateway's): both workers' load views
            count them, through the one worker's scrapes."""
            async with httpx.AsyncClient(base_url=sim_engine.url, timeout=60) as http:
                await http.post("/sim/control", json={"paused": True})
                body = {"model": BASE_MODEL, "prompt": "x", "max_tokens": 1}
                sent = asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(count)))
                try:
                    for _ in range(600):  # bounded: until both workers' views show the engine's queue
                        views = {
                            w: v["load_view"] for w, v in _replica(_admin(gateway, "/admin/state"))["by_worker"].items()
                        }
                        if views == {"0": count, "1": count}:
                            break
                        await asyncio.sleep(0.05)
                    assert views == {"0": count, "1": count}
                finally:
                    await http.post("/sim/control", json={"paused": False})
                assert {answer.status_code for answer in await sent} == {200}

        asyncio.run(queued_at_the_engine(5))

        # The scraping worker killed: the other takes the host's lock over and scrapes (the replacement follows).
        [leader] = [w for w in _admin(gateway, "/admin/state")["workers"] if w["scrapes_engines"]]
        os.kill(leader["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while True:  # bounded by the deadline
            workers = _admin(gateway, "/admin/state")["workers"]
            leaders = [w["worker"] for w in workers if w["scrapes_engines"]]
            if len(workers) == 2 and leaders == [1 - leader["worker"]]:
                break
            assert time.monotonic() < deadline, workers
            time.sleep(0.05)
        scrapes = _engine(sim_engine)["metrics_scrapes"]
        while _engine(sim_engine)["metrics_scrapes"] < scrapes + 3:  # bounded by the deadline
            assert time.monotonic() < deadline
            time.sleep(0.05)


def _until_probed(sim: EngineProcess, more: int, deadline: float) -> float:
    """Until the engine has answered ``more`` health probes from now; when that was."""
    first = _engine(sim)["health_probes"]
    while _engine(sim)["health_probes"] < first + more:  # bounded by the deadline
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return time.monotonic()


def test_two_workers_probe_a_replica_once_per_interval_and_both_take_the_rounds(
    sim_engine: EngineProcess, tmp_path: Path
) -> None:
    interval, timeout = 0.1, 0.3
    with supervised(tmp_path, sim_engine) as gateway:
        config = yaml.safe_load(gateway.config_path.read_text())
        config["pools"][0]["health"] = {"interval_s": interval, "timeout_s": timeout}
        gateway.config_path.write_text(yaml.safe_dump(config))
        gateway.process.send_signal(signal.SIGHUP)  # the new interval: every worker's fleet is swapped
        deadline = time.monotonic() + 60
        _until_probed(sim_engine, 5, deadline)
        started = time.monotonic()
        # One prober sleeps an interval between its rounds: 20 probes take at least 19 intervals (with each worker
        # probing for itself, they took 10).
        assert _until_probed(sim_engine, 20, deadline) - started >= 15 * interval
        [leader] = [w for w in _admin(gateway, "/admin/state")["workers"] if w["scrapes_engines"]]

        def health() -> dict[str, bool]:
            by_worker = _replica(_admin(gateway, "/admin/state"))["by_worker"]
            return {worker: view["healthy"] for worker, view in by_worker.items()}

        def until_health(expected: dict[str, bool]) -> None:
            while (seen := health()) != expected:  # bounded by the deadline
                assert time.monotonic() < deadline, seen
                time.sleep(0.05)

        # The engine stops answering: the leader's probes fail, and both workers take it out.
        httpx.post(sim_engine.url + "/sim/control", json={"faults": {"hang": True}}, timeout=10)
        try:
            until_health({"0": False, "1": False})
        finally:
            httpx.post(sim_engine.url + "/sim/control", json={"faults": {"hang": False}}, timeout=10)
        until_health({"0": True, "1": True})

        # The leader stopped (alive, its lock held): the other worker probes for itself once its rounds stop coming.
        os.kill(leader["pid"], signal.SIGSTOP)
        try:
            _until_probed(sim_engine, 5, deadline)
        finally:
            os.kill(leader["pid"], signal.SIGCONT)

        # The leader killed: the other takes the host's lock over, and probes and shares (the replacement follows).
        os.kill(leader["pid"], signal.SIGKILL)
        while True:  # bounded by the deadline
            workers = _admin(gateway, "/admin/state")["workers"]
            if len(workers) == 2 and [w["worker"] for w in workers if w["scrapes_engines"]] == [1 - leader["worker"]]:
                break
            assert time.monotonic() < deadline, workers
            time.sleep(0.05)
        started = _until_probed(sim_engine, 1, deadline)
        assert _until_probed(sim_engine, 20, deadline) - started >= 15 * interval


def test_a_shared_probe_round_reads_back_as_probed() -> None:
    healthy = {"r0": True, "r1": False}
    assert host_scrape.decode_probes(host_scrape.encode_probes("p", 1, healthy, 12.5)) == ("p", 1, healthy)
    with pytest.raises(ValueError):
        host_scrape.decode_probes(host_scrape.encode("p", 12.5, 1, {}))


def test_a_killed_worker_fails_only_its_own_requests_and_admin_answers_for_both(
    sim_engine: EngineProcess, tmp_path: Path
) -> None:
    with supervised(tmp_path, sim_engine) as gateway:

        async def run() -> None:
            client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key=api_key("acme"), max_retries=0)
            async with client, httpx.AsyncClient(base_url=sim_engine.url) as http:

                async def one() -> str:
                    try:
                        answer = await client.completions.create(model="a1", prompt="x", max_tokens=2)
                        return answer.choices[0].finish_reason or ""
                    except openai.APIError as exc:
                        return type(exc).__name__

                await http.post("/sim/control", json={"paused": True})  # every request stays in flight
                try:
                    sent: list[asyncio.Task[str]] = []
                    for _ in range(20):  # bounded: batches until both workers hold requests
                        sent += [asyncio.create_task(one()) for _ in range(4)]
                        for _ in range(500):  # bounded: until every request waits in the engine
                            if (await http.get("/sim/stats")).json()["waiting"] == len(sent):
                                break
                            await asyncio.sleep(0.02)
                        state = _admin(gateway, "/admin/state")
                        by_worker = _replica(state)["by_worker"]
                        if all(view["in_flight"] for view in by_worker.values()):
                            break
                    # The admin API answers for both workers: their requests in flight, added up.
                    assert len(by_worker) == 2 and state["missing_workers"] == []
                    assert _replica(state)["in_flight"] == len(sent) == sum(v["in_flight"] for v in by_worker.values())
                    assert {w["worker"]: w["in_flight"] for w in state["workers"]} == {
                        int(worker): view["in_flight"] for worker, view in by_worker.items()
                    }
                    assert "; workers: 0, 1\n" in render(state)  # `tenantgate status` says so
                    adapters = _admin(gateway, "/admin/residency")["pools"]["llama"]["replicas"]["r0"]["adapters"]
                    assert adapters["a1"]["in_flight"] == len(sent)
                    # One worker killed with its requests in flight: only those fail (client retries off).
                    [killed] = [w for w in state["workers"] if w["worker"] == 0]
                    os.kill(killed["pid"], signal.SIGKILL)
                    for _ in range(500):  # bounded: until the supervisor has seen it die
                        if killed["pid"] not in gateway.worker_pids():
                            break
                        await asyncio.sleep(0.02)
                finally:
                    await http.post("/sim/control", json={"paused": False})
                outcomes = await asyncio.gather(*sent)
                assert outcomes.count("length") == len(sent) - killed["in_flight"], outcomes
                assert len([o for o in outcomes if o != "length"]) == killed["in_flight"], outcomes

        asyncio.run(run())


def test_a_shared_scrape_reads_back_as_scraped() -> None:
    loads = {
        "r0": EngineLoad(2, 3, 0.5, frozenset({"a", "b"}), gpu_slots=4, generated_tokens=12.0),
        "r1": None,
    }
    assert host_scrape.decode(host_scrape.encode("p", 12.5, 1, loads)) == ("p", 12.5, 1, loads)


def test_a_scrape_of_a_thousand_replicas_reaches_every_other_worker(tmp_path: Path) -> None:
    """A Unix datagram may not exceed its socket's send buffer (about 208 KiB by default), and every datagram not yet
    read counts against the sending socket's buffer. A pool's scrape as plain JSON (some 290 KB here) was refused
    whole (EMSGSIZE, logged once), so every other worker routed without the engines' figures; and one socket sending
    to several siblings ran out of room once the first few held a datagram each. Compressed, through a socket per
    sibling, it reaches all five here though none reads before the last is sent."""
    rnd = random.Random(1)
    loads: dict[str, EngineLoad | None] = {
        f"replica-{i:04d}": EngineLoad(
            rnd.randint(0, 64),
            rnd.randint(0, 20),
            rnd.random(),
            frozenset(f"tenant-{rnd.randint(0, 3000)}-support-adapter" for _ in range(rnd.randint(0, 8))),
            gpu_slots=8,
            generated_tokens=rnd.random() * 1e7,
        )
        for i in range(1000)
    }
    sockets = WorkerSockets(0, 6, -1, None, tmp_path)
    inboxes = []
    for sibling in sockets.siblings():
        inbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        inbox.bind(str(sockets.socket_path("scrapes", sibling)))
        inbox.setblocking(False)
        inboxes.append(inbox)
    scrapes = host_scrape.HostScrapes(sockets)
    scrapes._outboxes = {}  # as start() leaves it, without its inbox and its wait for the lock
    try:
        scrapes.publish("llama", 12.5, loads)
        for inbox in inboxes:
            assert host_scrape.decode(inbox.recv(1 << 20)) == ("llama", 12.5, 0, loads)
    finally:
        scrapes.close()
        for inbox in inboxes:
            inbox.close()


def test_a_concurrency_limit_holds_per_worker(sim_engine: EngineProcess, tmp_path: Path) -> None:
    """max_concurrent is counted by each worker (as by each gateway): with two workers a tenant may have twice as
    many requests in flight, never more than the limit on one worker."""
    limits = {"acme": {"limits": {"max_concurrent": 1}}}
    with supervised(tmp_path, sim_engine, tenant_options=limits) as gateway:

        async def run() -> list[int]:
            async def one() -> int:  # its own connection: the kernel picks the worker that accepts it
                async with httpx.AsyncClient(base_url=gateway.url, headers=AUTH, timeout=60) as client:
                    return (await client.post("/v1/completions", json=BODY)).status_code

            async with httpx.AsyncClient(base_url=sim_engine.url) as http:
                await http.post("/sim/control", json={"paused": True})
                sent: list[asyncio.Task[int]] = []
                try:
                    for _ in range(40):  # bounded: one request at a time until each worker holds one
                        sent.append(asyncio.create_task(one()))
                        for _ in range(500):  # bounded: until it waits in the engine or was refused
                            waiting = (await http.get("/sim/stats")).json()["waiting"]
                            if sent[-1].done() or waiting == len([t for t in sent if not t.done()]):
                                break
                            await asyncio.sleep(0.02)
                        by_worker = _replica(_admin(gateway, "/admin/state"))["by_worker"]
                        assert all(view["in_flight"] <= 1 for view in by_worker.values()), by_worker
                        if all(view["in_flight"] == 1 for view in by_worker.values()):
                            break
                    assert {worker: view["in_flight"] for worker, view in by_worker.items()} == {"0": 1, "1": 1}
                    assert all(task.result() == 429 for task in sent if task.done())
                finally:
                    await http.post("/sim/control", json={"paused": False})
                return list(await asyncio.gather(*sent))

        statuses = asyncio.run(run())
        assert statuses.count(200) == 2 and set(statuses) <= {200, 429}, statuses


def test_a_dead_worker_is_restarted_after_half_a_second_doubling_to_30_s_while_it_crash_loops(tmp_path: Path) -> None:
    """docs/operations.md, Every core: a worker that exits is restarted after 0.5 s, doubling up to 30 s while
    workers die within 10 s of starting; one that ran longer starts the backoff again at 0.5 s."""
    config = GatewayConfig.model_validate(
        gateway_config({"r0": "http://127.0.0.1:9"}, {"acme": ["a1"]}, {"a1": "/srv/loras/a1"}, port=0)
    )
    supervisor = Supervisor(config, tmp_path / "gateway.yaml", 1)
    [worker] = supervisor.workers
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    process.wait(timeout=60)

    def dies(after_s: float) -> float:
        worker.started = 1000.0
        supervisor._died(worker, process, 1000.0 + after_s, tmp_path)
        assert worker.restart_at is not None
        return worker.restart_at - (1000.0 + after_s)

    assert [dies(after_s=1.0) for _ in range(9)] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert dies(after_s=11.0) == 0.5  # it had served for longer than the crash-loop window
    assert dies(after_s=1.0) == 0.5


def test_the_supervisor_sleeps_until_a_signal_or_a_restart_is_due(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The supervisor does not poll: its wait ends when a signal comes (a worker's death is SIGCHLD) or when the
    next restart is due, whichever is first."""
    config = GatewayConfig.model_validate(
        gateway_config({"r0": "http://127.0.0.1:9"}, {"acme": ["a1"]}, {"a1": "/srv/loras/a1"}, port=0)
    )
    supervisor = Supervisor(config, tmp_path / "gateway.yaml", 1)
    [worker] = supervisor.workers
    monkeypatch.setattr(supervisor_module, "IDLE_WAIT_S", 600.0)  # only the signal can end the second wait early
    previous = signal.getsignal(signal.SIGCHLD)
    try:
        supervisor._wake_on_signals()
        now = time.monotonic()
        worker.restart_at = now + 0.2  # nothing else comes: the wait ends when the restart is due
        supervisor._wait(now)
        assert time.monotonic() >= now + 0.2
        worker.restart_at = time.monotonic() + 600  # a child exits meanwhile: the wait ends with its SIGCHLD
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        started = time.monotonic()
        supervisor._wait(started)
        assert time.monotonic() - started < 300
        child.wait(timeout=60)
    finally:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, previous)
        os.close(supervisor._wake_read)
        os.close(supervisor._wake_write)
