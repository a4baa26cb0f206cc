"""A small keep-alive HTTP/1.1 client for the hot path's engine calls (the vLLM driver's ``send``).

Why not aiohttp's ``ClientSession`` there: its per-request machinery (request and response objects, header
multidicts, URL handling, timers, traces, payload registry) was about a fifth of the gateway's CPU per request
at the realistic load (make bench-overhead's profile), for a call that is always the same shape: a POST of a JSON
body to a known origin, its answer read whole or streamed. This client builds the request head from a prefix made
once per (origin, path), writes head and body in one call, and reads the answer on a plain asyncio protocol whose
bytes go through httptools' response parser (llhttp, Node.js's parser: the framing rules are not hand-written here).

What it does, as aiohttp did for the driver:
- keep-alive: a connection whose answer was read to the end (and that the engine did not ask to close) goes back
  to its origin's pool; idle connections older than ``idle_timeout_s`` or closed by the engine are not reused;
  at most ``limit`` connections per origin (waiters queue for a free one, served in their order:
  a request that arrives meanwhile queues behind them).
- framing: ``Content-Length``, ``Transfer-Encoding: chunked`` (chunk extensions and trailers skipped) and a body
  read until the engine closes; 1xx interim answers skipped; 204/304 have no body.
- timeouts: the connect within ``connect_timeout_s``, and the whole exchange (waiting for a connection, connect,
  the answer's head and its body) within the request's ``timeout_s``: past it, reads raise ``TimeoutError`` and
  the connection is dropped; past it while still waiting for a connection at the limit, ``ConnectionWaitTimeout``
  (the request never left the gateway). Closing the origin fails the requests waiting for a connection at once
  (``ResponseError``), not at their deadlines.
- cancellation and early release: a request cancelled, or an answer released before its end, drops its
  connection (the engine sees the client gone and stops generating); it is never reused.
- errors: a request whose kept-alive connection ends before any byte of an answer (the engine closing it idle
  as the request arrived) is sent once more on a new connection; a refused or reset connection raises
  ``OSError``; an answer that breaks off or cannot be read raises ``ResponseError`` (a ``ConnectionError``),
  after the body bytes that did arrive.
- flow control: reading from the engine pauses while more than ``_HIGH_WATER`` bytes of body wait for the
  consumer (a slow client), and resumes below ``_LOW_WATER``.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import cast

import httptools
from yarl import URL

from backends.errors import BackendError, DeadlineExceeded, EngineTimeout, EngineUnavailable

# Bytes read without the parser making progress (a head or trailers that never end, which it would keep buffering)
# before the answer is refused; checked per slice of at most _SLICE bytes fed at a time.
_MAX_HEAD = 64 * 1024
_SLICE = 16 * 1024
_HIGH_WATER = 256 * 1024
# A whole (non-streamed) answer larger than this is refused: an OpenAI answer, logprobs and n choices included, is
# far smaller; a larger one is an engine gone wrong, and would be held in memory whole.
MAX_WHOLE_BODY = 64 * 1024 * 1024
_LOW_WATER = 64 * 1024

_CLOSED = "the engine's connection pool is closed"

# Reading states: no request out; waiting for the answer's head; reading its body; the answer read to its end.
_IDLE, _HEAD, _BODY, _DONE = range(4)


class ResponseError(ConnectionError):
    """The answer broke off (the connection closed or reset mid-way) or could not be read (malformed)."""


class AnswerTooLong(ResponseError):
    """The answer is longer than the reader takes whole (``Response.read``'s limit): not read, the connection
    dropped."""


class ConnectionWaitTimeout(TimeoutError):
    """The request's timeout passed while it waited for a connection at this client's own per-origin limit: it was
    never sent, and says nothing of the engine (the drivers answer it as the request's deadline, not the replica's
    failure)."""


def request_failure(exc: OSError, replica_id: str) -> BackendError:
    """What a request that ``Origin.request`` raised on means for the drivers (called only on failure: no frame on
    the hot path): never sent for the gateway's own connection limit (the request's deadline, nothing against the
    replica), no answer in time, or the replica unreachable."""
    if isinstance(exc, ConnectionWaitTimeout):
        return DeadlineExceeded(f"the request's deadline passed waiting for a connection to {replica_id}: {exc}")
    if isinstance(exc, TimeoutError):  # before OSError: TimeoutError is one
        return EngineTimeout(f"{replica_id} did not answer in time")
    return EngineUnavailable(f"{replica_id} unreachable: {exc!r}")


class _Connection(asyncio.Protocol):
    """One connection: writes a request, parses its answer into a head and a queue of body chunks. The parser calls
    the ``on_*`` methods below as it reads (httptools' callback protocol)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self.idle_since = 0.0
        self.keep_alive = False
        self._state = _IDLE
        self._parser = httptools.HttpResponseParser(self)
        # Bytes fed in slices where the parser made no progress (no header, chunk or body byte came out), in a row.
        self._unparsed = 0
        self._header_bytes = 0  # the answer's header and trailer names and values so far
        self.answered = False  # some byte of the answer to the request sent last arrived
        self._progress = False
        self._interim = False  # the answer being read is a 1xx (100 Continue, 103 Early Hints): the real one follows
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
        self.answered = True
        try:
            if len(data) <= _SLICE:
                self._feed(data)
            else:
                view = memoryview(data)
                for start in range(0, len(data), _SLICE):
                    self._feed(view[start : start + _SLICE])
        except httptools.HttpParserError as exc:  # malformed, an upgrade never asked for, or refused by a callback
            if self._state == _DONE:  # junk after a whole answer: the answer stands; the connection is not reused
                self.keep_alive = False
                self._wake()
                return
            reason = exc.__context__ if isinstance(exc, httptools.HttpParserCallbackError) else exc
            self._fail(ResponseError(f"unreadable answer from the engine: {reason}"))
            return
        if self._unparsed > _MAX_HEAD:
            self._fail(ResponseError("unreadable answer from the engine: head or trailers too large"))
            return
        if self._buffered > _HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def _feed(self, data: bytes | memoryview) -> None:
        self._progress = False
        self._parser.feed_data(data)
        self._unparsed = 0 if self._progress or self._state == _DONE else self._unparsed + len(data)

    def eof_received(self) -> bool | None:
        return None  # close the transport: connection_lost says what the end means

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.keep_alive = False
        if self._state == _BODY and exc is None and self._until_close():
            self._finish()  # a body without Content-Length or chunked framing ends when the engine closes
        elif self._state not in (_IDLE, _DONE) and self._exc is None:
            reason = f": {exc!r}" if exc is not None else ""
            self._exc = ResponseError(f"the engine closed the connection before the answer's end{reason}")
        self._wake()

    # The parser's side (httptools calls these).
    def on_message_begin(self) -> None:
        if self._state == _DONE:  # an engine that answered more than asked: do not reuse the connection
            self.keep_alive = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self._progress = True
        self._header_bytes += len(name) + len(value)
        if self._header_bytes > _MAX_HEAD:  # line after complete line: progress, but the head (or trailers) grows
            raise ValueError("head or trailers too large")
        if self._state != _HEAD:
            return  # a chunked body's trailers: skipped
        key, text = name.decode("latin-1").lower(), value.decode("latin-1")
        if key in self.headers:
            text = f"{self.headers[key]}, {text}"
        self.headers[key] = text

    def on_headers_complete(self) -> None:
        self._progress = True
        if self._state != _HEAD:
            return
        status = self._parser.get_status_code()
        if status < 100:  # llhttp reads any three digits: 'HTTP/1.1 000' is no answer (the driver would relay it)
            raise ValueError(f"status {status:03d} is not an HTTP status")
        if 100 <= status < 200:
            self._interim, self.headers = True, {}
            return
        self.status = status
        self.keep_alive = self._parser.should_keep_alive()
        self._state = _BODY

    def on_chunk_header(self) -> None:
        self._progress = True

    def on_chunk_complete(self) -> None:
        self._progress = True

    def on_body(self, body: bytes) -> None:
        self._progress = True
        if self._state == _BODY and body:
            self._chunks.append(body)
            self._buffered += len(body)

    def on_message_complete(self) -> None:
        self._progress = True
        if self._interim:
            self._interim = False
        elif self._state == _BODY:
            self._finish()

    # The request's side.
    @property
    def usable(self) -> bool:
        return self.transport is not None and self.keep_alive and not self.transport.is_closing()

    def send(self, data: bytes, deadline: float) -> None:
        if self.transport is None:
            raise ResponseError("the connection closed before the request was sent")
        self._state, self.status, self.headers, self._exc, self._unparsed = _HEAD, 0, {}, None, 0
        self._header_bytes, self.answered = 0, False
        self.keep_alive = False  # until the answer's head says otherwise
        self._timer = self._loop.call_at(deadline, self._timed_out)
        self.transport.write(data)

    async def head(self) -> None:
        while self._state == _HEAD and self._exc is None:
            # _wait's work, written out: a coroutine less per request (the answer's head is always waited for)
            waiter = self._waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None
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

    def _until_close(self) -> bool:
        """The answer's body has no framing but the connection's end (neither Content-Length nor chunked)."""
        return "content-length" not in self.headers and "transfer-encoding" not in self.headers


class Response:
    """An answer whose head has arrived: ``status``, ``headers`` (lower-case names), the body read once."""

    def __init__(self, origin: Origin, connection: _Connection) -> None:
        self._origin = origin
        self._connection: _Connection | None = connection
        self.status = connection.status
        self.headers = connection.headers

    async def read(self, limit: int = MAX_WHOLE_BODY) -> bytes:
        """The whole body, at most ``limit`` bytes: a larger answer (a buggy engine) is refused with
        ``AnswerTooLong`` (a ``ResponseError``) as soon as that shows, rather than held in memory; the connection is
        then dropped."""
        connection = self._connection
        if connection is None:
            raise ResponseError("the answer was released")
        length = self.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise AnswerTooLong(f"the engine's answer is {length} bytes, over the {limit} this client reads whole")
        body = connection.whole_body()
        if body is not None and len(body) <= limit:
            return body
        parts, size = ([body], len(body)) if body is not None else ([], 0)
        async for chunk in connection.body():
            size += len(chunk)
            parts.append(chunk)
            if size > limit:
                break
        if size > limit:
            raise AnswerTooLong(f"the engine's answer is over the {limit} bytes this client reads whole")
        return b"".join(parts)

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
        self._woken = 0  # waiters woken that have not yet taken their turn
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
            prefix = self._prefixes[key] = self.head_prefix(method, target, content_type)
        return head(prefix, headers, length)

    def head_prefix(self, method: str, target: str, content_type: str) -> bytes:
        """What every request's head of this method, target and content type starts with (for ``head``): made once
        by a caller that sends many."""
        line = f"{_check_line(method)} {_check_line(target)} HTTP/1.1\r\nHost: {self._authority}\r\n"
        return f"{line}Content-Type: {_check_line(content_type)}\r\n".encode("latin-1")

    async def request(self, head: bytes, body: bytes, timeout_s: float) -> Response:
        """Send one request (``head`` from ``request_head``) and return once its answer's head has arrived."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        # An idle connection, unless requests wait for one: they are served first (_new_connection).
        connection = None if self._waiters or self._woken else self._idle_connection(loop)
        kept_alive = connection is not None
        while True:  # the exchange written out here rather than in a coroutine of its own: a frame less to resume
            if connection is None:
                connection = await self._new_connection(loop, deadline)
            try:
                connection.send(head + body if len(body) < 65536 else head, deadline)
                if len(body) >= 65536 and connection.transport is not None:  # no copy of a large body
                    connection.transport.write(body)
                await connection.head()
            except ResponseError:
                self.put_back(connection)  # not complete: dropped
                # A kept-alive connection that ended before any byte of an answer: most likely the engine closed
                # it for its keep-alive timeout as the request arrived (vLLM's is 5 s, ours 15 s), which says
                # nothing of the replica. Once more, on a new connection (else the gateway tries another replica
                # and blames this one); a new connection that ends so is an error as before.
                if not kept_alive or connection.answered:
                    raise
                connection, kept_alive = None, False
                continue
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
        """Close the idle connections, and fail the requests waiting for one at once (``ResponseError``, the
        drivers' EngineUnavailable: tried elsewhere) rather than at their deadlines; a connection in use closes when
        its answer is done."""
        self._closed = True
        for connection in self._idle:
            connection.abort()
        self._open -= len(self._idle)
        self._idle.clear()
        while self._waiters:
            self._wake_one()

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
            raise ResponseError(_CLOSED)
        # At the limit, wait for a connection to come back or close; behind requests already waiting (or woken and
        # about to take what came back) in any case: one that arrived as a connection came back would otherwise
        # take it from the first waiter, which then waited again at the back (at a busy replica, at every turn).
        if self._open >= self._limit or self._waiters or self._woken > 0:
            try:
                async with asyncio.timeout_at(deadline):
                    connection = await self._wait_turn(loop)
            except TimeoutError as exc:
                raise ConnectionWaitTimeout(
                    f"no connection to the engine within the request's timeout: {self._limit} in use"
                ) from exc
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

    async def _wait_turn(self, loop: asyncio.AbstractEventLoop) -> _Connection | None:
        """Wait for a connection to come back (returned) or close (None: open one), behind the waiters before."""
        must_wait = True
        while must_wait:
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():  # woken, then gave up: pass the turn on
                    self._woken -= 1
                    self._wake_one()
                elif waiter in self._waiters:  # a wake may have taken the cancelled waiter off already
                    self._waiters.remove(waiter)
                raise
            self._woken -= 1
            if self._closed:
                raise ResponseError(_CLOSED)
            connection = self._idle_connection(loop)
            if connection is not None:
                return connection
            must_wait = self._open >= self._limit
        return None

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                self._woken += 1
                return


def head(prefix: bytes, headers: Mapping[str, str], length: int) -> bytes:
    """A request's head: ``prefix`` (``Origin.head_prefix``), ``headers`` (checked as ``request_head`` says) and the
    body's length."""
    if not headers:
        return prefix + b"Content-Length: %d\r\n\r\n" % length
    extra = "".join(f"{_check_line(name)}: {_check_line(value)}\r\n" for name, value in headers.items())
    return prefix + extra.encode("latin-1") + b"Content-Length: %d\r\n\r\n" % length


def _check_line(text: str) -> str:
    if "\r" in text or "\n" in text:
        raise ValueError(f"a line break in a request header: {text[:40]!r}")
    return text
