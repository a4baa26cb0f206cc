"""Caps that cannot be dodged, end to end (gateway processes, simulated replicas, a real Redis, the openai SDK):
leaving out max_tokens gets the tenant's cap; a stream whose client never asked for usage is still counted, in
full, and what it used beyond its estimate is a debt every gateway sharing Redis makes the tenant's next requests
pay, without cutting the stream; one concurrency limit set for all tenants."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import httpx
import openai
import pytest

from loadtests.fleet import (
    api_key,
    fleet_with_gateway,
    gateway_config,
    gateway_process,
    simulated_replicas,
    write_adapters,
)
from loadtests.processes import free_port
from tests.redis_server import RedisServer

pytestmark = pytest.mark.timeout(120)

TENANTS = {"acme": ["support-acme"], "globex": ["sql-globex"]}
SIM = ["--time-scale", "0", "--max-loras", "4", "--max-model-len", "1200"]
IGNORE_EOS = {"ignore_eos": True}


def sdk(url: str, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=api_key(tenant), max_retries=0, timeout=30)


def test_leaving_out_max_tokens_gets_the_tenants_cap(tmp_path: Path) -> None:
    limits = {"acme": {"limits": {"max_tokens": 8}}}
    with fleet_with_gateway(tmp_path, TENANTS, 1, SIM, tenant_options=limits) as fleet:
        client = sdk(fleet.gateway_url, "acme")
        chat = client.chat.completions.create(
            model="support-acme", messages=[{"role": "user", "content": "go on"}], extra_body=IGNORE_EOS
        )
        stream = client.completions.create(
            model="support-acme", prompt="go on", stream=True, stream_options={"include_usage": True},
            extra_body=IGNORE_EOS,
        )  # fmt: skip
        streamed = [chunk.usage.completion_tokens for chunk in stream if chunk.usage is not None]
        uncapped = sdk(fleet.gateway_url, "globex").chat.completions.create(
            model="sql-globex", messages=[{"role": "user", "content": "go on"}], extra_body=IGNORE_EOS
        )
    assert chat.usage is not None and chat.usage.completion_tokens == 8
    assert streamed == [8]
    assert uncapped.usage is not None and uncapped.usage.completion_tokens > 1000  # to the context's end


def test_a_stream_without_usage_is_counted_and_its_debt_holds_on_every_gateway(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """1,000 tokens a minute; a stream that names no max_tokens (estimated at 256 + the prompt) generates about
    1,190. The client, which did not ask for usage, gets every token and no usage chunk; the other gateway then
    refuses the tenant until the debt is paid."""
    adapters = write_adapters(tmp_path, ["support-acme", "sql-globex"])
    extra = {"state": {"redis_url": redis_server.url}, "telemetry": {"access_log": False}}
    limits = {"acme": {"limits": {"tokens_per_minute": 1000}}}
    with simulated_replicas(tmp_path, 1, *SIM) as urls, contextlib.ExitStack() as stack:
        gateways = []
        for name in ("gw-a", "gw-b"):
            config = gateway_config(urls, TENANTS, adapters, port=free_port(), tenant_options=limits, extra=extra)
            gateways.append(stack.enter_context(gateway_process(tmp_path, config, name))[0])
        stream = sdk(gateways[0], "acme").chat.completions.create(
            model="support-acme", messages=[{"role": "user", "content": "tell me everything"}], stream=True,
            extra_body=IGNORE_EOS,
        )  # fmt: skip
        chunks = list(stream)
        assert all(chunk.usage is None for chunk in chunks)  # the usage chunk the gateway asked for is left out
        words = [c for c in chunks if c.choices and c.choices[0].delta.content]
        assert len(words) > 1100 and chunks[-1].choices[0].finish_reason == "length"  # not cut short
        other = sdk(gateways[1], "acme")
        refused = None
        deadline = time.monotonic() + 5
        while refused is None and time.monotonic() < deadline:  # bounded: the debit is sent as the stream ends
            try:
                other.completions.create(model="support-acme", prompt="x", max_tokens=1)
            except openai.RateLimitError as exc:
                refused = exc
            else:
                time.sleep(0.05)
        assert refused is not None, "the other gateway never saw the debt"
        assert int(refused.response.headers["Retry-After"]) >= 5
        body = refused.body
        assert isinstance(body, dict) and body["type"] == "tokens"
        # Another tenant is untouched.
        assert sdk(gateways[1], "globex").completions.create(model="sql-globex", prompt="x", max_tokens=1).choices


def test_one_concurrency_limit_for_all_tenants(tmp_path: Path) -> None:
    extra = {"limits": {"tenant_defaults": {"max_concurrent": 1}}}
    own = {"globex": {"limits": {"max_concurrent": 2}}}
    sim = ["--time-scale", "0.01", "--max-loras", "4"]
    with fleet_with_gateway(tmp_path, TENANTS, 1, sim, extra=extra, tenant_options=own) as fleet:
        replica = fleet.replica_urls["r0"]
        for tenant, model in (("acme", "support-acme"), ("globex", "sql-globex")):  # loaded before the pause
            sdk(fleet.gateway_url, tenant).completions.create(model=model, prompt="warm", max_tokens=1)

        async def burst() -> dict[str, list[int]]:
            url = fleet.gateway_url + "/v1/completions"
            async with httpx.AsyncClient(timeout=30) as http:
                await http.post(replica + "/sim/control", json={"paused": True})

                def send(tenant: str, model: str) -> asyncio.Task[httpx.Response]:
                    body = {"model": model, "prompt": "hold", "max_tokens": 2}
                    headers = {"Authorization": f"Bearer {api_key(tenant)}"}
                    return asyncio.create_task(http.post(url, json=body, headers=headers))

                held = [send("acme", "support-acme"), send("globex", "sql-globex"), send("globex", "sql-globex")]
                for _ in range(250):  # bounded: until all three wait in the paused engine
                    if (await http.get(replica + "/sim/stats")).json()["waiting"] >= 3:
                        break
                    await asyncio.sleep(0.02)
                over = [await send("acme", "support-acme"), await send("globex", "sql-globex")]
                await http.post(replica + "/sim/control", json={"paused": False})
                return {
                    "over": [r.status_code for r in over],
                    "held": [(await task).status_code for task in held],
                }

        assert asyncio.run(burst()) == {"over": [429, 429], "held": [200, 200, 200]}
