"""Faults under steady multi-tenant traffic through the openai SDK: a replica killed, a replica that hangs, Redis
killed, a config reload that adds and removes replicas, SIGTERM. Every request's outcome is counted
(loadtests/faultkit.py); "lost" (no answer, a hang past the deadline, a silently truncated stream) must stay 0."""

from __future__ import annotations

import asyncio
import contextlib
import math
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


def until(condition: Any, what: str, within_s: float = 120) -> None:
    """Poll ``condition`` every 50 ms until it holds. Bounded by a deadline, not a count of polls: each poll is an
    admin request, slow on a starved machine, so a count ran out (or ran past pytest's timeout) on the machine's
    speed; the deadline is generous, for a condition that never comes, not a speed bound."""
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened within {within_s} s: {what}")
        time.sleep(0.05)


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


def replica_state(gw: GatewayUnderTest, replica: str) -> dict[str, Any]:
    """Health's view of ``replica`` (/admin/residency): up by its probes, ejected, why, how often, for how long yet,
    its slow-start weight."""
    state: dict[str, Any] = gw.admin("GET", "/admin/residency").json()["pools"]["llama"]["replicas"][replica]
    return state


def hang_config(root: Path, replicas: dict[str, SimReplica], **outlier: Any) -> dict[str, Any]:
    """A 2 s pool timeout, two failures in a row eject, the engines' metrics scraped every 0.25 s and a stall after
    1 s without a token: a hung engine is told from a slow one by its own metrics (gateway/fleet/outlier.py)."""
    rule = {"consecutive_failures": 2, "stall_after_s": 1.0, **outlier}
    config = config_for(root, replicas, request_timeout_s=2.0, outlier=rule)
    config["telemetry"] = {"engine_scrape_interval_s": 0.25}
    return config


def test_a_replica_whose_inference_hangs_is_ejected_as_stalled_while_its_probes_pass(tmp_path: Path) -> None:
    """The engine's step loop is held: requests queue and time out, /health and /metrics still answer. Probes
    cannot see it; outlier detection ejects it on the engine's own metrics (reason "stalled"), and only the
    tenants whose requests were caught in the hang see a timeout."""
    with (
        sim_replicas(tmp_path, 3, *SIM) as replicas,
        gateway(tmp_path, hang_config(tmp_path, replicas, base_ejection_s=60)) as gw,
    ):
        victim = gw.home_of("t0")
        theirs = [t for t in TENANTS if gw.home_of(t) == victim]
        others = [t for t in TENANTS if t not in theirs]
        with SteadyTraffic(gw.url, MODELS, deadline_s=2.0) as traffic:
            traffic.wait_for(30)
            replicas[victim].pause(True)
            until(lambda: not takes_traffic(gw, victim), "the hung replica is left out")
            state = replica_state(gw, victim)
            traffic.wait_for(40)
            replicas[victim].pause(False)
        outcomes = traffic.outcomes
    assert (state["up"], state["ejected"], state["ejection_reason"]) == (True, True, "stalled"), state
    assert outcomes.counts["lost"] == 0, outcomes.lost_details
    assert all(set(outcomes.by_tenant[t]) == {"ok"} for t in others), outcomes.by_tenant  # others unaffected
    for tenant in theirs:  # a stream that had started ends with an error event
        assert set(outcomes.by_tenant[tenant]) <= {"ok", "http_504", "error_event"}, outcomes.by_tenant[tenant]
    assert sum(outcomes.by_tenant[t]["http_504"] + outcomes.by_tenant[t]["error_event"] for t in theirs) >= 1


def test_ejections_never_take_more_than_max_ejected_percent_of_the_pool(tmp_path: Path) -> None:
    """Two of three replicas hang; a cap of 34% allows one ejection. The other hung replica keeps failing
    requests (its tenants' timeouts go on) and stays in the pool."""
    with sim_replicas(tmp_path, 3, *SIM) as replicas:
        config = hang_config(tmp_path, replicas, base_ejection_s=60, max_ejected_percent=34)
        with gateway(tmp_path, config) as gw:
            hung = sorted({gw.home_of("t0"), next(gw.home_of(t) for t in TENANTS if gw.home_of(t) != gw.home_of("t0"))})
            with SteadyTraffic(gw.url, MODELS, deadline_s=2.0) as traffic:
                traffic.wait_for(30)
                for name in hung:
                    replicas[name].pause(True)
                until(lambda: any(replica_state(gw, name)["ejected"] for name in hung), "one hung replica is ejected")

                def timeouts() -> int:
                    return traffic.outcomes.counts["http_504"] + traffic.outcomes.counts["error_event"]

                # The hung replica left in keeps failing its tenants' requests (each a counted, stalled failure):
                # only the cap keeps it in.
                then = timeouts()
                until(lambda: timeouts() >= then + 4, "more timeouts on the hung replica left in")
                states = {name: replica_state(gw, name) for name in hung}
                for name in hung:
                    replicas[name].pause(False)
    assert sorted(s["ejected"] for s in states.values()) == [False, True], states
    assert traffic.outcomes.counts["lost"] == 0, traffic.outcomes.lost_details


def test_the_ejection_doubles_each_time_a_replica_is_ejected_again(tmp_path: Path) -> None:
    """A replica that stays hung is ejected for 1 s, then 2 s, then 4 s: each time it comes back it fails again.
    Polled every 50 ms: each ejection's length as health set it, and its time left when first seen (not over it; how
    soon a poll sees it is the machine's, so no lower bound)."""
    with (
        sim_replicas(tmp_path, 2, *SIM) as replicas,
        gateway(tmp_path, hang_config(tmp_path, replicas, base_ejection_s=1, max_ejection_s=30)) as gw,
    ):
        victim = gw.home_of("t0")
        first_seen: dict[int, tuple[float, float]] = {}  # ejection -> (its length, its time left when first seen)
        with SteadyTraffic(gw.url, MODELS, deadline_s=2.0) as traffic:
            traffic.wait_for(20)
            replicas[victim].pause(True)

            def third_ejection_seen() -> bool:
                state = replica_state(gw, victim)
                assert state["up"] and state["ejection_reason"] in (None, "stalled"), state
                if state["ejected"]:
                    first_seen.setdefault(state["ejections"], (state["last_ejection_s"], state["ejected_for_s"]))
                return 3 in first_seen

            until(third_ejection_seen, "a third ejection")
            replicas[victim].pause(False)
        outcomes = traffic.outcomes
    for count, length in ((1, 1.0), (2, 2.0), (3, 4.0)):
        set_for, left = first_seen[count]
        assert set_for == length and 0 < left <= length, first_seen
    assert outcomes.counts["lost"] == 0, outcomes.lost_details


@pytest.mark.timeout(600)  # a hang guard: slow start alone is 30 s here, and a starved machine is slow at all of it
def test_a_replica_back_from_ejection_takes_a_growing_share_over_slow_start(tmp_path: Path) -> None:
    """slow_start_s 30: a replica back from an ejection may hold a share of the bound (8, the capacity floor here)
    that grows from 0.1, so a burst of six concurrent requests of a tenant homed there mostly spills to the other
    replica at first, and stays home once slow start is over.

    Nothing here bounds the machine's speed: the share is read after the early burst (it only grows, so it bounds
    what the burst met), and slow start is long enough (share under 0.625, the most that lets the burst spill, for
    18 s after the return) that a starved machine still sends the burst within it. The pool's timeout (5 s) and the
    stall rule (3 s) are wide for the same reason: at 2 s and 1 s, a starved burst could time out, or re-eject the
    replica it measures."""
    slow = ["--time-scale", "1.0", "--max-loras", "4", "--max-cpu-loras", "8"]  # a request takes ~0.3 s: they overlap
    with sim_replicas(tmp_path, 2, *slow) as replicas:
        config = hang_config(tmp_path, replicas, base_ejection_s=1, stall_after_s=3.0)
        config["pools"][0].update({"slow_start_s": 30, "request_timeout_s": 5.0})
        # The bound's share is what slow start scales; predicted_ttft (the default) may also send part of a burst
        # to the other replica once the adapter is warm there, which this test does not measure.
        config["pools"][0]["policy"] = "bounded_consistent_hash"
        with gateway(tmp_path, config) as gw:
            victim = gw.home_of("t0")
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key=api_key("t0"), max_retries=0, timeout=30)

            def burst() -> int:
                """Six requests of t0 at once; how many its home served."""
                before = replicas[victim].stats()["requests_by_model"].get(MODELS["t0"], 0)

                async def six() -> None:
                    async_client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=api_key("t0"), max_retries=0)
                    async with async_client:
                        await asyncio.gather(
                            *(
                                async_client.completions.create(model=MODELS["t0"], prompt="x", max_tokens=24)
                                for _ in range(6)
                            )
                        )

                asyncio.run(six())
                served: int = replicas[victim].stats()["requests_by_model"].get(MODELS["t0"], 0) - before
                return served

            replicas[victim].pause(True)
            for _ in range(3):  # timeouts while it is stalled: the second ejects it
                with contextlib.suppress(openai.APIStatusError):
                    client.completions.create(model=MODELS["t0"], prompt="x", max_tokens=4)
            until(lambda: replica_state(gw, victim)["ejected"], "the hung replica is ejected")
            replicas[victim].pause(False)
            until(lambda: not replica_state(gw, victim)["ejected"], "the ejection ends")
            early = burst()
            weight = replica_state(gw, victim)["weight"]
            until(lambda: replica_state(gw, victim)["weight"] == 1.0, "slow start ends")
            late = burst()
    assert early <= math.ceil(8 * weight) < 6, (early, weight)  # the bound (floor 8) times its share, at most
    assert late == 6


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
                    # Until every request waits in an engine: a generous deadline, not a count of polls (each poll
                    # is slow on a starved machine).
                    deadline = time.monotonic() + 120
                    while time.monotonic() < deadline:
                        stats = [(await http.get(r.url + "/sim/stats")).json() for r in engines]
                        if sum(s["waiting"] for s in stats) == len(TENANTS):
                            break
                        await asyncio.sleep(0.02)
                    else:
                        raise AssertionError(f"the requests never all reached the engines: {stats}")
                    gw.signal(signal.SIGTERM)
                    deadline = time.monotonic() + 120  # the requests hold the gateway up while it drains
                    while time.monotonic() < deadline:
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


def store_state(gw: GatewayUnderTest) -> tuple[str, float]:
    """The gateway's view of its residency store: /readyz's detail and the tenantgate_residency_store_up gauge."""
    readyz: str = httpx.get(gw.url + "/readyz").json()["residency_store"]
    exposition = gw.admin("GET", "/metrics").text
    gauge = next(line for line in exposition.splitlines() if line.startswith("tenantgate_residency_store_up "))
    return readyz, float(gauge.split()[1])


def test_a_redis_cluster_master_killed_under_load(tmp_path: Path) -> None:
    """Residency, rate limits and the registry on a three-master Redis Cluster. The master killed is the one that
    holds keys the traffic uses, by CLUSTER KEYSLOT: a replica's residency record (read every sync) and the rate
    bucket of a tenant whose limit (10 a minute, so a lease of one token) makes every request lease from it. The
    gateway's store goes down and comes back up once the master's replica is promoted (/readyz and the gauge), the
    tenant leases from the promoted node again, and no request fails meanwhile."""
    from tests.redis_cluster import RedisCluster

    with RedisCluster(tmp_path / "cluster") as cluster, sim_replicas(tmp_path, 2, *SIM) as replicas:
        # The key layouts of gateway/residency/redis.py and gateway/tenants/rate_buckets.py (prefix "tg").
        victim = cluster.wait_master(cluster.keyslot("tg:{llama:r0}:resident"))
        limited = next(
            t
            for t in (f"limited-{i}" for i in range(100))
            if cluster.master_of(cluster.keyslot(f"tg:rl:{{{t}:requests}}")) == victim
        )
        bucket = f"tg:rl:{{{limited}:requests}}:10"  # its limit, 10 a minute
        slot = cluster.keyslot(bucket)
        config = config_for(tmp_path, replicas, {**TENANTS, limited: ["lora-t0"]})
        config["state"] = {"redis_url": cluster.url, "cluster": True}
        config["residency"] = {"sync_interval_s": 0.2}
        config["tenants"][-1]["limits"] = {"requests_per_minute": 10}
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{config['listen']['port']}/v1", api_key=api_key(limited), max_retries=0
        )

        def limited_request() -> None:  # raises on any status but 200
            assert client.completions.create(model="lora-t0", prompt="x", max_tokens=2).choices

        with gateway(tmp_path, config) as gw, SteadyTraffic(gw.url, MODELS, deadline_s=10) as traffic:
            traffic.wait_for(30)
            limited_request()
            assert store_state(gw) == ("up", 1.0)
            assert cluster.info(victim, "hexists", bucket, "at").strip() == "1"  # the bucket is on the victim
            cluster.kill(victim)
            seen: set[tuple[str, float]] = set()

            def down_seen() -> bool:
                seen.add(store_state(gw))
                return ("down (routing from the local view)", 0.0) in seen

            until(down_seen, "the gateway sees its store down")
            limited_request()  # the bucket unreachable: the local fallback admits it
            promoted = cluster.wait_master(slot)  # the victim's replica took over
            until(lambda: store_state(gw) == ("up", 1.0), "the gateway sees its store up again")
            recovered = time.time()
            traffic.wait_for(30)

            # One request a second (the fallback lasts 5 s from the last failure) until the bucket's last lease, by
            # Redis' clock on this machine, is later than the store's return: at most nine, so that with the one
            # above the local bucket (10) never runs dry, and a fallback that never ended fails here, not with a 429.
            for _ in range(9):
                limited_request()
                at = cluster.info(promoted, "hget", bucket, "at").strip()
                if at and float(at) > recovered:
                    break
                time.sleep(1)
            else:
                raise AssertionError(f"{limited} never leased from the promoted node: {at!r}")
        outcomes = traffic.outcomes
    assert set(outcomes.counts) == {"ok"}, (outcomes.counts, outcomes.lost_details)
