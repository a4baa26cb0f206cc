"""The server's shortcut to the inference endpoints (gateway/app.py's ``direct``): a POST to one of them goes to
its handler under ``front`` without aiohttp's router, with ``request.app`` and ``request.match_info`` as the router
would have made them; anything else (another method or path, an ``Expect`` header) goes the app's own way."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from gateway.admin.operator import SEPARATE_LISTENER
from gateway.app import GatewayRunner, direct, front
from gateway.serving.ingress import DIRECT_PATHS

NAME = web.AppKey("name", str)


async def _seen(request: web.Request) -> web.Response:
    route = request.match_info.route
    return web.json_response(
        {"app": request.app[NAME], "method": route.method, "path": route.resource.canonical if route.resource else ""}
    )


def _app() -> web.Application:
    app = web.Application(middlewares=[front])
    app[NAME], app[SEPARATE_LISTENER] = "gateway", False  # front reads the latter (the operator listener's check)
    for path in sorted(DIRECT_PATHS):
        app.router.add_post(path, _seen)
    app.router.add_get("/healthz", _seen)
    return app


@pytest.fixture
async def served() -> AsyncIterator[tuple[str, list[str]]]:
    """The app on a real server whose handler is ``direct``; what reached the app's own handler, by path."""
    app = _app()
    runner = web.AppRunner(app)
    await runner.setup()
    assert runner.server is not None
    own = runner.server.request_handler
    fell_back: list[str] = []

    async def app_handle(request: web.BaseRequest) -> web.StreamResponse:
        fell_back.append(f"{request.method} {request.path}")
        return await own(request)

    runner.server.request_handler = direct(app, app_handle)
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", fell_back
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("path", sorted(DIRECT_PATHS))
async def test_an_inference_post_goes_straight_to_its_handler(served: tuple[str, list[str]], path: str) -> None:
    url, fell_back = served
    async with aiohttp.ClientSession() as session, session.post(url + path, json={}) as response:
        assert response.status == 200
        assert await response.json() == {"app": "gateway", "method": "POST", "path": path}
    assert fell_back == []


@pytest.mark.parametrize(
    ("method", "path", "headers", "status"),
    [
        ("GET", "/v1/completions", {}, 405),
        ("POST", "/v1/completions/", {}, 404),
        ("POST", "/v1/chat/completions", {"Expect": "100-continue"}, 200),
        ("GET", "/healthz", {}, 200),
    ],
    ids=["other-method", "other-path", "expect", "other-route"],
)
async def test_anything_else_goes_the_apps_way(
    served: tuple[str, list[str]], method: str, path: str, headers: dict[str, str], status: int
) -> None:
    url, fell_back = served
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, url + path, json={} if method == "POST" else None, headers=headers) as response,
    ):
        assert response.status == status
    assert fell_back == [f"{method} {path}"]


async def test_the_gateways_runner_serves_through_direct() -> None:
    runner = GatewayRunner(_app())
    await runner.setup()
    try:
        assert runner.server is not None
        assert runner.server.request_handler.__qualname__ == "direct.<locals>.handler"
    finally:
        await runner.cleanup()
