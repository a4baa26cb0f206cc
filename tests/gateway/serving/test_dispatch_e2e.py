"""Claims about a request's life on the fleet, each checked in a running gateway (tenantgate serve) against simulated
replicas through the openai SDK, each test with its own fleet: a tenant's own request timeout, retries switched
off or out of budget, the per-replica cap, and session and adapter affinity on real requests. What happened is read
from the simulators' own counters, never from the gateway's view of itself."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from loadtests.faultkit import GatewayUnderTest, SimReplica, sim_replicas
from loadtests.fleet import api_key, gateway_config, write_adapters
from loadtests.processes import free_port

pytestmark = pytest.mark.timeout(120)

SIM = ["--time-scale", "0.01", "--max-loras", "4", "--max-cpu-loras", "8"]


def config_for(
    root: Path, replicas: dict[str, SimReplica], tenants: dict[str, list[str]], **pool: Any
) -> dict[str, Any]:
    adapters = write_adapters(root, sorted({a for names in tenants.values() for a in names}))
    urls = {name: replica.url for name, replica in replicas.items()}
    # bounded_consistent_hash: each request goes to its key's home unless a rule here moves it, so what the test
    # sees is the claim under test, not predicted_ttft's choice of a warmer replica.
    config = gateway_config(urls, tenants, adapters, port=free_port(), max_adapters=8, policy="bounded_consistent_hash")
    config["pools"][0].update({"slow_start_s": 0, **pool})
    return config


def client(gw: GatewayUnderTest, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=api_key(tenant), max_retries=0, timeout=30)


def until(condition: Callable[[], bool], what: str, attempts: int = 400) -> None:
    for _ in range(attempts):
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"never happened: {what}")


def served(replicas: dict[str, SimReplica], model: str) -> dict[str, int]:
    """How many requests for ``model`` each replica has run, by its own counters."""
    return {name: r.stats()["requests_by_model"].get(model, 0) for name, r in replicas.items()}


def test_a_tenants_own_request_timeout_answers_504_and_cancels_the_engine_request(tmp_path: Path) -> None:
    """t0's limits say 1 s, the pool 30 s. With the engine held, t0's request ends with a 504 after about a second
    and the engine's request is aborted (the gateway closed its connection); t0's deadlines eject nothing."""
    tenants = {"t0": ["lora-t0"]}
    with sim_replicas(tmp_path, 1, *SIM) as replicas:
        config = config_for(tmp_path, replicas, tenants, request_timeout_s=30, outlier={"consecutive_failures": 2})
        config["tenants"][0]["limits"] = {"request_timeout_s": 1.0}
        with GatewayUnderTest(tmp_path, config) as gw:
            assert client(gw, "t0").completions.create(model="lora-t0", prompt="x", max_tokens=2).choices
            replicas["r0"].pause(True)
            for _ in range(3):  # more than consecutive_failures
                began = time.monotonic()
                with pytest.raises(openai.APIStatusError) as caught:
                    client(gw, "t0").completions.create(model="lora-t0", prompt="x", max_tokens=2)
                took = time.monotonic() - began
                assert caught.value.status_code == 504, caught.value
                assert 0.9 <= took < 10, took  # the tenant's second, not the pool's 30
            until(lambda: replicas["r0"].stats()["waiting"] == 0, "the engine drops the abandoned requests")
            stats = replicas["r0"].stats()
            state = gw.admin("GET", "/admin/residency").json()["pools"]["llama"]["replicas"]["r0"]
            replicas["r0"].pause(False)
    assert stats["aborted"] == 3 and stats["running"] == 0, stats
    assert state["healthy"] and not state["ejected"], state


@pytest.mark.parametrize(
    ("retry", "answers"),
    [
        pytest.param({}, [200, 200, 200, 200], id="retried on the other replica (the default)"),
        pytest.param({"enabled": False}, [502, 502, 502, 502], id="retry.enabled false: never retried"),
        # A floor of 2 retries per 10 s window and no ratio: two retries, then the budget is spent.
        pytest.param({"budget_ratio": 0, "min_per_s": 0.2}, [200, 200, 502, 502], id="budget spent after two"),
    ],
)
def test_a_failure_is_retried_only_when_retries_are_on_and_within_budget(
    tmp_path: Path, retry: dict[str, Any], answers: list[int]
) -> None:
    """t0's home answers every inference with 503; the other replica is fine. What the client gets follows the pool's
    retry settings (an engine's error not retried is a 502 to the client), and the other replica runs exactly the
    retries."""
    tenants = {"t0": ["lora-t0"]}
    with sim_replicas(tmp_path, 2, *SIM) as replicas:
        pool = {"retry": retry, "outlier": {"consecutive_failures": 50}}  # nothing ejected: each request decides
        with GatewayUnderTest(tmp_path, config_for(tmp_path, replicas, tenants, **pool)) as gw:
            home = gw.home_of("t0")
            other = next(name for name in replicas if name != home)
            replicas[home].faults(error_status=503)
            before = served(replicas, "lora-t0")[other]
            statuses = []
            for _ in answers:
                try:
                    client(gw, "t0").completions.create(model="lora-t0", prompt="x", max_tokens=2)
                    statuses.append(200)
                except openai.APIStatusError as exc:
                    statuses.append(exc.status_code)
            retried = served(replicas, "lora-t0")[other] - before
    assert statuses == answers
    assert retried == answers.count(200)


def test_a_replica_at_max_in_flight_per_replica_takes_no_more(tmp_path: Path) -> None:
    """limits.max_in_flight_per_replica 2, one replica held: two requests wait in the engine, a third is refused at
    once with 503 overloaded (it never reaches the engine); the two finish when the engine runs again."""
    tenants = {"t0": ["lora-t0"]}
    with sim_replicas(tmp_path, 1, *SIM) as replicas:
        config = config_for(tmp_path, replicas, tenants)
        config["limits"] = {"max_in_flight_per_replica": 2}
        with GatewayUnderTest(tmp_path, config) as gw:
            assert client(gw, "t0").completions.create(model="lora-t0", prompt="x", max_tokens=2).choices
            replicas["r0"].pause(True)

            async def scenario() -> tuple[list[str], int, int]:
                async with openai.AsyncOpenAI(
                    base_url=gw.url + "/v1", api_key=api_key("t0"), max_retries=0, timeout=30
                ) as aclient:
                    held = [
                        asyncio.ensure_future(aclient.completions.create(model="lora-t0", prompt="x", max_tokens=2))
                        for _ in range(2)
                    ]
                    for _ in range(400):  # bounded: until both wait in the engine
                        if replicas["r0"].stats()["waiting"] == 2:
                            break
                        await asyncio.sleep(0.05)
                    try:
                        await aclient.completions.create(model="lora-t0", prompt="x", max_tokens=2)
                        refused, code = 200, ""
                    except openai.APIStatusError as exc:
                        refused, code = exc.status_code, str(exc.body)
                    waiting = replicas["r0"].stats()["waiting"]
                    replicas["r0"].pause(False)
                    finished = [str((await r).choices[0].finish_reason) for r in held]
                    assert "overloaded" in code, code
                    return finished, refused, waiting

            finished, refused, waiting = asyncio.run(scenario())
    assert (refused, waiting) == (503, 2)  # the third never reached the engine
    assert finished == ["length", "length"]


def test_session_affinity_keeps_each_session_on_one_replica_and_spreads_a_tenants_sessions(tmp_path: Path) -> None:
    """routing.affinity session: the ring key is the tenant and x-session-id, or the request's `user` without the
    header. Each of twelve sessions of one tenant runs on one replica, the sessions use more than one replica, and a
    request whose `user` is a session's id runs where that session does."""
    tenants = {"t0": ["lora-t0"]}
    with sim_replicas(tmp_path, 3, *SIM) as replicas:
        config = config_for(tmp_path, replicas, tenants)
        config["routing"]["affinity"] = "session"
        with GatewayUnderTest(tmp_path, config) as gw:
            openai_client = client(gw, "t0")

            def one(session: str, *, by_user: bool = False) -> str:
                """The replica that ran one request of the session, by the simulators' counters."""
                before = served(replicas, "lora-t0")
                if by_user:
                    openai_client.completions.create(model="lora-t0", prompt="x", max_tokens=2, user=session)
                else:
                    openai_client.completions.create(
                        model="lora-t0", prompt="x", max_tokens=2, extra_headers={"x-session-id": session}
                    )
                after = served(replicas, "lora-t0")
                (ran,) = [name for name in replicas if after[name] != before[name]]
                return ran

            sessions = [f"session-{i}" for i in range(12)]
            where = {s: {one(s) for _ in range(3)} for s in sessions}
            by_user = {s: one(s, by_user=True) for s in sessions[:4]}
    assert all(len(ran) == 1 for ran in where.values()), where
    assert len(set().union(*where.values())) >= 2, where  # tenant affinity would put them all on one
    assert all({by_user[s]} == where[s] for s in by_user), (by_user, where)


def test_adapter_affinity_sends_every_tenant_of_an_adapter_to_its_home(tmp_path: Path) -> None:
    """routing.affinity adapter: the ring key is the adapter, so six tenants sharing one adapter all run on one
    replica (under tenant affinity they would spread), and one engine holds it."""
    tenants = {f"t{i}": ["lora-shared"] for i in range(6)}
    with sim_replicas(tmp_path, 3, *SIM) as replicas:
        config = config_for(tmp_path, replicas, tenants)
        config["routing"]["affinity"] = "adapter"
        with GatewayUnderTest(tmp_path, config) as gw:
            before = served(replicas, "lora-shared")  # the gateway's own warm-ups at start-up left out
            for tenant in tenants:
                for _ in range(2):
                    client(gw, tenant).completions.create(model="lora-shared", prompt="x", max_tokens=2)
            counts = {name: count - before[name] for name, count in served(replicas, "lora-shared").items()}
            registered = {name: "lora-shared" in r.stats()["registered"] for name, r in replicas.items()}
    assert sorted(counts.values()) == [0, 0, 12], counts
    assert sum(registered.values()) == 1, registered


def test_an_engine_429_is_retried_elsewhere_then_a_503_with_the_gateways_retry_after_and_ejects_nothing(
    tmp_path: Path,
) -> None:
    """t0's home answers every inference 429 (an engine, or a limiting proxy before it): the request is taken by the
    other replica. With both answering 429 the client gets 503 upstream_busy with Retry-After 1 (it was a 400
    invalid_request with the engine's text: a valid request told it was wrong), and neither replica is ejected."""
    tenants = {"t0": ["lora-t0"]}
    with sim_replicas(tmp_path, 2, *SIM) as replicas:
        pool = {"outlier": {"consecutive_failures": 2}}
        with GatewayUnderTest(tmp_path, config_for(tmp_path, replicas, tenants, **pool)) as gw:
            home = gw.home_of("t0")
            other = next(name for name in replicas if name != home)
            replicas[home].faults(error_status=429)
            before = served(replicas, "lora-t0")[other]
            assert client(gw, "t0").completions.create(model="lora-t0", prompt="x", max_tokens=2).choices
            assert served(replicas, "lora-t0")[other] - before == 1
            replicas[other].faults(error_status=429)
            for _ in range(4):  # past consecutive_failures
                with pytest.raises(openai.APIStatusError) as caught:
                    client(gw, "t0").completions.create(model="lora-t0", prompt="x", max_tokens=2)
                assert caught.value.status_code == 503, caught.value
                assert caught.value.response.headers["Retry-After"] == "1"
                assert caught.value.body["code"] == "upstream_busy"  # type: ignore[index]
            state = gw.admin("GET", "/admin/residency").json()["pools"]["llama"]["replicas"]
    assert all(view["healthy"] and not view["ejected"] for view in state.values()), state
