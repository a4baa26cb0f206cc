"""Admission end to end: rate limits per tenant (one gateway, and two sharing Redis), the global bound on work
in flight, and a client that goes away cancelling the engine's work."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtests.fleet import (
    ADMIN_TOKEN,
    api_key,
    fleet_with_gateway,
    gateway_config,
    gateway_process,
    sim_stats,
    simulated_replicas,
    write_adapters,
)
from loadtests.processes import free_port
from tests.redis_server import RedisServer

pytestmark = pytest.mark.timeout(120)

SIM = ["--time-scale", "0.01", "--max-loras", "4"]
TENANTS = {"acme": ["support-acme"], "globex": ["sql-globex"]}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def post(url: str, tenant: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "hi", "max_tokens": 2}
    return httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {api_key(tenant)}"})


def test_a_tenant_over_its_rate_gets_429_and_others_are_unaffected(tmp_path: Path) -> None:
    limits = {"acme": {"limits": {"requests_per_minute": 5}}}
    with fleet_with_gateway(tmp_path, TENANTS, 1, SIM, tenant_options=limits) as fleet:
        answers = [post(fleet.gateway_url, "acme", "support-acme") for _ in range(8)]
        others = [post(fleet.gateway_url, "globex", "sql-globex") for _ in range(8)]
    assert [a.status_code for a in answers] == [200] * 5 + [429] * 3
    refused = answers[-1]
    assert int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["code"] == "rate_limit_exceeded" and refused.json()["error"]["type"] == "requests"
    assert [a.status_code for a in others] == [200] * 8


def test_token_limits_and_the_max_tokens_cap(tmp_path: Path) -> None:
    limits = {"acme": {"limits": {"tokens_per_minute": 100, "max_tokens": 40}}}
    with fleet_with_gateway(tmp_path, TENANTS, 1, SIM, tenant_options=limits) as fleet:
        client = openai.OpenAI(base_url=fleet.gateway_url + "/v1", api_key=api_key("acme"), max_retries=0)
        with pytest.raises(openai.BadRequestError, match="at most 40"):
            client.completions.create(model="support-acme", prompt="x", max_tokens=41)
        client.completions.create(model="support-acme", prompt="x", max_tokens=40)  # counts 41, uses 41
        client.completions.create(model="support-acme", prompt="x", max_tokens=40)
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(model="support-acme", prompt="x", max_tokens=40)
    body = refused.value.body
    assert isinstance(body, dict) and body["type"] == "tokens"


def test_an_engines_absurd_usage_is_charged_at_the_requests_ceiling(tmp_path: Path) -> None:
    """An engine that reports 10^15 - 1 completion tokens (the most the gateway reads): each request is charged
    what it could have used (its prompt and its max_tokens), so the tenant's next requests are admitted; the clamp
    is counted against the replica."""
    limits = {"acme": {"limits": {"tokens_per_minute": 1000}}}
    with fleet_with_gateway(tmp_path, TENANTS, 1, SIM, tenant_options=limits) as fleet:
        client = openai.OpenAI(base_url=fleet.gateway_url + "/v1", api_key=api_key("acme"), max_retries=0)
        faults = {"faults": {"reported_completion_tokens": 10**15 - 1}}
        httpx.post(fleet.replica_urls["r0"] + "/sim/control", json=faults).raise_for_status()
        stream = client.completions.create(model="support-acme", prompt="hi", max_tokens=2, stream=True)
        assert [chunk for chunk in stream]
        client.completions.create(model="support-acme", prompt="hi", max_tokens=2)  # 429 if the stream's counted
        httpx.post(fleet.replica_urls["r0"] + "/sim/control", json={"faults": {"reported_completion_tokens": None}})
        client.completions.create(model="support-acme", prompt="hi", max_tokens=2)
        metrics = httpx.get(fleet.gateway_url + "/metrics", headers=ADMIN, timeout=10).text
    found = {
        (sample.name, sample.labels.get("tenant"), sample.labels.get("replica")): sample.value
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
    }
    assert found[("tenantgate_usage_clamped_total", None, "r0")] == 2
    assert found[("tenantgate_completion_tokens_total", "acme", None)] == 3 * 2


def test_a_batch_of_prompts_is_charged_for_each_prompts_completions(tmp_path: Path) -> None:
    """A completions request whose prompt is a list of strings is a batch: the engine answers each prompt with its
    own choices, so its ceiling (and its estimate) is max_tokens for each. Counted as one prompt's, a batch of five
    was charged a fifth of what it used (the engine's honest report clamped), a tenant's way round its limit."""
    limits = {"acme": {"limits": {"tokens_per_minute": 150}}}
    with fleet_with_gateway(tmp_path, TENANTS, 1, SIM, tenant_options=limits) as fleet:
        client = openai.OpenAI(base_url=fleet.gateway_url + "/v1", api_key=api_key("acme"), max_retries=0)
        batch = {"model": "support-acme", "prompt": ["hi"] * 5, "max_tokens": 20, "extra_body": {"ignore_eos": True}}
        answer = client.completions.create(**batch)  # type: ignore[call-overload]
        assert len(answer.choices) == 5 and answer.usage is not None and answer.usage.completion_tokens == 100
        with pytest.raises(openai.RateLimitError):  # about 110 of 150 charged: the next batch's 103 must wait
            client.completions.create(**batch)  # type: ignore[call-overload]
        metrics = httpx.get(fleet.gateway_url + "/metrics", headers=ADMIN, timeout=10).text
    found = {
        (sample.name, sample.labels.get("tenant"), sample.labels.get("replica")): sample.value
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.labels.get("adapter", "support-acme") == "support-acme"  # not the refused request's "-"
    }
    assert found.get(("tenantgate_usage_clamped_total", None, "r0"), 0.0) == 0
    assert found[("tenantgate_completion_tokens_total", "acme", None)] == 100


def test_limits_hold_across_two_gateways_sharing_redis(tmp_path: Path, redis_server: RedisServer) -> None:
    """60 requests alternate between two gateways; a 30-per-minute limit admits at most 30 (plus a second's
    refill) and at least 30 less one lease (3) per gateway: the stated tolerance."""
    adapters = write_adapters(tmp_path, ["support-acme", "sql-globex"])
    extra = {"state": {"redis_url": redis_server.url}}
    limits = {"acme": {"limits": {"requests_per_minute": 30}}}
    with simulated_replicas(tmp_path, 1, *SIM) as urls, contextlib.ExitStack() as stack:
        gateways = []
        for name in ("gw-a", "gw-b"):
            config = gateway_config(urls, TENANTS, adapters, port=free_port(), tenant_options=limits, extra=extra)
            gateways.append(stack.enter_context(gateway_process(tmp_path, config, name))[0])
        started = time.monotonic()
        answers = [post(gateways[i % 2], "acme", "support-acme").status_code for i in range(60)]
        refill = (time.monotonic() - started) * 30 / 60
    admitted = answers.count(200)
    assert set(answers) == {200, 429}
    assert 30 - 2 * 3 <= admitted <= 30 + refill + 1, (admitted, refill)


def test_over_the_in_flight_bound_requests_are_refused_at_once(tmp_path: Path) -> None:
    extra = {"limits": {"max_in_flight": 2}}
    with fleet_with_gateway(tmp_path, TENANTS, 1, SIM, extra=extra) as fleet:
        replica = fleet.replica_urls["r0"]
        post(fleet.gateway_url, "acme", "support-acme")  # load the adapter first
        httpx.post(replica + "/sim/control", json={"paused": True})

        async def burst() -> list[int]:
            async with httpx.AsyncClient(timeout=30) as http:
                headers = {"Authorization": f"Bearer {api_key('acme')}"}
                body = {"model": "support-acme", "prompt": "hi", "max_tokens": 2}
                url = fleet.gateway_url + "/v1/completions"
                held = [asyncio.create_task(http.post(url, json=body, headers=headers)) for _ in range(2)]
                for _ in range(200):  # bounded: until both wait in the paused engine
                    if (await http.get(replica + "/sim/stats")).json()["waiting"] >= 2:
                        break
                    await asyncio.sleep(0.02)
                # The engine is still paused: these can only come back because the gateway refused them at once.
                refused = [await http.post(url, json=body, headers=headers) for _ in range(3)]
                assert all(r.headers.get("Retry-After") == "1" for r in refused)
                await http.post(replica + "/sim/control", json={"paused": False})
                return [r.status_code for r in refused] + [(await task).status_code for task in held]

        assert asyncio.run(burst()) == [503, 503, 503, 200, 200]


def test_a_client_that_goes_away_mid_stream_cancels_the_engine_request(tmp_path: Path) -> None:
    slow = ["--time-scale", "1.0", "--max-loras", "4"]
    with fleet_with_gateway(tmp_path, TENANTS, 1, slow) as fleet:
        replica = fleet.replica_urls["r0"]
        before = sim_stats(replica)["aborted"]
        body = {"model": "support-acme", "prompt": "tell me a long story", "max_tokens": 200, "stream": True}
        headers = {"Authorization": f"Bearer {api_key('acme')}"}
        httpx.post(replica + "/sim/control", json={"run_steps": 1})  # one token, then the engine holds
        try:
            with httpx.stream("POST", fleet.gateway_url + "/v1/completions", json=body, headers=headers) as response:
                next(response.iter_bytes())  # the stream has started; then the client goes away
            for _ in range(500):  # bounded: until the engine has dropped the request
                if sim_stats(replica)["aborted"] > before:
                    break
                time.sleep(0.02)
            stats = sim_stats(replica)
        finally:
            httpx.post(replica + "/sim/control", json={"paused": False})
    assert stats["aborted"] == before + 1 and stats["running"] == 0
