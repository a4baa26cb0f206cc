"""What the inference routes need of a request, whichever server parsed it: its headers, body and peer, its
connection's guard, and a way to answer it whole or as a stream.

Two servers satisfy it: the gateway's own on the tenant listener (gateway/serving/own_server.py, which builds no
aiohttp object at all for these routes: that is where its saving is), and aiohttp's, through ``AiohttpIncoming``
(every request the own server hands over, and the in-process tests' servers). Header names are looked up in lower
case: aiohttp's headers are case-insensitive, the own server's are a dict of lower-cased names.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Protocol

from aiohttp import web

from gateway.serving.connections import authenticated
from gateway.serving.json_body import read_body, whole_body
from gateway.serving.whole_answer import WholeAnswer


class Stream(Protocol):
    """A streamed answer whose head has gone out: its body written piece by piece, each write waiting while the
    client has not taken what came before; ``ConnectionResetError`` once the client has left."""

    async def write(self, data: bytes) -> None: ...

    async def write_eof(self) -> None: ...


class Incoming(Protocol):
    """One inference request, as ingress, dispatch and relay read and answer it."""

    @property
    def headers(self) -> Mapping[str, str]:
        """The request's headers; names looked up in lower case."""
        ...

    @property
    def remote(self) -> str | None:
        """The peer's address."""
        ...

    @property
    def transport(self) -> asyncio.Transport | None:
        """The connection's transport (a stream's stalled client is cut off through it), None once it is gone."""
        ...

    def body_in(self) -> bool:
        """Whether the whole body has arrived."""
        ...

    def body_now(self) -> bytes | None:
        """The whole body without a wait, or None where ``read_body`` must be awaited."""
        ...

    async def read_body(self) -> bytes:
        """The whole body, once it has arrived (a 400 for one that does not decode, a 413 for one over the limit)."""
        ...

    def authenticated(self) -> None:
        """The request presented a valid key: its connection no longer counts as unauthenticated."""
        ...

    async def answer(self, status: int, body: bytes, variant: str | None) -> bool:
        """Write a whole JSON answer now; False when the client had left (nothing was written)."""
        ...

    async def stream(self, status: int, headers: Mapping[str, str]) -> Stream:
        """Start a streamed answer with ``headers`` (its head written now)."""
        ...


class AiohttpIncoming:
    """An aiohttp request as an ``Incoming``; ``response`` is what its handler returns to aiohttp."""

    __slots__ = ("request", "response")

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None

    @property
    def headers(self) -> Mapping[str, str]:
        return self.request.headers

    @property
    def remote(self) -> str | None:
        return self.request.remote

    @property
    def transport(self) -> asyncio.Transport | None:
        return self.request.transport

    def body_in(self) -> bool:
        return self.request.content.is_eof()

    def body_now(self) -> bytes | None:
        return whole_body(self.request)

    async def read_body(self) -> bytes:
        return await read_body(self.request)

    def authenticated(self) -> None:
        authenticated(self.request)

    async def answer(self, status: int, body: bytes, variant: str | None) -> bool:
        response = self.response = WholeAnswer(body, status, variant)
        try:
            await response.prepare(self.request)
        except ConnectionResetError:  # the client left: the engine's answer still counts (aiohttp's write gives up)
            return False
        return True

    async def stream(self, status: int, headers: Mapping[str, str]) -> Stream:
        response = self.response = web.StreamResponse(status=status, headers=headers)
        await response.prepare(self.request)
        return response
