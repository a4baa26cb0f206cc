"""`tenantgate status` sends the admin token to the gateway it was pointed at and nowhere else: a redirect within
that origin is followed, one to another host (or scheme, or port) is refused before anything is sent there."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.admin.status_cli import StatusError, fetch

TOKEN = "status-cli-test-token-0123456789abcdef"


async def test_a_redirect_to_another_host_never_gets_the_token() -> None:
    seen: list[str | None] = []

    async def elsewhere(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.json_response({"store": "up", "pools": {}, "adapters": {}})

    other_app = web.Application()
    other_app.router.add_get("/{tail:.*}", elsewhere)
    async with TestServer(other_app, host="127.0.0.1") as other:
        # "localhost" and 127.0.0.1 are the same machine but not the same origin: the token is not sent
        target = f"http://localhost:{other.port}/admin/state"

        async def gateway(request: web.Request) -> web.Response:
            if request.path == "/moved/admin/state":  # within the origin: followed, with the token
                raise web.HTTPTemporaryRedirect("/admin/state")
            if request.headers.get("Authorization") != f"Bearer {TOKEN}":
                raise web.HTTPUnauthorized()
            if request.path == "/admin/state" and request.query.get("away") is None:
                return web.json_response({"store": "up", "pools": {}, "adapters": {}})
            raise web.HTTPTemporaryRedirect(target)

        app = web.Application()
        app.router.add_get("/{tail:.*}", gateway)
        async with TestServer(app, host="127.0.0.1") as server:
            base = f"http://127.0.0.1:{server.port}"
            assert (await asyncio.to_thread(fetch, base + "/moved", TOKEN))["store"] == "up"
            with pytest.raises(StatusError, match="another origin"):
                await asyncio.to_thread(fetch, base + "/away", TOKEN)
    assert seen == []  # was: ["Bearer status-cli-test-token-..."], urllib copies the header on a redirect
