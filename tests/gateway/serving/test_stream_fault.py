"""A stream that fails after its first byte for a reason that is no engine's (a fault in the gateway's own code on
the way): it ends with a final error event and ``[DONE]``, as a broken engine stream does, never a second response
written into the first one's body (aiohttp wrote the middleware's 500 answer, head and all, into the stream)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from backends.registry import EngineSpec, NoSettings, register
from gateway.app import create_app
from tests.gateway.residency.fakes import FakeEngine
from tests.gateway.serving.stream_fakes import EVENT, StreamDriver, post_stream, stream_config


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


class FaultyDriver(StreamDriver):
    def stream(self) -> FaultyStream:
        return FaultyStream()


register(EngineSpec("faulty-stream", NoSettings, lambda settings, pool: FaultyDriver(FakeEngine())))


async def test_a_fault_after_the_first_byte_ends_the_stream_with_an_error_event(tmp_path: Path) -> None:
    app = create_app(stream_config(tmp_path, "faulty-stream"))
    async with TestClient(TestServer(app, handler_cancellation=True)) as client:
        response = await post_stream(client)
        assert response.status == 200
        body = await asyncio.wait_for(response.read(), 5)
    assert body.startswith(EVENT) and b"HTTP/1.1" not in body
    assert body.endswith(b"data: [DONE]\n\n") and b'"type": "internal_error"' in body
