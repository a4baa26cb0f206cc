"""A small keep-alive HTTP/1.1 client for the hot path's engine calls (the vLLM driver's ``send``).

Why not aiohttp's ``ClientSession`` there: its per-request machinery (request and response objects, header
multidicts, URL handling, timers, traces, payload registry) was about a fifth of the gateway's CPU per request
at the realistic load (make bench-overhead's profile), for a call that is always the same shape: a POST of a JSON
body to a known origin, its answer read whole or streamed. This client builds the request head from a prefix made
once per (origin, path), writes head and body in one call, and reads the answer on a plain asyncio protocol.

What it does, as aiohttp did for the driver:
- keep-alive: a connection whose answer was read to the end (and that the engine did not ask to close) goes back
  to its origin's pool; idle connections older than ``idle_timeout_s`` or closed by the engine are not reused;
  at most ``limit`` connections per origin (waiters queue for a free one).
- framing: ``Content-Length``, ``Transfer-Encoding: chunked`` (chunk extensions and trailers skipped) and a body
  read until the engine closes; 1xx interim answers skipped; 204/304 have no body.
- timeouts: the connect within ``connect_timeout_s``, and the whole exchange (waiting for a connection, connect,
  the answer's head and its body) within the request's ``timeout_s``: past it, reads raise ``TimeoutError`` and
  the connection is dropped.
- cancellation and early release: a request cancelled, or an answer released before its end, drops its
  connection (the engine sees the client gone and stops generating); it is never reused.
- errors: a refused or reset connection raises ``OSError``; an answer that breaks off or cannot be read raises
  ``ResponseError`` (a ``ConnectionError``), after the body bytes that did arrive.
- flow control: reading from the engine pauses while more than ``_HIGH_WATER`` bytes of body wait for the
  consumer (a slow client), and resumes below ``_LOW_WATER``.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import cast

from yarl import URL

_MAX_HEAD = 64 * 1024  # an answer head (status line and headers) larger than this is refused
_HIGH_WATER = 256 * 1024
_LOW_WATER = 64 * 1024

# Reading states.
_IDLE, _HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILERS, _UNTIL_CLOSE, _DONE = range(9)


class ResponseError(ConnectionError):
    """The answer broke off (the connection closed or reset mid-way) or could not be read (malformed)."""


class _Connection(asyncio.Protocol):
    """One connection: writes a request, parses its answer into a head and a queue of body chunks."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self.idle_since = 0.0
        self.keep_alive = False
        self._state = _IDLE
        self._buf = bytearray()
        self._remaining = 0
        self.status = 0
        self.headers: dict[str, str] = {}
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None

    # The protocol's side.
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio's classes

    def data_received(self, data: bytes) -> None:
        if self._state == _IDLE or self._state == _DONE:  # bytes nobody asked for: this connection is not reusable
            self.keep_alive = False
            return
        buf = self._buf
        buf += data
        try:
            self._parse(buf)
        except (ValueError, IndexError) as exc:
            self._fail(ResponseError(f"unreadable answer from the engine: {exc}"))
            return
        if self._buffered > _HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool | None:
        return None  # close the transport: connection_lost says what the end means

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.keep_alive = False
        if self._state == _UNTIL_CLOSE and exc is None:  # a reset is no end of the body: it broke off
            self._finish()
        elif self._state not in (_IDLE, _DONE) and self._exc is None:
            reason = f": {exc!r}" if exc is not None else ""
            self._exc = ResponseError(f"the engine closed the connection before the answer's end{reason}")
        self._wake()

    # The request's side.
    @property
    def usable(self) -> bool:
        return self.transport is not None and self.keep_alive and not self.transport.is_closing()

    def send(self, data: bytes, deadline: float) -> None:
        if self.transport is None:
            raise ResponseError("the connection closed before the request was sent")
        self._state, self.status, self.headers, self._exc = _HEAD, 0, {}, None
        self.keep_alive = False  # until the answer's head says otherwise
        self._timer = self._loop.call_at(deadline, self._timed_out)
        self.transport.write(data)

    async def head(self) -> None:
        while self._state == _HEAD and self._exc is None:
            await self._wait()
        if self._state == _HEAD and self._exc is not None:
            raise self._exc

    async def body(self) -> AsyncIterator[bytes]:
        while True:
            if self._chunks:
                chunk = self._chunks.popleft()
                self._buffered -= len(chunk)
                if self._paused and self._buffered < _LOW_WATER and self.transport is not None:
                    self._paused = False
                    self.transport.resume_reading()
                yield chunk
            elif self._exc is not None:
                raise self._exc
            elif self._state == _DONE:
                return
            else:
                await self._wait()

    def whole_body(self) -> bytes | None:
        """The body if it has all arrived (the usual case for a whole answer), without a wait; else None."""
        if self._state != _DONE or self._exc is not None:
            return None
        body = b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        return body

    @property
    def complete(self) -> bool:
        return self._state == _DONE and self._exc is None and not self._chunks

    def abort(self) -> None:
        self.keep_alive = False
        self._cancel_timer()
        if self.transport is not None:
            self.transport.abort()
            self.transport = None

    def reset(self) -> None:
        """Back to idle in the pool after a complete answer."""
        self._state = _IDLE
        self._cancel_timer()
        if self._paused and self.transport is not None:  # its last bytes passed the mark before read() took them all
            self._paused = False
            self.transport.resume_reading()

    async def _wait(self) -> None:
        waiter = self._waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self._exc is None:
            self._exc = exc
        self.abort()
        self._wake()

    def _timed_out(self) -> None:
        self._timer = None
        if self._state not in (_IDLE, _DONE):
            self._fail(TimeoutError("the engine's answer ran past the request's timeout"))

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _finish(self) -> None:
        self._state = _DONE
        self._cancel_timer()

    def _push(self, chunk: bytes) -> None:
        if chunk:
            self._chunks.append(chunk)
            self._buffered += len(chunk)

    def _parse(self, buf: bytearray) -> None:
        """Consume what ``buf`` holds: the head, then body framing, as far as it goes."""
        while buf:
            state = self._state
            if state == _HEAD:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(buf) > _MAX_HEAD:
                        raise ValueError("answer head too large")
                    return
                head = bytes(buf[:end])
                del buf[: end + 4]
                self._read_head(head)
            elif state == _LENGTH:
                size = min(self._remaining, len(buf))
                self._push(bytes(buf[:size]))
                del buf[:size]
                self._remaining -= size
                if self._remaining == 0:
                    self._finish()
            elif state == _CHUNK_SIZE:
                end = buf.find(b"\r\n")
                if end < 0:
                    if len(buf) > _MAX_HEAD:
                        raise ValueError("chunk size line too long")
                    return
                size_text = bytes(buf[:end]).split(b";", 1)[0].strip()
                del buf[: end + 2]
                if not size_text or size_text.strip(b"0123456789abcdefABCDEF"):
                    raise ValueError(f"bad chunk size {size_text!r}")
                self._remaining = int(size_text, 16)
                self._state = _CHUNK_DATA if self._remaining else _TRAILERS
            elif state == _CHUNK_DATA:
                size = min(self._remaining, len(buf))
                self._push(bytes(buf[:size]))
                del buf[:size]
                self._remaining -= size
                if self._remaining == 0:
                    self._state = _CHUNK_END
            elif state == _CHUNK_END:
                if len(buf) < 2:
                    return
                if buf[:2] != b"\r\n":
                    raise ValueError("chunk not followed by CRLF")
                del buf[:2]
                self._state = _CHUNK_SIZE
            elif state == _TRAILERS:
                end = buf.find(b"\r\n")
                if end < 0:
                    if len(buf) > _MAX_HEAD:
                        raise ValueError("trailer too long")
                    return
                del buf[: end + 2]
                if end == 0:
                    self._finish()
            elif state == _UNTIL_CLOSE:
                self._push(bytes(buf))
                buf.clear()
            else:  # _DONE with bytes left over: an engine that answered more than asked; do not reuse
                self.keep_alive = False
                buf.clear()

    def _read_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        version, _, rest = lines[0].partition(b" ")
        if version not in (b"HTTP/1.1", b"HTTP/1.0"):
            raise ValueError(f"not an HTTP/1.x answer: {lines[0][:40]!r}")
        code = rest[:3]
        status = int(code) if len(code) == 3 and code.isdigit() else 0
        if status < 100:  # not a status ("000" would pass for a success below 400)
            raise ValueError(f"bad status line {lines[0][:40]!r}")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon or not name or name != name.strip():
                raise ValueError(f"bad header line {line[:40]!r}")
            key, text = name.decode("latin-1").lower(), value.strip().decode("latin-1")
            if key in headers:
                if key == "content-length" and headers[key] != text:
                    raise ValueError("conflicting Content-Length headers")
                text = headers[key] if key == "content-length" else f"{headers[key]}, {text}"
            headers[key] = text
        if 100 <= status < 200:  # an interim answer (100 Continue, 103 Early Hints): the real one follows
            return
        self.status, self.headers = status, headers
        connection = headers.get("connection", "").lower()
        self.keep_alive = "close" not in connection if version == b"HTTP/1.1" else "keep-alive" in connection
        encoding = headers.get("transfer-encoding")
        length = headers.get("content-length")
        if encoding is not None:
            if encoding.lower().rsplit(",", 1)[-1].strip() != "chunked":
                raise ValueError(f"unsupported Transfer-Encoding {encoding!r}")
            self._state = _CHUNK_SIZE
        elif status in (204, 304):
            self._finish()
        elif length is not None:
            if not length.isdigit():
                raise ValueError(f"bad Content-Length {length!r}")
            self._remaining = int(length)
            if self._remaining:
                self._state = _LENGTH
            else:
                self._finish()
        else:
            self._state = _UNTIL_CLOSE
            self.keep_alive = False


class Response:
    """An answer whose head has arrived: ``status``, ``headers`` (lower-case names), the body read once."""

    def __init__(self, origin: Origin, connection: _Connection) -> None:
        self._origin = origin
        self._connection: _Connection | None = connection
        self.status = connection.status
        self.headers = connection.headers

    async def read(self) -> bytes:
        connection = self._connection
        if connection is None:
            raise ResponseError("the answer was released")
        body = connection.whole_body()
        if body is not None:
            return body
        return b"".join([chunk async for chunk in connection.body()])

    async def chunks(self) -> AsyncIterator[bytes]:
        if self._connection is None:
            raise ResponseError("the answer was released")
        async for chunk in self._connection.body():
            yield chunk

    def release(self) -> None:
        """Hand the connection back for reuse if the answer was read to its end, else drop it. Idempotent."""
        connection, self._connection = self._connection, None
        if connection is not None:
            self._origin.put_back(connection)


class Origin:
    """Keep-alive connections to one engine origin (scheme, host, port), at most ``limit`` at a time."""

    def __init__(self, url: URL, *, limit: int, connect_timeout_s: float, idle_timeout_s: float = 15.0) -> None:
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"not an http(s) URL: {url}")
        self._host, self._port = url.host, url.port or (443 if url.scheme == "https" else 80)
        self._ssl = ssl.create_default_context() if url.scheme == "https" else None
        self._authority = url.host_port_subcomponent or url.host
        self._limit, self._connect_timeout_s, self._idle_timeout_s = limit, connect_timeout_s, idle_timeout_s
        self._idle: list[_Connection] = []
        self._open = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._closed = False
        self._prefixes: dict[str, bytes] = {}

    def request_head(
        self, method: str, target: str, content_type: str, headers: Mapping[str, str], length: int
    ) -> bytes:
        """The request's head: the part made once per (method, target, content type), then ``headers`` (which must
        not repeat Host, Content-Type or Content-Length) and the body's length. A header name or value that could
        end a line is refused (ValueError): it would inject headers."""
        key = f"{method} {target} {content_type}"
        prefix = self._prefixes.get(key)
        if prefix is None:
            line = f"{_check_line(method)} {_check_line(target)} HTTP/1.1\r\nHost: {self._authority}\r\n"
            prefix = f"{line}Content-Type: {_check_line(content_type)}\r\n".encode("latin-1")
            self._prefixes[key] = prefix
        if not headers:
            return prefix + b"Content-Length: %d\r\n\r\n" % length
        extra = "".join(f"{_check_line(name)}: {_check_line(value)}\r\n" for name, value in headers.items())
        return prefix + extra.encode("latin-1") + b"Content-Length: %d\r\n\r\n" % length

    async def request(self, head: bytes, body: bytes, timeout_s: float) -> Response:
        """Send one request (``head`` from ``request_head``) and return once its answer's head has arrived."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        connection = self._idle_connection(loop)
        if connection is None:
            async with asyncio.timeout_at(deadline):
                connection = await self._new_connection(loop, deadline)
        connection.send(head + body if len(body) < 65536 else head, deadline)
        try:
            if len(body) >= 65536 and connection.transport is not None:  # no copy of a large body
                connection.transport.write(body)
            await connection.head()
        except BaseException:
            self.put_back(connection)  # not complete: dropped
            raise
        return Response(self, connection)

    def put_back(self, connection: _Connection) -> None:
        if connection.complete and connection.usable and not self._closed:
            connection.reset()
            connection.idle_since = asyncio.get_running_loop().time()
            self._idle.append(connection)
        else:
            connection.abort()
            self._open -= 1
        self._wake_one()

    def close(self) -> None:
        self._closed = True
        for connection in self._idle:
            connection.abort()
        self._open -= len(self._idle)
        self._idle.clear()

    def _idle_connection(self, loop: asyncio.AbstractEventLoop) -> _Connection | None:
        """The most recently used idle connection still open (its TCP state is warmest); stale ones closed."""
        idle = self._idle
        while idle:
            connection = idle.pop()
            if connection.usable and loop.time() - connection.idle_since < self._idle_timeout_s:
                return connection
            connection.abort()
            self._open -= 1
        return None

    async def _new_connection(self, loop: asyncio.AbstractEventLoop, deadline: float) -> _Connection:
        if self._closed:
            raise ResponseError("the engine's connection pool is closed")
        while self._open >= self._limit:  # wait for a connection to come back or close
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():  # woken, then gave up: pass the turn on
                    self._wake_one()
                elif waiter in self._waiters:  # a wake may have taken the cancelled waiter off already
                    self._waiters.remove(waiter)
                raise
            connection = self._idle_connection(loop)
            if connection is not None:
                return connection
        self._open += 1
        try:
            async with asyncio.timeout(min(self._connect_timeout_s, max(0.0, deadline - loop.time()))):
                _, connection = await loop.create_connection(
                    lambda: _Connection(loop), self._host, self._port, ssl=self._ssl
                )
        except BaseException:
            self._open -= 1
            self._wake_one()
            raise
        return connection

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


def _check_line(text: str) -> str:
    if "\r" in text or "\n" in text:
        raise ValueError(f"a line break in a request header: {text[:40]!r}")
    return text
