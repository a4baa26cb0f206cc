"""docs/benchmarks.md ("`--workers 2` at one client") says nothing on a request's way waits for a coalescing socket:
TCP_NODELAY is set on the connection the gateway accepts (uvloop sets it on each TCP transport, whether the site
binds its own socket or serves one its supervisor opened), on every engine connection (backends/http1.py) and on
the Redis client's connections. Checked here on the gateway's own loop, uvloop, so that an upgrade or a change of
loop that stopped setting it fails here rather than adding Nagle's and delayed ACK's waits at one client."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import pytest
import redis.asyncio
import uvloop
from aiohttp import web
from yarl import URL

from backends import http1
from gateway.redis_client import make_client
from tests.redis_server import RedisServer


def nodelay(transport: asyncio.BaseTransport | None) -> bool:
    assert transport is not None
    sock: socket.socket = transport.get_extra_info("socket")
    return bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))


def listening_socket() -> socket.socket:
    """A bound, listening socket, as serve --workers' supervisor hands its workers (gateway/workers.py)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock


def tcp_site(runner: web.AppRunner) -> web.BaseSite:
    return web.TCPSite(runner, "127.0.0.1", 0)


def sock_site(runner: web.AppRunner) -> web.BaseSite:
    return web.SockSite(runner, listening_socket())


@pytest.mark.parametrize("site", [tcp_site, sock_site], ids=["own-socket", "supervisors-socket"])
def test_accepted_and_engine_connections_have_nodelay(site: Callable[[web.AppRunner], web.BaseSite]) -> None:
    accepted: list[bool] = []

    async def handle(request: web.Request) -> web.Response:
        accepted.append(nodelay(request.transport))
        return web.json_response({})

    async def main() -> bool:
        app = web.Application()
        app.router.add_post("/v1/completions", handle)
        runner = web.AppRunner(app)
        await runner.setup()
        served = site(runner)
        await served.start()
        try:
            port = runner.addresses[0][1]
            origin = http1.Origin(URL(f"http://127.0.0.1:{port}"), limit=1, connect_timeout_s=2)
            head = origin.request_head("POST", "/v1/completions", "application/json", {}, 2)
            response = await origin.request(head, b"{}", timeout_s=5)
            assert response._connection is not None
            engine_side = nodelay(response._connection.transport)
            assert await response.read() == b"{}"
            origin.close()
            return engine_side
        finally:
            await runner.cleanup()

    assert uvloop.run(main())  # the gateway's connection to the engine
    assert accepted == [True]  # the client's connection the gateway accepted


def test_redis_connections_have_nodelay() -> None:
    server = RedisServer().start()

    async def main() -> bool:
        client = make_client(server.url, 2.0)
        assert isinstance(client, redis.asyncio.Redis)
        try:
            connection = await client.connection_pool.get_connection()  # type: ignore[no-untyped-call]
            try:
                assert isinstance(connection, redis.asyncio.Connection) and connection._writer is not None
                return nodelay(connection._writer.transport)
            finally:
                await client.connection_pool.release(connection)
        finally:
            await client.aclose()

    try:
        assert uvloop.run(main())
    finally:
        server.stop()
