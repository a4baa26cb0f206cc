"""A pub/sub subscription whose connection goes silent (gateway/redis_client.channel_messages): a NAT or load
balancer that forgets an idle flow, or a host that vanished, sends no reset, so waiting for the next message
would wait forever while the slot signal, the registry and the reload fan-out believe they listen. Through a
loopback proxy in front of a real redis-server that stops passing bytes (both ways) without closing."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, cast

import pytest

from gateway import redis_client
from gateway.redis_client import channel_messages, make_client
from tests.redis_server import RedisServer

pytestmark = pytest.mark.timeout(60)


class Blackhole:
    """A TCP proxy to ``port`` that drops every byte both ways once ``silent`` is set, keeping the connections;
    counts the PINGs it passed on."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.silent = False
        self.pings = 0
        self.listening_port = 0

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, upstream: bool) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                if not self.silent:
                    self.pings += data.upper().count(b"PING") if upstream else 0
                    writer.write(data)
                    await writer.drain()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.port)
        await asyncio.gather(self._pipe(reader, upstream_writer, True), self._pipe(upstream_reader, writer, False))
        upstream_writer.close()
        writer.close()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Blackhole]:
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.listening_port = server.sockets[0].getsockname()[1]
        async with server:
            yield self
            server.close()


async def test_a_quiet_subscription_is_asked_and_one_whose_connection_went_silent_ends_with_an_error(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redis_client, "QUIET_S", 0.2)
    publisher = make_client(redis_server.url, 2.0)
    async with Blackhole(redis_server.port).running() as proxy:
        subscriber = make_client(f"redis://127.0.0.1:{proxy.listening_port}/0", 2.0, subscriber=True)
        messages = cast(AsyncGenerator[dict[str, Any], None], channel_messages(subscriber, "quiet-test"))
        try:
            assert (await asyncio.wait_for(anext(messages), 5))["type"] == "subscribe"
            # Quiet but alive: asked several times, it answers each time and the subscription goes on.
            waiting = asyncio.create_task(anext(messages))
            for _ in range(500):  # a bounded poll
                if proxy.pings >= 3:
                    break
                await asyncio.sleep(0.01)
            assert proxy.pings >= 3 and not waiting.done()
            await publisher.publish("quiet-test", "one")
            assert (await asyncio.wait_for(waiting, 5))["data"] == "one"
            # Silent: no answer to the next ping ends it (it waited forever before: wait_for's TimeoutError here).
            proxy.silent = True
            with pytest.raises(ConnectionError):
                await asyncio.wait_for(anext(messages), 5)
        finally:
            await messages.aclose()
            await subscriber.aclose()
            await publisher.aclose()
