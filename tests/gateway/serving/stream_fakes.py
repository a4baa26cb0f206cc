"""What the in-process stream tests share (test_stream_end, test_stream_fault): a fake driver whose streams a test
chooses, a one-replica config on it, and a client's streamed completion through the gateway."""

from __future__ import annotations

from pathlib import Path

from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient

from backends.base import Endpoint, EngineRequest
from gateway.config import GatewayConfig
from loadtests.fleet import api_key, gateway_config, write_adapters
from tests.gateway.residency.fakes import FakeDriver, FakeResponse

EVENT = b'data: {"id":"c1","object":"text_completion","choices":[{"index":0,"text":"hi","finish_reason":null}]}\n\n'


class StreamDriver(FakeDriver):
    """Answers every stream with ``stream()``; other requests (the start-up fill's one-token warm-ups,
    residency.fill_warm_up) as the fake engine does."""

    def stream(self) -> object:
        raise NotImplementedError

    async def send(self, replica: Endpoint, request: EngineRequest) -> FakeResponse:
        if not request.stream:
            return await super().send(replica, request)
        return self.stream()  # type: ignore[return-value]  # a fake stream: status, content_type, chunks, release


def stream_config(tmp_path: Path, backend: str) -> GatewayConfig:
    """One replica of the registered ``backend``, tenant acme with adapter lora-a."""
    adapters = write_adapters(tmp_path, ["lora-a"])
    raw = gateway_config({"r0": "http://127.0.0.1:9"}, {"acme": ["lora-a"]}, adapters, port=0)
    raw["pools"][0]["backend"] = backend
    return GatewayConfig.model_validate(raw)


async def post_stream(client: TestClient) -> ClientResponse:  # type: ignore[type-arg]
    """acme's streamed completion, as the SDK sends one."""
    return await client.post(
        "/v1/completions",
        json={"model": "lora-a", "prompt": "hello", "max_tokens": 4, "stream": True},
        headers={"Authorization": f"Bearer {api_key('acme')}"},
    )
