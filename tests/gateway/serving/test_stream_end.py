"""A stream whose client leaves as soon as it has read the last event was answered: it counts as its status, not
as a 499. The OpenAI SDK closes its connection once it reads ``data: [DONE]``; the engine may still be sending the
end of its chunked body, so the gateway's handler meets the closed connection after the client had everything."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from backends.registry import EngineSpec, NoSettings, register
from gateway.app import create_app
from gateway.appkeys import METRICS
from tests.gateway.residency.fakes import FakeEngine
from tests.gateway.serving.stream_fakes import EVENT, StreamDriver, post_stream, stream_config

DONE = b"data: [DONE]\n\n"


class HeldStream:
    """An engine's stream that sends its last event, then holds its end until ``ended`` is set."""

    status = 200
    content_type = "text/event-stream"

    def __init__(self, ended: asyncio.Event) -> None:
        self.ended = ended

    async def read(self) -> bytes:
        raise AssertionError("a stream is read in chunks")

    async def chunks(self) -> AsyncIterator[bytes]:
        yield EVENT
        yield DONE
        await self.ended.wait()

    def release(self) -> None:
        return None


class HeldDriver(StreamDriver):
    ended = asyncio.Event()

    def stream(self) -> HeldStream:
        return HeldStream(self.ended)


register(EngineSpec("held-stream", NoSettings, lambda settings, pool: HeldDriver(FakeEngine())))


async def test_a_client_that_leaves_after_the_last_event_was_answered(tmp_path: Path) -> None:
    HeldDriver.ended = asyncio.Event()
    app = create_app(stream_config(tmp_path, "held-stream"))
    # As tenantgate serve runs it (gateway/server.py): a client that goes away cancels its handler.
    async with TestClient(TestServer(app, handler_cancellation=True)) as client:
        response = await post_stream(client)
        assert response.status == 200
        received = b""
        while DONE not in received:  # bounded: the engine sends both events at once
            received += await asyncio.wait_for(response.content.readany(), 5)
        response.close()  # the client leaves as the SDK does, the engine's stream not ended yet: the handler is
        # cancelled while it waits for the stream's end
        registry = app[METRICS].registry
        labels = {"tenant": "acme", "adapter": "lora-a", "pool": "llama", "replica": "r0"}
        for _ in range(500):  # a bounded poll: the handler finishes after the client left
            counted = {
                status: registry.get_sample_value("tenantgate_requests_total", {**labels, "status": status})
                for status in ("200", "499")
            }
            if any(counted.values()):
                break
            await asyncio.sleep(0.01)
        HeldDriver.ended.set()
        assert counted == {"200": 1.0, "499": None}
