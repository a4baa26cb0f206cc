"""The floor this stack can reach: a proxy of a few lines on the gateway's own stack (aiohttp's server on uvloop),
hashing ``x-tenant-id`` to a replica and relaying the answer whole. No auth, no parsing, no metrics, no log: what
tenantgate costs above this is what its features cost (make bench-overhead). The upstream client is aiohttp's
``ClientSession`` with keep-alive, or with ``--client http1`` the gateway's own engine client (backends/http1.py).
With ``--server fast`` the server side is not aiohttp's either: an asyncio protocol whose bytes go through
httptools' request parser, answering each request whole (the floor a server of that kind could reach; the
client is then backends/http1.py).

    python -m loadtests.bare_proxy --port 9000 [--client http1] [--server fast] http://127.0.0.1:9001 ...
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import zlib
from collections.abc import AsyncIterator

import aiohttp
import httptools
import uvloop
from aiohttp import web
from yarl import URL

from backends import http1

SESSION: web.AppKey[aiohttp.ClientSession] = web.AppKey("session", aiohttp.ClientSession)
REPLICAS: web.AppKey[list[str]] = web.AppKey("replicas", list)
ORIGINS: web.AppKey[list[http1.Origin]] = web.AppKey("origins", list)


async def proxy(request: web.Request) -> web.Response:
    replicas = request.app[REPLICAS]
    replica = replicas[zlib.crc32(request.headers.get("x-tenant-id", "").encode()) % len(replicas)]
    body = await request.read()
    headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
    async with request.app[SESSION].post(replica + request.path, data=body, headers=headers) as upstream:
        answer = await upstream.read()
        return web.Response(body=answer, status=upstream.status, content_type=upstream.content_type)


async def proxy_http1(request: web.Request) -> web.Response:
    origins = request.app[ORIGINS]
    origin = origins[zlib.crc32(request.headers.get("x-tenant-id", "").encode()) % len(origins)]
    body = await request.read()
    content_type = request.headers.get("Content-Type", "application/json")
    upstream = await origin.request(origin.request_head("POST", request.path, content_type, {}, len(body)), body, 300)
    try:
        answer = await upstream.read()
    finally:
        upstream.release()
    return web.Response(body=answer, status=upstream.status, content_type="application/json")


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def make_app(replicas: list[str], client: str = "aiohttp") -> web.Application:
    app = web.Application()
    app[REPLICAS] = replicas
    app.router.add_get("/health", health)
    if client == "http1":
        app[ORIGINS] = [http1.Origin(URL(url), limit=256, connect_timeout_s=2) for url in replicas]
        app.router.add_post("/v1/{path:.*}", proxy_http1)
        return app

    async def session(app: web.Application) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar()) as client:
            app[SESSION] = client
            yield

    app.cleanup_ctx.append(session)
    app.router.add_post("/v1/{path:.*}", proxy)
    return app


class FastProxy(asyncio.Protocol):
    """One client connection of ``--server fast``: httptools parses the requests; each whole one is relayed by a task
    of its own, chained after the one before it, so pipelined answers go out in order."""

    def __init__(self, origins: list[http1.Origin]) -> None:
        self._origins = origins
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url, self._tenant, self._body = b"", b"", bytearray()
        self._last: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio's classes

    def connection_lost(self, exc: Exception | None) -> None:
        if self._last is not None:
            self._last.cancel()

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            assert self._transport is not None
            self._transport.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            self._transport.close()

    def on_message_begin(self) -> None:
        self._url, self._tenant, self._body = b"", b"", bytearray()

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"x-tenant-id":
            self._tenant = value

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        keep = self._parser.should_keep_alive()
        self._last = asyncio.ensure_future(self._answer(self._last, self._url, self._tenant, bytes(self._body), keep))

    async def _answer(
        self, before: asyncio.Task[None] | None, url: bytes, tenant: bytes, body: bytes, keep_alive: bool
    ) -> None:
        assert self._transport is not None
        if url == b"/health":
            answer, status = b"ok", 200
        else:
            origin = self._origins[zlib.crc32(tenant) % len(self._origins)]
            head = origin.request_head("POST", url.decode(), "application/json", {}, len(body))
            try:
                upstream = await origin.request(head, body, 300)
                try:
                    answer = await upstream.read()
                finally:
                    upstream.release()
                status = upstream.status
            except OSError:  # the replica unreachable or its answer broken: a 502, and the connection closed
                answer, status, keep_alive = b"{}", 502, False
        if before is not None:
            with contextlib.suppress(Exception):  # the one before answered for itself
                await before
        head_ = b"HTTP/1.1 %d OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n" % (status, len(answer))
        self._transport.write(head_ + (b"\r\n" if keep_alive else b"Connection: close\r\n\r\n") + answer)
        if not keep_alive:
            self._transport.close()


async def serve_fast(replicas: list[str], port: int) -> None:
    origins = [http1.Origin(URL(url), limit=256, connect_timeout_s=2) for url in replicas]
    server = await asyncio.get_running_loop().create_server(lambda: FastProxy(origins), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--client", choices=("aiohttp", "http1"), default="aiohttp", help="the upstream client")
    parser.add_argument("--server", choices=("aiohttp", "fast"), default="aiohttp", help="the server side")
    parser.add_argument("replicas", nargs="+")
    args = parser.parse_args(argv)
    uvloop.install()
    if args.server == "fast":
        asyncio.run(serve_fast(args.replicas, args.port))
        return
    web.run_app(make_app(args.replicas, args.client), host="127.0.0.1", port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
