"""A stream that fails after its first byte for a reason that is no engine's (a fault in the gateway's own code on
the way): it ends with a final error event and ``[DONE]``, as a broken engine stream does, never a second response
written into the first one's body (aiohttp wrote the middleware's 500 answer, head and all, into the stream)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from backends.base import Endpoint, EngineRequest
from backends.registry import EngineSpec, NoSettings, register
from gateway.app import create_app
from gateway.config import GatewayConfig
from loadtests.fleet import api_key, gateway_config, write_adapters
from tests.gateway.residency.fakes import FakeDriver, FakeEngine, FakeResponse

EVENT = b'data: {"id":"c1","object":"text_completion","choices":[{"index":0,"text":"hi","finish_reason":null}]}\n\n'


class FaultyStream:
    """An engine's stream whose reading fails, after one event, with what no driver raises on purpose."""

    status = 200
    content_type = "text/event-stream"

    async def read(self) -> bytes:
        raise AssertionError("a stream is read in chunks")

    async def chunks(self) -> AsyncIterator[bytes]:
        yield EVENT
        raise RuntimeError("a fault in the gateway's own code")

    def release(self) -> None:
        return None


class FaultyDriver(FakeDriver):
    async def send(self, replica: Endpoint, request: EngineRequest) -> FaultyStream | FakeResponse:  # type: ignore[override]
        if not request.stream:  # the start-up fill's one-token warm-ups (residency.fill_warm_up)
            return await super().send(replica, request)
        return FaultyStream()


register(EngineSpec("faulty-stream", NoSettings, lambda settings, pool: FaultyDriver(FakeEngine())))


async def test_a_fault_after_the_first_byte_ends_the_stream_with_an_error_event(tmp_path: Path) -> None:
    adapters = write_adapters(tmp_path, ["lora-a"])
    raw = gateway_config({"r0": "http://127.0.0.1:9"}, {"acme": ["lora-a"]}, adapters, port=0)
    raw["pools"][0]["backend"] = "faulty-stream"
    app = create_app(GatewayConfig.model_validate(raw))
    async with TestClient(TestServer(app, handler_cancellation=True)) as client:
        response = await client.post(
            "/v1/completions",
            json={"model": "lora-a", "prompt": "hello", "max_tokens": 4, "stream": True},
            headers={"Authorization": f"Bearer {api_key('acme')}"},
        )
        assert response.status == 200
        body = await asyncio.wait_for(response.read(), 5)
    assert body.startswith(EVENT) and b"HTTP/1.1" not in body
    assert body.endswith(b"data: [DONE]\n\n") and b'"type": "internal_error"' in body
