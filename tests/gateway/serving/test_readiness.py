"""/readyz means "this gateway can serve": a pool with no healthy replica answers its own tenants with 503 and
shows in /readyz and in tenantgate_pool_up, but does not take the gateway (and every other pool) out of service."""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from gateway.app import create_app
from gateway.appkeys import METRICS
from gateway.config import GatewayConfig
from loadtests.fleet import api_key, gateway_config
from loadtests.processes import free_port
from tests.servers import EngineProcess


def two_pools(sim: EngineProcess) -> GatewayConfig:
    raw: dict[str, Any] = gateway_config({"r0": sim.url}, {"acme": ["a1"]}, {"a1": sim.adapters["a1"]}, port=0)
    [llama] = raw["pools"]
    nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens there: the pool is down
    other = {**llama, "name": "other", "base_model": "other-model", "replicas": [{"id": "o0", "url": nowhere}]}
    raw["pools"].append(other)
    key = "sha256:" + hashlib.sha256(api_key("initech").encode()).hexdigest()
    raw["tenants"].append({"id": "initech", "api_keys": [key], "base_models": ["other-model"]})
    return GatewayConfig.model_validate(raw)


async def ready_answer(client: TestClient[Any, Any]) -> tuple[int, dict[str, Any]]:
    """/readyz once the start-up's pre-warm is done (a bounded wait)."""
    deadline = time.monotonic() + 20
    while True:
        answer = await client.get("/readyz")
        body: dict[str, Any] = await answer.json()
        if body.get("reason") != "pre-warming adapters" or time.monotonic() > deadline:
            return answer.status, body
        await asyncio.sleep(0.05)


async def test_one_pool_down_keeps_the_gateway_ready_and_says_which(sim_engine: EngineProcess) -> None:
    async with TestClient(TestServer(create_app(two_pools(sim_engine)))) as client:
        status, ready = await ready_answer(client)
        assert status == 200, ready
        assert ready["pools_without_healthy_replica"] == ["other"]
        metrics = client.app[METRICS].exposition().decode()  # what /metrics serves (with a token)
        assert 'tenantgate_pool_up{pool="llama"} 1.0' in metrics
        assert 'tenantgate_pool_up{pool="other"} 0.0' in metrics
        # The healthy pool's tenant is served; the down pool's tenant gets its 503.
        served = await client.post(
            "/v1/completions",
            json={"model": "a1", "prompt": "x", "max_tokens": 2},
            headers={"Authorization": f"Bearer {api_key('acme')}"},
        )
        assert served.status == 200, await served.text()
        refused = await client.post(
            "/v1/completions",
            json={"model": "other-model", "prompt": "x", "max_tokens": 2},
            headers={"Authorization": f"Bearer {api_key('initech')}"},
        )
        assert refused.status == 503
        assert (await refused.json())["error"]["code"] == "no_healthy_replica"


async def test_every_pool_down_is_not_ready(sim_engine: EngineProcess) -> None:
    config = two_pools(sim_engine)
    nowhere = f"http://127.0.0.1:{free_port()}"
    pools = [p.model_dump() for p in config.pools]
    pools[0]["replicas"] = [{"id": "r0", "url": nowhere}]
    config = GatewayConfig.model_validate({**config.model_dump(), "pools": pools})
    async with TestClient(TestServer(create_app(config))) as client:
        status, ready = await ready_answer(client)
        assert status == 503
        assert ready["pools_without_healthy_replica"] == ["llama", "other"]
