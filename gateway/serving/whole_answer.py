"""A whole (non-streaming) engine answer as the client's response, its head made once per shape.

aiohttp's ``web.Response`` builds every response's head anew: a header dict, the content type parsed and set, then
at prepare time the length, date, server and connection headers decided one by one and the lot serialised. A
whole answer's head differs between requests only in its length and date, so ``WholeAnswer`` keeps the rest per
(status, variant) and writes head and body to the connection in one write. What aiohttp decides per request is
decided the same way: keep-alive (``Connection: close`` when the connection ends after this response), the date
(aiohttp's own per-second string), the server header. Anything outside the common case (not HTTP/1.1, a status
that has no body, a signal handler that may add headers, a variant name that is no valid header value) goes
through aiohttp's own response path, with the same headers.
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.helpers import rfc822_formatted_time
from aiohttp.http import SERVER_SOFTWARE, HttpVersion11
from aiohttp.http_writer import StreamWriter

VARIANT_HEADER = "x-tenantgate-variant"
_CONTENT_TYPE = "application/json"
_SERVER = f"\r\nServer: {SERVER_SOFTWARE}\r\n".encode()
_heads: dict[tuple[int, str | None], bytes] = {}  # (status, variant): bounded by statuses x the config's variants


def _head(status: int, reason: str, variant: str | None) -> bytes:
    head = _heads.get((status, variant))
    if head is None:
        lines = [f"HTTP/1.1 {status} {reason}"]
        if variant is not None:
            lines.append(f"{VARIANT_HEADER}: {variant}")
        lines += [f"Content-Type: {_CONTENT_TYPE}", "Content-Length: "]
        head = _heads[(status, variant)] = "\r\n".join(lines).encode()
    return head


def plain_header_value(variant: str | None) -> bool:
    """Whether ``variant`` can be written as a header's value as it is (aiohttp refuses CR, LF and NUL)."""
    return variant is None or not any(c in variant for c in "\r\n\0")


class WholeAnswer(web.StreamResponse):
    """The engine's whole answer (JSON) with ``status``, and the split's variant header when there is one."""

    def __init__(self, body: bytes, status: int, variant: str | None) -> None:
        super().__init__(status=status)
        self._answer = body
        self._variant = variant
        self._written = False

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        # Prepared already (aiohttp prepares the handler's response again once it returns): what aiohttp's prepare
        # returns then, without its coroutine.
        if self._eof_sent:
            return None
        if self._payload_writer is not None:
            return self._payload_writer
        status = self.status
        writer = request._payload_writer
        if (
            not isinstance(writer, StreamWriter)  # aiohttp's own (a test's mock may be another)
            or request.version != HttpVersion11
            or status < 200
            or status in (204, 304)
            or (isinstance(request, web.Request) and request.app.on_response_prepare)
            or not plain_header_value(self._variant)
        ):
            return await self._as_aiohttp_would(request)
        keep_alive = self._keep_alive
        if keep_alive is None:
            keep_alive = self._keep_alive = request.keep_alive
        body = self._answer
        tail = b"\r\nDate: " + rfc822_formatted_time().encode() + _SERVER
        if not keep_alive:
            tail += b"Connection: close\r\n"
        self._payload_writer = writer
        # Handed to the connection now, not waited for: the wait for a slow client to take it (past the socket's
        # buffers) is write_eof's, once the handler has returned and the request's lease and place in flight are
        # given back. A client that stops reading holds its connection, nothing of the fleet's.
        # StreamWriter.write(..., drain=False) without its coroutine: with no compression, no declared length and no
        # head buffered in the writer (this response wrote none through it), that is its _write.
        writer._write(b"".join((_head(status, self.reason, self._variant), str(len(body)).encode(), tail, b"\r\n",
                                body)))  # fmt: skip
        self._written = True
        return writer

    async def _as_aiohttp_would(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        if self._variant is not None:
            self.headers[VARIANT_HEADER] = self._variant
        self.content_type = _CONTENT_TYPE
        self.content_length = len(self._answer)
        return await super().prepare(request)

    async def write_eof(self, data: bytes = b"") -> None:
        if self._written:  # by prepare: what is left is the wait for the client to take it
            if self._payload_writer is not None:
                await self._payload_writer.drain()
            await super().write_eof()
        else:  # aiohttp's path prepared it
            await super().write_eof(data or self._answer)
