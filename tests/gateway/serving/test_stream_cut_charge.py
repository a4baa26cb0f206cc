"""A stream the client leaves before the engine's usage event is charged for what it was sent, not only its estimate.
A request without max_tokens is admitted on an estimate of DEFAULT_MAX_TOKENS_ESTIMATE completion tokens, and
corrected by the engine's usage when the stream ends; a client that read as many tokens as it wanted and closed the
connection before that event was charged the estimate alone, however long its answer had run: a tenant's way round
its tokens_per_minute, at the cost of the engine's time every other tenant shares."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from backends.errors import StreamBroken
from backends.registry import EngineSpec, NoSettings, register
from gateway.app import create_app
from gateway.appkeys import METRICS
from gateway.config import GatewayConfig
from gateway.tenants.admission import DEFAULT_MAX_TOKENS_ESTIMATE
from loadtests.fleet import api_key, gateway_config, write_adapters
from tests.gateway.residency.fakes import FakeEngine
from tests.gateway.serving.stream_fakes import EVENT, StreamDriver

SENT = 4 * DEFAULT_MAX_TOKENS_ESTIMATE  # a token an event, as vLLM streams them


class EndlessStream:
    """An engine's stream that goes on generating: ``SENT`` events, then more to come (the client leaves first)."""

    status = 200
    content_type = "text/event-stream"

    async def read(self) -> bytes:
        raise AssertionError("a stream is read in chunks")

    async def chunks(self) -> AsyncIterator[bytes]:
        for _ in range(SENT):
            yield EVENT
        await asyncio.Event().wait()  # cancelled when the client leaves
        yield b""

    def release(self) -> None:
        return None


class EndlessDriver(StreamDriver):
    def stream(self) -> EndlessStream:
        return EndlessStream()


register(EngineSpec("endless-stream", NoSettings, lambda settings, pool: EndlessDriver(FakeEngine())))


class UsagelessStream(EndlessStream):
    """An engine's stream of ``SENT`` events and no usage event, which then ends (a Triton model without the
    ``num_*_tokens`` outputs) or breaks off (the engine's connection dropped)."""

    def __init__(self, breaks: bool) -> None:
        self.breaks = breaks

    async def chunks(self) -> AsyncIterator[bytes]:
        for _ in range(SENT):
            yield EVENT
        if self.breaks:
            raise StreamBroken("the engine's connection dropped")
        yield b"data: [DONE]\n\n"


class UsagelessDriver(StreamDriver):
    def __init__(self, engine: FakeEngine, breaks: bool) -> None:
        super().__init__(engine)
        self.breaks = breaks

    def stream(self) -> UsagelessStream:
        return UsagelessStream(self.breaks)


register(EngineSpec("usageless-stream-ends", NoSettings, lambda settings, pool: UsagelessDriver(FakeEngine(), False)))
register(EngineSpec("usageless-stream-breaks", NoSettings, lambda settings, pool: UsagelessDriver(FakeEngine(), True)))


async def counted(app: web.Application, status: str) -> None:
    """Until acme's request is counted with ``status``: the handler settles the request, then counts it, and may
    do so after the client has its stream's end (or left). A bounded poll."""
    registry = app[METRICS].registry
    labels = {"tenant": "acme", "adapter": "lora-a", "pool": "llama", "replica": "r0", "status": status}
    for _ in range(500):
        if registry.get_sample_value("tenantgate_requests_total", labels):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the request was not counted with status {status}")


def limited_config(tmp_path: Path, backend: str) -> GatewayConfig:
    """acme on one replica of ``backend``, allowed 2 x SENT tokens a minute."""
    adapters = write_adapters(tmp_path, ["lora-a"])
    raw = gateway_config(
        {"r0": "http://127.0.0.1:9"},
        {"acme": ["lora-a"]},
        adapters,
        port=0,
        tenant_options={"acme": {"limits": {"tokens_per_minute": 2 * SENT}}},
    )
    raw["pools"][0]["backend"] = backend
    return GatewayConfig.model_validate(raw)


@pytest.mark.parametrize("backend", ["usageless-stream-ends", "usageless-stream-breaks"])
async def test_a_stream_that_ends_without_usage_is_charged_a_token_an_event_sent(tmp_path: Path, backend: str) -> None:
    """README (Caps cannot be dodged) and docs/triton.md: a stream the engine ends, or breaks off, without its usage
    is charged a token for each event relayed where that is more than its estimate, as one its client left is."""
    app = create_app(limited_config(tmp_path, backend))
    headers = {"Authorization": f"Bearer {api_key('acme')}"}
    async with TestClient(TestServer(app)) as client:
        response = await client.post(
            "/v1/completions", json={"model": "lora-a", "prompt": "hello", "stream": True}, headers=headers
        )
        assert response.status == 200
        body = await asyncio.wait_for(response.read(), 10)  # the whole stream: it ends, with or without an error
        assert body.count(b"\n\n") >= SENT
        await counted(app, "200")  # settled: the request is counted after that
        more = {"model": "lora-a", "prompt": "hello", "max_tokens": SENT + 1}
        answer = await client.post("/v1/completions", json=more, headers=headers)
        assert answer.status == 429, await answer.text()


async def test_a_stream_left_before_its_usage_is_charged_a_token_an_event_sent(tmp_path: Path) -> None:
    app = create_app(limited_config(tmp_path, "endless-stream"))
    headers = {"Authorization": f"Bearer {api_key('acme')}"}
    async with TestClient(TestServer(app, handler_cancellation=True)) as client:
        response = await client.post(
            "/v1/completions", json={"model": "lora-a", "prompt": "hello", "stream": True}, headers=headers
        )
        assert response.status == 200
        received = b""
        while received.count(b"\n\n") < SENT:  # bounded: the engine sends them at once
            received += await asyncio.wait_for(response.content.readany(), 5)
        response.close()  # the client has what it wanted and leaves before the usage event
        await counted(app, "499")
        # SENT tokens used of 2 x SENT a minute: a request that may use SENT + 1 more must wait. Charged its
        # estimate alone (a quarter of SENT), the stream left room for it.
        more = {"model": "lora-a", "prompt": "hello", "max_tokens": SENT + 1}
        answer = await client.post("/v1/completions", json=more, headers=headers)
        assert answer.status == 429, await answer.text()
