"""A pool whose replicas are all unreachable: not ready, and requests get 503 rather than hanging."""

from __future__ import annotations

from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from gateway.app import create_app
from gateway.config import GatewayConfig
from loadtests.fleet import api_key, gateway_config, write_adapters
from loadtests.processes import free_port


async def test_unready_pool_answers_503(tmp_path: Path) -> None:
    adapters = write_adapters(tmp_path, ["lora-a"])
    nowhere = {"r0": f"http://127.0.0.1:{free_port()}"}  # nothing listens there
    config = GatewayConfig.model_validate(gateway_config(nowhere, {"a": ["lora-a"]}, adapters, port=0))
    async with TestClient(TestServer(create_app(config))) as client:
        ready = await client.get("/readyz")
        assert ready.status == 503
        assert (await ready.json())["pools_without_healthy_replica"] == ["llama"]
        response = await client.post(
            "/v1/completions",
            json={"model": "lora-a", "prompt": "x"},
            headers={"Authorization": f"Bearer {api_key('a')}"},
        )
        assert response.status == 503
        assert (await response.json())["error"]["code"] == "no_healthy_replica"
