"""Faults under steady multi-tenant traffic through the openai SDK: a replica killed, a replica that hangs, Redis
killed, a config reload that adds and removes replicas, SIGTERM. Every request's outcome is counted
(loadtests/faultkit.py); "lost" (no answer, a hang past the deadline, a silently truncated stream) must stay 0."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from loadtests.faultkit import GatewayUnderTest, SimReplica, SteadyTraffic, reload_via_admin, sim_replicas
from loadtests.fleet import api_key, gateway_config, write_adapters
from loadtests.processes import free_port
from tests.redis_server import RedisServer

pytestmark = pytest.mark.timeout(240)

SIM = ["--time-scale", "0.1", "--max-loras", "4", "--max-cpu-loras", "8"]
TENANTS = {f"t{i}": [f"lora-t{i}"] for i in range(6)}
MODELS = {tenant: adapters[0] for tenant, adapters in TENANTS.items()}


def config_for(
    root: Path, replicas: dict[str, SimReplica], tenants: dict[str, list[str]] = TENANTS, **pool: Any
) -> dict[str, Any]:
    adapters = write_adapters(root, sorted({a for names in tenants.values() for a in names}))
    urls = {name: replica.url for name, replica in replicas.items()}
    config = gateway_config(urls, tenants, adapters, port=free_port(), max_adapters=8)
    config["pools"][0].update({"slow_start_s": 0, **pool})
    return config


@contextlib.contextmanager
def gateway(root: Path, config: dict[str, Any]) -> Iterator[GatewayUnderTest]:
    process = GatewayUnderTest(root, config)
    process.start()  # it returns the base class (loadtests/faultkit.py), so keep the subclass's name
    try:
        yield process
    finally:
        process.stop()


def takes_traffic(gw: GatewayUnderTest, replica: str) -> bool:
    healthy: bool = gw.admin("GET", "/admin/residency").json()["pools"]["llama"]["replicas"][replica]["healthy"]
    return healthy


def until(condition: Any, what: str, attempts: int = 600) -> None:
    """Poll ``condition`` a bounded number of times (the gateway's probes run every 0.5 s)."""
    for _ in range(attempts):
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"never happened: {what}")


def test_a_replica_killed_under_load(tmp_path: Path) -> None:
    with (
        sim_replicas(tmp_path, 3, *SIM) as replicas,
        gateway(tmp_path, config_for(tmp_path, replicas, outlier={"base_ejection_s": 1})) as gw,
    ):
        victim = gw.home_of("t0")
        moved = [t for t in TENANTS if gw.home_of(t) == victim]
        others = [replica for name, replica in replicas.items() if name != victim]

        def served_elsewhere() -> dict[str, int]:
            stats = [replica.stats()["requests_by_model"] for replica in others]
            return {t: sum(s.get(MODELS[t], 0) for s in stats) for t in moved}

        with SteadyTraffic(gw.url, MODELS, deadline_s=10) as traffic:
            traffic.wait_for(30)
            replicas[victim].kill()
            before = served_elsewhere()
            traffic.wait_for(60)
            after = served_elsewhere()
            assert all(after[t] > before[t] for t in moved)  # its tenants went on, on their next replicas
            replicas[victim].start()  # back, empty

            def home_again() -> bool:
                served = replicas[victim].stats()["requests_by_model"]
                return all(served.get(MODELS[t], 0) >= 3 for t in moved)

            until(home_again, "its tenants come back home")
        outcomes = traffic.outcomes
    assert outcomes.counts["lost"] == 0, outcomes.lost_details
    # Non-streaming requests never failed (retried on the next replica); only streams that had started may end
    # with an error event.
    assert set(outcomes.counts) <= {"ok", "error_event"}, outcomes.counts


def test_a_replica_that_hangs_times_out_at_the_deadline_and_is_ejected(tmp_path: Path) -> None:
    outlier = {"consecutive_failures": 2, "base_ejection_s": 60}
    with sim_replicas(tmp_path, 3, *SIM) as replicas:
        config = config_for(tmp_path, replicas, request_timeout_s=2.0, outlier=outlier)
        with gateway(tmp_path, config) as gw:
            victim = gw.home_of("t0")
            theirs = [t for t in TENANTS if gw.home_of(t) == victim]
            others = [t for t in TENANTS if t not in theirs]
            with SteadyTraffic(gw.url, MODELS, deadline_s=2.0) as traffic:
                traffic.wait_for(30)
                replicas[victim].faults(hang=True)
                until(lambda: not takes_traffic(gw, victim), "the hung replica is left out")
                traffic.wait_for(40)
                replicas[victim].faults(hang=False)
            outcomes = traffic.outcomes
    assert outcomes.counts["lost"] == 0, outcomes.lost_details
    assert all(set(outcomes.by_tenant[t]) == {"ok"} for t in others), outcomes.by_tenant  # others unaffected
    for tenant in theirs:
        assert set(outcomes.by_tenant[tenant]) <= {"ok", "http_504"}, outcomes.by_tenant[tenant]
    assert sum(outcomes.by_tenant[t]["http_504"] for t in theirs) >= 1  # the ones caught in the hang


def test_redis_killed_and_restarted_under_load(tmp_path: Path) -> None:
    redis = RedisServer(log_path=tmp_path / "redis.log").start()
    try:
        with sim_replicas(tmp_path, 2, *SIM) as replicas:
            config = config_for(tmp_path, replicas)
            config["state"] = {"redis_url": redis.url}
            config["residency"] = {"sync_interval_s": 0.2}
            with gateway(tmp_path, config) as gw, SteadyTraffic(gw.url, MODELS, deadline_s=10) as traffic:
                traffic.wait_for(30)
                redis.stop()
                traffic.wait_for(40)
                redis.start()
                until(lambda: httpx.get(gw.url + "/readyz").json()["residency_store"] == "up", "Redis is back")
                traffic.wait_for(30)
            outcomes = traffic.outcomes
    finally:
        redis.stop()
    assert set(outcomes.counts) == {"ok"}, (outcomes.counts, outcomes.lost_details)


def test_a_reload_that_adds_and_removes_replicas_under_load(tmp_path: Path) -> None:
    tenants = {f"t{i}": [f"lora-t{i}"] for i in range(12)}
    models = {tenant: adapters[0] for tenant, adapters in tenants.items()}
    with sim_replicas(tmp_path, 4, *SIM) as replicas:
        first = {name: replicas[name] for name in ("r0", "r1", "r2")}
        config = config_for(tmp_path, first, tenants)
        with gateway(tmp_path, config) as gw:
            before = {t: gw.home_of(t) for t in tenants}
            with SteadyTraffic(gw.url, models, deadline_s=10) as traffic:
                traffic.wait_for(40)
                second = config_for(tmp_path, {name: replicas[name] for name in ("r0", "r1", "r3")}, tenants)
                second["listen"] = config["listen"]
                gw.write_config(second)
                answer = reload_via_admin(gw)
                assert answer["warnings"] == []
                after = {t: gw.home_of(t) for t in tenants}
                traffic.wait_for(60)
            outcomes = traffic.outcomes
            r3_served = replicas["r3"].stats()["requests_by_model"]
    assert set(outcomes.counts) == {"ok"}, (outcomes.counts, outcomes.lost_details)
    moved = {t for t in tenants if before[t] != after[t]}
    # Only the tenants of the removed replica and those the new one takes move (consistent hashing).
    assert moved == {t for t in tenants if before[t] == "r2" or after[t] == "r3"}
    assert all(r3_served.get(models[t], 0) > 0 for t in tenants if after[t] == "r3")


def test_a_bad_config_is_refused_whole_and_the_old_one_keeps_serving(tmp_path: Path) -> None:
    with sim_replicas(tmp_path, 1, *SIM) as replicas:
        config = config_for(tmp_path, replicas)
        with gateway(tmp_path, config) as gw:
            broken = {**config, "pools": [{**config["pools"][0], "policy": "fastest"}]}
            gw.write_config(broken)
            answer = gw.admin("POST", "/admin/reload")
            assert answer.status_code == 400
            assert "pools.0.policy" in answer.json()["error"]["message"]
            gw.signal(signal.SIGHUP)  # the same through the signal: refused, logged
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key=api_key("t0"), max_retries=0)
            assert client.completions.create(model="lora-t0", prompt="still here", max_tokens=2).choices
            until(lambda: "reload refused" in gw.log_path.read_text(), "the SIGHUP reload is logged as refused")


def test_sigterm_lets_in_flight_requests_finish_and_exits_0(tmp_path: Path) -> None:
    slow = ["--time-scale", "1.0", "--max-loras", "4"]  # each request takes about a second
    with sim_replicas(tmp_path, 2, *slow) as replicas:
        config = config_for(tmp_path, replicas)
        config["shutdown"] = {"drain_delay_s": 2, "drain_timeout_s": 30}  # readiness is polled within the delay
        gw = GatewayUnderTest(tmp_path, config)
        gw.start()
        engines = list(replicas.values())
        try:

            async def in_flight_then_sigterm() -> tuple[list[str], int]:
                async def one(tenant: str, stream: bool) -> str:
                    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=api_key(tenant), max_retries=0)
                    async with client:
                        if not stream:
                            answer = await client.completions.create(model=MODELS[tenant], prompt="x", max_tokens=8)
                            return answer.choices[0].finish_reason or ""
                        chunks = await client.completions.create(
                            model=MODELS[tenant], prompt="x", max_tokens=8, stream=True
                        )
                        reasons = [c.choices[0].finish_reason async for c in chunks if c.choices]
                        return reasons[-1] or ""

                async with httpx.AsyncClient() as http:
                    # Paused engines queue every request: all of them are in flight when SIGTERM comes.
                    await asyncio.gather(*(http.post(r.url + "/sim/control", json={"paused": True}) for r in engines))
                    requests = asyncio.gather(*(one(t, i % 2 == 1) for i, t in enumerate(TENANTS)))
                    for _ in range(600):  # bounded: until every request waits in an engine
                        stats = [(await http.get(r.url + "/sim/stats")).json() for r in engines]
                        if sum(s["waiting"] for s in stats) == len(TENANTS):
                            break
                        await asyncio.sleep(0.02)
                    else:
                        raise AssertionError(f"the requests never all reached the engines: {stats}")
                    gw.signal(signal.SIGTERM)
                    for _ in range(600):  # bounded: the requests hold the gateway up while it drains
                        readiness = (await http.get(gw.url + "/readyz")).status_code
                        if readiness != 200:
                            break
                        await asyncio.sleep(0.02)
                    await asyncio.gather(*(http.post(r.url + "/sim/control", json={"paused": False}) for r in engines))
                return await requests, readiness

            finish_reasons, readiness = asyncio.run(in_flight_then_sigterm())
            exit_code = gw.wait(timeout_s=30)
        finally:
            gw.stop()
    assert readiness == 503  # not ready as soon as shutdown begins
    assert finish_reasons == ["length"] * len(TENANTS)  # every in-flight request finished whole
    assert exit_code == 0


def test_a_stream_cut_mid_way_ends_with_an_error_event_not_silence(tmp_path: Path) -> None:
    with sim_replicas(tmp_path, 1, *SIM) as replicas, gateway(tmp_path, config_for(tmp_path, replicas)) as gw:
        replicas["r0"].faults(cut_stream_after=2)
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=api_key("t0"), max_retries=0)
        received: list[str] = []
        with pytest.raises(openai.APIError) as caught:  # the SDK raises on the stream's error event
            for chunk in client.completions.create(model="lora-t0", prompt="x", max_tokens=8, stream=True):
                received += [c.text for c in chunk.choices]
        assert len(received) == 2 and "replica" in str(caught.value).lower()
        replicas["r0"].faults(cut_stream_after=None)
        assert client.completions.create(model="lora-t0", prompt="x", max_tokens=8).choices  # and it goes on


def test_a_redis_cluster_master_killed_under_load(tmp_path: Path) -> None:
    """Residency, rate limits and the registry on a three-master Redis Cluster; one master dies mid-run, its
    replica is promoted, and no request fails because of it."""
    from tests.redis_cluster import RedisCluster

    with RedisCluster(tmp_path / "cluster") as cluster, sim_replicas(tmp_path, 2, *SIM) as replicas:
        config = config_for(tmp_path, replicas)
        config["state"] = {"redis_url": cluster.url, "cluster": True}
        config["residency"] = {"sync_interval_s": 0.2}
        config["tenants"][0]["limits"] = {"requests_per_minute": 100_000}  # leases from the cluster
        with gateway(tmp_path, config) as gw, SteadyTraffic(gw.url, MODELS, deadline_s=10) as traffic:
            traffic.wait_for(30)
            victim = cluster.masters()[0]
            cluster.kill(victim)
            traffic.wait_for(30)
            cluster.wait_healthy()  # the replica took over
            traffic.wait_for(40)
            assert victim not in cluster.masters()
        outcomes = traffic.outcomes
    assert set(outcomes.counts) == {"ok"}, (outcomes.counts, outcomes.lost_details)
