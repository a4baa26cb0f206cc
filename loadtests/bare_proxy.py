"""The floor this stack can reach: a proxy of a few lines on the gateway's own stack (aiohttp's server on uvloop),
hashing ``x-tenant-id`` to a replica and relaying the answer whole. No auth, no parsing, no metrics, no log: what
tenantgate costs above this is what its features cost (make bench-overhead). The upstream client is aiohttp's
``ClientSession`` with keep-alive, or with ``--client http1`` the gateway's own engine client (backends/http1.py).

    python -m loadtests.bare_proxy --port 9000 [--client http1] http://127.0.0.1:9001 http://127.0.0.1:9002
"""

from __future__ import annotations

import argparse
import zlib
from collections.abc import AsyncIterator

import aiohttp
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--client", choices=("aiohttp", "http1"), default="aiohttp", help="the upstream client")
    parser.add_argument("replicas", nargs="+")
    args = parser.parse_args(argv)
    uvloop.install()
    web.run_app(make_app(args.replicas, args.client), host="127.0.0.1", port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
