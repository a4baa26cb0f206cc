"""Requests handled in their connection's task (gateway/serving/inline_requests.py): aiohttp's connection loop
with the one change, so the rest of its behaviour holds (keep-alive, pipelined requests in order, a client that
leaves cancels its handler), and the gateway's requests leave the context variables as they found them, which is
what the per-request task aiohttp made was there to guarantee."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from backends.registry import EngineSpec, NoSettings, register
from gateway.app import GatewayRunner, create_app
from gateway.appkeys import METRICS
from gateway.config import GatewayConfig, ListenConfig
from gateway.observe.metrics import GatewayMetrics
from gateway.serving.connections import ConnectionGuard, GuardedSite, keepalive_timeout
from gateway.serving.inline_requests import InlineRequestHandler
from loadtests.fleet import api_key, gateway_config, write_adapters
from tests.gateway.residency.fakes import FakeDriver, FakeEngine

register(EngineSpec("inline-fake", NoSettings, lambda settings, pool: FakeDriver(FakeEngine())))


async def _site(runner: web.AppRunner, metrics: GatewayMetrics) -> tuple[GuardedSite, ConnectionGuard]:
    config = ListenConfig()
    guard = ConnectionGuard(config, metrics)
    site = GuardedSite(runner, guard, "127.0.0.1", 0)
    await site.start()
    return site, guard


@pytest.fixture
async def plain() -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """A small app on the guarded site (as the gateway serves): ``/task`` says whether it ran in its connection's
    task, ``/slow`` waits until cancelled (and says so in ``seen``), ``/n/{i}`` answers its number."""
    seen: dict[str, Any] = {"cancelled": asyncio.Event()}

    async def task(request: web.Request) -> web.Response:
        return web.json_response({"connection_task": asyncio.current_task() is request.task})

    async def slow(request: web.Request) -> web.Response:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            seen["cancelled"].set()
            raise
        return web.Response(text="late")

    async def number(request: web.Request) -> web.Response:
        await asyncio.sleep(0.01 * (3 - int(request.match_info["i"])))  # the first waits longest
        return web.Response(text=request.match_info["i"])

    app = web.Application()
    app.router.add_get("/task", task)
    app.router.add_get("/slow", slow)
    app.router.add_get("/n/{i}", number)
    runner = web.AppRunner(app, handler_cancellation=True, keepalive_timeout=keepalive_timeout(ListenConfig()))
    await runner.setup()
    site, guard = await _site(runner, GatewayMetrics())
    try:
        yield site.port, seen
    finally:
        await runner.cleanup()
        await guard.stop()


async def test_a_request_runs_in_its_connections_task_and_the_connection_stays_open(
    plain: tuple[int, dict[str, Any]],
) -> None:
    port, _ = plain
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(3):
            async with session.get(f"http://127.0.0.1:{port}/task") as response:
                assert await response.json() == {"connection_task": True}
        assert len(connector._conns) == 1  # one kept-alive connection served all three


async def test_pipelined_requests_are_answered_in_order(plain: tuple[int, dict[str, Any]]) -> None:
    port, _ = plain
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"".join(f"GET /n/{i} HTTP/1.1\r\nHost: gw\r\n\r\n".encode() for i in range(3)))
    answers = b""
    while answers.count(b"HTTP/1.1 200") < 3 or not answers.endswith(b"2"):
        answers += await asyncio.wait_for(reader.read(65536), 10)
    bodies = [part.rsplit(b"\r\n\r\n", 1)[1][:1] for part in answers.split(b"HTTP/1.1 ")[1:]]
    assert bodies == [b"0", b"1", b"2"]
    writer.close()


async def test_a_client_that_leaves_cancels_its_handler(plain: tuple[int, dict[str, Any]]) -> None:
    port, seen = plain
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /slow HTTP/1.1\r\nHost: gw\r\n\r\n")
    await writer.drain()
    await asyncio.sleep(0.1)
    writer.close()
    await asyncio.wait_for(seen["cancelled"].wait(), 10)
    async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/task") as response:
        assert response.status == 200  # the server goes on serving


def _config(tmp_path: Path) -> GatewayConfig:
    adapters = write_adapters(tmp_path, ["lora-a"])
    raw = gateway_config({"r0": "http://127.0.0.1:9"}, {"acme": ["lora-a"]}, adapters, port=0)
    raw["pools"][0]["backend"] = "inline-fake"
    return GatewayConfig.model_validate(raw)


async def test_the_gateways_requests_leave_the_context_as_they_found_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tracing on (the spans set OpenTelemetry's context variable), answers and refusals of every kind, streamed
    and whole, one after another on one kept-alive connection: each request starts from the same context."""
    contexts: list[dict[contextvars.ContextVar[Any], Any]] = []
    handle: Callable[..., Any] = InlineRequestHandler._handle_request

    async def recorded(self: InlineRequestHandler, *args: Any) -> Any:
        contexts.append(dict(contextvars.copy_context()))
        return await handle(self, *args)

    monkeypatch.setattr(InlineRequestHandler, "_handle_request", recorded)
    app = create_app(_config(tmp_path), span_exporter=InMemorySpanExporter())
    runner = GatewayRunner(app, handler_cancellation=True)
    await runner.setup()
    site, guard = await _site(runner, app[METRICS])
    url = f"http://127.0.0.1:{site.port}"
    good = {"Authorization": f"Bearer {api_key('acme')}"}
    requests: list[tuple[str, dict[str, str], Any, int]] = [
        ("/v1/completions", good, {"model": "lora-a", "prompt": "hi", "max_tokens": 4}, 200),
        ("/v1/completions", good, {"model": "lora-a", "prompt": "hi", "max_tokens": 4, "stream": True}, 200),
        ("/v1/chat/completions", good, {"model": "lora-a", "messages": [{"role": "user", "content": "hi"}]}, 200),
        ("/v1/completions", {"Authorization": "Bearer wrong"}, {"model": "lora-a", "prompt": "hi"}, 401),
        ("/v1/completions", good, {"model": "lora-a", "prompt": 5}, 400),
        ("/v1/completions", good, {"model": "nope", "prompt": "hi"}, 404),
        ("/v1/completions", good, {"model": "lora-a", "prompt": "hi", "max_tokens": 4}, 200),
    ]
    try:
        connector = aiohttp.TCPConnector(limit=1)
        async with aiohttp.ClientSession(connector=connector) as session:
            for path, headers, body, status in requests:
                async with session.post(url + path, json=body, headers=headers) as response:
                    await response.read()
                    assert response.status == status, (path, body)
    finally:
        await runner.cleanup()
        await guard.stop()
    assert len(contexts) == len(requests)
    assert all(context == contexts[0] for context in contexts)
