"""A whole answer's response (gateway/serving/whole_answer.py) goes out byte for byte as aiohttp's own
``web.Response`` would write it (the date aside): HTTP/1.1 kept alive or closed, HTTP/1.0, with and without the
split's variant header, statuses with and without a body. A real aiohttp server on 127.0.0.1, read raw."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Callable

import pytest
from aiohttp import web
from aiohttp.abc import AbstractStreamWriter

from gateway.serving.whole_answer import VARIANT_HEADER, WholeAnswer

BODY = b'{"id":"cmpl-1","choices":[{"text":"hi"}]}'
MakeResponse = Callable[[int, str | None], web.StreamResponse]


def _aiohttps(status: int, variant: str | None) -> web.StreamResponse:
    headers = {VARIANT_HEADER: variant} if variant else None
    return web.Response(body=BODY, status=status, content_type="application/json", headers=headers)


def _ours(status: int, variant: str | None) -> web.StreamResponse:
    return WholeAnswer(BODY, status, variant)


async def _server(make: MakeResponse) -> AsyncIterator[int]:
    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        return make(int(request.query.get("status", "200")), request.query.get("variant"))

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


async def _exchange(port: int, requests: list[bytes]) -> bytes:
    """Send each request on one connection, one after another; everything the server wrote until it closed or went
    quiet."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    got = b""
    try:
        for raw in requests:
            writer.write(raw)
            await writer.drain()
            try:
                with_body = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as exc:  # the server closed without a response (header injection)
                got += exc.partial
                break
            length = re.search(rb"Content-Length: (\d+)", with_body)
            if length is not None:
                with_body += await reader.readexactly(int(length.group(1)))
            got += with_body
        with contextlib.suppress(TimeoutError):  # closed: b"" at once; kept alive: nothing more comes
            got += await asyncio.wait_for(reader.read(), timeout=0.2)
    finally:
        writer.close()
    return re.sub(rb"Date: [^\r]*", b"Date: -", got)


def _request(query: str = "", version: str = "1.1", close: bool = False) -> bytes:
    head = f"POST /v1/completions{query} HTTP/{version}\r\nHost: x\r\nContent-Length: 2\r\n"
    if close:
        head += "Connection: close\r\n"
    return head.encode() + b"\r\n{}"


# Each case, and whether ours writes it without aiohttp's response path (else it falls back on it).
CASES = {
    "kept alive, twice": ([_request(), _request()], True),
    "variant": ([_request("?variant=b")], True),
    "an engine's 404": ([_request("?status=404")], True),
    "connection: close": ([_request(close=True)], True),
    "no body (204)": ([_request("?status=204")], False),
    "http/1.0": ([_request(version="1.0")], False),
    "a variant that is no header value": ([_request("?variant=a%0d%0ab")], False),
}


@pytest.mark.parametrize(("requests", "fast"), list(CASES.values()), ids=list(CASES))
async def test_a_whole_answer_is_written_as_aiohttps_response(
    requests: list[bytes], fast: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    answers = [b""]
    async for port in _server(_aiohttps):
        answers[0] = await _exchange(port, requests)
    aiohttp_path = web.StreamResponse._start
    started: list[web.StreamResponse] = []

    async def start(response: web.StreamResponse, request: web.BaseRequest) -> AbstractStreamWriter:
        started.append(response)
        return await aiohttp_path(response, request)

    monkeypatch.setattr(web.StreamResponse, "_start", start)
    async for port in _server(_ours):
        answers.append(await _exchange(port, requests))
    assert answers[0] == answers[1]
    assert bool(started) is not fast
