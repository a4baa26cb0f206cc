"""Faults a tenant causes must not eject replicas; a broken replica is still ejected, even when it serves one tenant
(gateway/fleet/outlier.py's rule); a noisy tenant degrades no other. Against simulated replicas, through the openai
SDK and a gateway process. The noisy tenant's trouble lasts TENANTGATE_NOISY_TENANT_S seconds (60 by default)."""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from loadtests.faultkit import GatewayUnderTest, SimReplica, SteadyTraffic, sim_replicas
from loadtests.fleet import BASE_MODEL, api_key, gateway_config, simulated_triton_replicas, triton_pool, write_adapters
from loadtests.peft_files import write_peft_adapter
from loadtests.processes import free_port

pytestmark = pytest.mark.timeout(180)

SIM = ["--time-scale", "0.1", "--max-loras", "4", "--max-cpu-loras", "8"]
TENANTS = {"noisy": ["lora-noisy"], "quiet": ["lora-quiet"]}
MARKER = "tg-poison-7f3a"  # the simulators answer 500 to a request holding it (loadtests/sim/faults.py)
ADAPTERS = ("lora-noisy", "lora-quiet")
TRITON_MODEL = "tensorrt_llm_bls"
TRITON_SIM = ["--time-scale", "0.01", "--max-loras", "2", "--max-cpu-loras", "4"]


def config_for(root: Path, replicas: dict[str, SimReplica], tenants: dict[str, list[str]] = TENANTS) -> dict[str, Any]:
    adapters = write_adapters(root, sorted({a for names in tenants.values() for a in names}))
    urls = {name: replica.url for name, replica in replicas.items()}
    config = gateway_config(urls, tenants, adapters, port=free_port(), max_adapters=8)
    # The issue's repro: a 2 s pool timeout, five failures in a row eject. The engines' metrics are scraped often
    # and a stall is 1 s without a token, so the stall rule is live (and must not be fooled by long generations).
    config["pools"][0].update(
        {"slow_start_s": 0, "request_timeout_s": 2.0, "outlier": {"consecutive_failures": 5, "stall_after_s": 1.0}}
    )
    config["telemetry"] = {"engine_scrape_interval_s": 0.25}
    return config


def replicas_state(gw: GatewayUnderTest) -> dict[str, dict[str, Any]]:
    state: dict[str, dict[str, Any]] = gw.admin("GET", "/admin/residency").json()["pools"]["llama"]["replicas"]
    return state


def statuses(gw: GatewayUnderTest, tenant: str, count: int, **request: Any) -> list[int]:
    """Send ``count`` completions at once as ``tenant``; each one's HTTP status."""

    async def one(client: openai.AsyncOpenAI) -> int:
        try:
            await client.completions.create(model=TENANTS[tenant][0], **request)
        except openai.APIStatusError as exc:
            return exc.status_code
        return 200

    async def all_at_once() -> list[int]:
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=api_key(tenant), max_retries=0, timeout=30)
        async with client:
            return list(await asyncio.gather(*(one(client) for _ in range(count))))

    return asyncio.run(all_at_once())


def test_long_generations_past_the_pool_timeout_and_prompts_that_break_the_engine_eject_nothing(
    tmp_path: Path,
) -> None:
    """The issue's two repros, each twice over the ejection threshold: 5 concurrent generations of 4,000 tokens
    past a 2 s pool timeout (504), then 5 prompts that make every engine answer 500 (502)."""
    with sim_replicas(tmp_path, 2, *SIM) as replicas, GatewayUnderTest(tmp_path, config_for(tmp_path, replicas)) as gw:
        for replica in replicas.values():
            replica.faults(failing_marker=MARKER)
        long = {"prompt": "tell me everything", "max_tokens": 4000, "extra_body": {"ignore_eos": True}}
        for _ in range(2):
            assert statuses(gw, "noisy", 5, **long) == [504] * 5
        for _ in range(2):
            assert statuses(gw, "noisy", 5, prompt=f"{MARKER} please", max_tokens=4) == [502] * 5
        state = replicas_state(gw)
        assert [(s["ejected"], s["ejections"], s["healthy"]) for s in state.values()] == [(False, 0, True)] * 2
        assert statuses(gw, "quiet", 3, prompt="hello", max_tokens=4) == [200] * 3


def test_prompts_that_break_a_triton_model_cost_only_their_own_requests(tmp_path: Path) -> None:
    """The same on a Triton pool: prompts that make every replica's model fail (TensorRT-LLM's executor error, the
    simulator's failing_marker in Triton mode), twice over the ejection threshold, whole and streamed, each a 502;
    no replica is ejected or counted against, and the other tenant's requests, and the noisy tenant's next one,
    are served."""
    adapters = {name: str(write_peft_adapter(tmp_path / name, 8, seed=i)) for i, name in enumerate(ADAPTERS)}
    with simulated_triton_replicas(tmp_path, 2, TRITON_MODEL, *TRITON_SIM) as replicas:
        config = gateway_config({"unused": "http://127.0.0.1:9"}, TENANTS, adapters, port=free_port())
        pool = triton_pool(replicas, TRITON_MODEL, BASE_MODEL, name="llama")
        config["pools"] = [{**pool, "slow_start_s": 0, "outlier": {"consecutive_failures": 5}}]
        for replica in replicas:
            faults = {"faults": {"failing_marker": MARKER}}
            httpx.post(replica["url"] + "/sim/control", json=faults, timeout=10).raise_for_status()
        with GatewayUnderTest(tmp_path, config) as gw:
            for stream in (False, True, False, True):
                assert statuses(gw, "noisy", 5, prompt=f"{MARKER} please", max_tokens=4, stream=stream) == [502] * 5
            state = replicas_state(gw)
            assert statuses(gw, "quiet", 3, prompt="hello", max_tokens=4) == [200] * 3
            assert statuses(gw, "noisy", 1, prompt="hello", max_tokens=4) == [200]
    assert [(s["ejected"], s["ejections"], s["healthy"]) for s in state.values()] == [(False, 0, True)] * 2, state


def test_a_broken_replica_serving_one_tenant_is_still_ejected(tmp_path: Path) -> None:
    """Tenant affinity: the replica serves one tenant, so failures never span two tenants. Its 500s succeed on the
    other replica (dispatch retries them once), and that evidence ejects it; the tenant saw no error."""
    tenants = {"noisy": ["lora-noisy"]}
    with (
        sim_replicas(tmp_path, 2, *SIM) as replicas,
        GatewayUnderTest(tmp_path, config_for(tmp_path, replicas, tenants)) as gw,
    ):
        home = gw.home_of("noisy")
        replicas[home].faults(error_status=500)
        for _ in range(5):
            assert statuses(gw, "noisy", 1, prompt="hello", max_tokens=4) == [200]
        state = replicas_state(gw)[home]
        assert (state["ejected"], state["ejection_reason"]) == (True, "failed_here_only"), state


# How long the noisy tenant makes trouble, in seconds: a minute, as the hardening issue asks (about a minute of
# make test's time); TENANTGATE_NOISY_TENANT_S=15 is already many times the ejection threshold for a quick run.
NOISY_S = float(os.environ.get("TENANTGATE_NOISY_TENANT_S", "60"))


def make_trouble(gw: GatewayUnderTest, seconds: float, workers: int = 4) -> Counter[str]:
    """The noisy tenant, for ``seconds``: each worker in turn sends a generation that runs past the pool's timeout
    and a prompt that makes the engine fail, streamed and not. What each got, counted."""
    outcomes: Counter[str] = Counter()
    kinds = [
        ("timeout", False, {"prompt": "tell me everything", "max_tokens": 4000, "extra_body": {"ignore_eos": True}}),
        ("timeout", True, {"prompt": "tell me everything", "max_tokens": 4000, "extra_body": {"ignore_eos": True}}),
        ("engine_error", False, {"prompt": f"{MARKER} please", "max_tokens": 4}),
        ("engine_error", True, {"prompt": f"{MARKER} please", "max_tokens": 4}),
    ]

    async def one(client: openai.AsyncOpenAI, stream: bool, request: dict[str, Any]) -> str:
        try:
            if not stream:
                await client.completions.create(model="lora-noisy", **request)
                return "ok"
            chunks = await client.completions.create(model="lora-noisy", stream=True, **request)
            async for _chunk in chunks:
                pass
            return "ok"
        except openai.APIStatusError as exc:
            return f"http_{exc.status_code}"
        except openai.APIError:  # an error event in a stream that had started
            return "error_event"

    async def worker(client: openai.AsyncOpenAI, first: int, until: float) -> None:
        index = first
        while time.monotonic() < until:
            kind, stream, request = kinds[index % len(kinds)]
            outcomes[f"{kind}:{'stream' if stream else 'whole'}:{await one(client, stream, request)}"] += 1
            index += 1

    async def all_workers() -> None:
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=api_key("noisy"), max_retries=0, timeout=30)
        async with client:
            until = time.monotonic() + seconds
            await asyncio.gather(*(worker(client, i, until) for i in range(workers)))

    asyncio.run(all_workers())
    return outcomes


def test_a_noisy_tenant_degrades_no_other_tenant_and_ejects_no_replica(tmp_path: Path) -> None:
    """One tenant sends, for NOISY_S seconds, requests that run past the pool's 2 s timeout and requests that make
    every engine answer 500; the quiet tenants (one of them homed with the noisy one) all succeed meanwhile, and
    no replica is ejected."""
    tenants = {"noisy": ["lora-noisy"], **{f"quiet{i}": [f"lora-quiet{i}"] for i in range(4)}}
    quiet = {tenant: names[0] for tenant, names in tenants.items() if tenant != "noisy"}
    with (
        sim_replicas(tmp_path, 2, *SIM) as replicas,
        GatewayUnderTest(tmp_path, config_for(tmp_path, replicas, tenants)) as gw,
    ):
        for replica in replicas.values():
            replica.faults(failing_marker=MARKER)
        assert any(gw.home_of(t) == gw.home_of("noisy") for t in quiet)  # a quiet tenant shares its replica
        with SteadyTraffic(gw.url, quiet, deadline_s=10) as traffic:
            traffic.wait_for(8)
            trouble = make_trouble(gw, NOISY_S)
            traffic.wait_for(8)  # and after it
        outcomes = traffic.outcomes
        state = replicas_state(gw)
    assert set(outcomes.counts) == {"ok"}, (outcomes.counts, outcomes.lost_details)
    # The noisy tenant got its errors: its timeouts (504, or an error event once a stream had started) and the
    # engine's failures (502), each many times over the ejection threshold of 5.
    timeouts = sum(n for key, n in trouble.items() if key.startswith("timeout:") and not key.endswith(":ok"))
    failures = sum(n for key, n in trouble.items() if key.startswith("engine_error:") and key.endswith(":http_502"))
    assert timeouts >= 10 and failures >= 10, trouble
    assert set(trouble) <= {
        "timeout:whole:http_504", "timeout:stream:error_event", "engine_error:whole:http_502",
        "engine_error:stream:http_502",
    }, trouble  # fmt: skip
    assert [(s["ejections"], s["healthy"]) for s in state.values()] == [(0, True)] * 2, state
