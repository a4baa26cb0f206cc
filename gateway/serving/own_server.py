"""The tenant listener's own HTTP/1.1 server for the inference routes; aiohttp's for everything else.

aiohttp's server builds, per request, a header multidict, a request and its stream reader, a writer and a
``StreamResponse`` with its prepare and end: about 120 k instructions a request of the gateway's ~520 k
(docs/benchmarks.md, "A server of its own for the inference routes"). This server parses a request's head with
httptools (llhttp, the parser aiohttp's C parser wraps too) and serves ``POST /v1/completions`` and
``/v1/chat/completions`` against ``Incoming`` (gateway/serving/incoming.py), writing answers' heads as bytes.

It serves only what it can serve simply, and hands the connection to aiohttp's handler (``GuardedHandler``, built
as aiohttp builds it) for anything else, with every byte received since the request began, so aiohttp parses,
judges and answers it exactly as it would have: another path or method (HEAD included), not HTTP/1.1, a head over
``MAX_HEAD`` bytes or with a bare line feed, more than ``MAX_HEADERS`` headers, ``Transfer-Encoding`` (chunked
bodies; with Content-Length beside it llhttp refuses it too), ``Expect`` (100-continue), ``Upgrade``,
``Content-Encoding``, no Content-Length or one over ``limits.max_body_bytes``, anything llhttp refuses (a repeated
Content-Length, a folded line, a bad name or value) and what aiohttp's parser refuses beyond llhttp (no Host, a
repeated singleton header such as Host or Content-Type, the old WebSocket key). A head split over reads is checked
as it comes: one that can no longer be served here (another request line, a bare LF, an llhttp error) is aiohttp's
at once, as aiohttp would refuse it at once. The hand-over happens only between requests (nothing of the
connection's is in flight), and is for good: the connection stays aiohttp's, its standing with the guard kept.

One difference, by design: aiohttp's parser takes a socket read whole, so good requests pipelined in the same read
as one it cannot parse are never served (only its 400 is answered); here the good ones are served and the bad one
handed over, which is what aiohttp answers when each request comes in a read of its own
(tests/gateway/serving/test_own_server.py holds both servers to the same answers, that case included).

What it keeps of aiohttp's behaviour: requests on a connection are served one after another in the connection's
own task (pipelined ones wait, unparsed, and reading pauses past ``PIPELINE_BYTES``); keep-alive as llhttp reads
it (``Connection: close`` answered with ``Connection: close`` and the connection closed after the answer); a
request answered before its body has all arrived has the rest read after the answer, as aiohttp's lingering read
does (up to aiohttp's ``lingering_time``; then the connection goes on, or closes if the body did not come); a client
that goes away cancels its request (the engine's request with it); aiohttp's keep-alive timer (a backstop behind the
guard's idle rule) and TCP keep-alive; answers carry aiohttp's Date and Server headers, streams are chunked as
aiohttp chunks them, each write waiting while the transport's buffer is full; at shutdown the connections drain
beside aiohttp's, within the one ``shutdown.drain_timeout_s`` (``OwnSite``). Every rule of the connection guard
(gateway/serving/connections.py) holds: the guard sees these connections as it sees aiohttp's (the head's deadline,
the body's rate, the read count's ``fragmented``, idle, the caps and authentication); ``body_framing`` has nothing
to weigh here (Content-Length bodies only).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import re
import socket
from collections.abc import Iterator, Mapping
from http import HTTPStatus
from typing import Any

import httptools
from aiohttp import web
from aiohttp.helpers import rfc822_formatted_time
from aiohttp.http import SERVER_SOFTWARE
from aiohttp.tcp_helpers import tcp_keepalive
from aiohttp.web_protocol import RequestHandler

from gateway.appkeys import METRICS, STATE, TELEMETRY
from gateway.errors import GatewayError
from gateway.serving import ingress
from gateway.serving.connections import ConnectionGuard, GuardedHandler, GuardedSite
from gateway.serving.json_body import RefusedInput
from gateway.serving.openai_request import Kind
from gateway.serving.whole_answer import VARIANT_HEADER, plain_header_value

log = logging.getLogger(__name__)
errors_log = logging.getLogger("gateway.app")  # where error_answers.py writes its lines

_KINDS: dict[bytes, Kind] = {b"/v1/completions": "completions", b"/v1/chat/completions": "chat"}
# The request lines it serves: a head that has not all arrived yet is aiohttp's at once if its start is none of them.
_LINES = tuple(b"POST %b HTTP/1.1\r\n" % path for path in _KINDS)
# What aiohttp's request parser refuses beyond llhttp (aiohttp/_http_parser.pyx, 3.14): a repeated header of RFC
# 9110's singletons, an HTTP/1.1 request without Host, the old WebSocket handshake's key.
SINGLETONS = (
    b"content-length", b"content-location", b"content-range", b"content-type", b"etag", b"host", b"max-forwards",
    b"server", b"transfer-encoding", b"user-agent",
)  # fmt: skip
# The headers whose presence hands a request over: what aiohttp's server does more than read (Expect's 100-continue,
# a body's decoding, chunked bodies, a protocol switch) and the old WebSocket key it refuses.
_HANDED_OVER = frozenset({b"expect", b"content-encoding", b"transfer-encoding", b"upgrade", b"sec-websocket-key1"})
# Every header name a served head is checked for, found in one scan of its lower-cased bytes (a name is found only
# at a line's start: after CRLF, before its colon, which llhttp allows no space before).
_NOTED = re.compile(b"\r\n(" + b"|".join(sorted({*SINGLETONS, *_HANDED_OVER})) + b"):")
# aiohttp's max_line_size and max_field_size: a longer head is aiohttp's to judge (and refuse).
MAX_HEAD = 8190
MAX_HEADERS = 64
# Bytes of pipelined requests held, unparsed, behind the one being served before reading pauses.
PIPELINE_BYTES = 262_144
_SERVER = f"Date: %s\r\nServer: {SERVER_SOFTWARE}\r\n"
_FAULT = GatewayError("The gateway failed to handle the request.")
# aiohttp's handler settings where the server's arguments leave them out (keep-alive timeout, TCP keep-alive,
# lingering time): the own connections apply them as aiohttp's handler would.
_HANDLER_DEFAULTS = {
    name: parameter.default for name, parameter in inspect.signature(RequestHandler.__init__).parameters.items()
}
# How long shutdown waits for the requests it cancelled to unwind (their leases and telemetry) after the drain.
_CANCELLED_GRACE_S = 5.0
# Statuses whose answer has no body (aiohttp's must_be_empty_body for a POST): an engine's 204 is relayed bare.
_EMPTY_BODY = frozenset({204, 304})


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


_status_lines: dict[int, bytes] = {}


def _status_line(status: int) -> bytes:
    line = _status_lines.get(status)
    if line is None:
        line = _status_lines[status] = f"HTTP/1.1 {status} {_reason(status)}\r\n".encode()
    return line


_tails: list[Any] = [None, b"", b""]  # aiohttp's date string (one object a second), and the two tails made with it


def _tail(keep_alive: bool) -> bytes:
    """The head's last lines: aiohttp's Date and Server, ``Connection: close`` where the connection ends."""
    date = rfc822_formatted_time()
    if date is not _tails[0]:
        tail = (_SERVER % date).encode()
        _tails[:] = [date, tail + b"\r\n", tail + b"Connection: close\r\n\r\n"]
    chosen: bytes = _tails[1] if keep_alive else _tails[2]
    return chosen


_keys: dict[str, bytes] = {}  # a header's name -> what starts its line in a lower-cased head


def _key(name: str) -> bytes:
    key = _keys.get(name)
    if key is None:
        key = b"\r\n" + name.lower().encode("latin-1") + b":"
        if len(_keys) < 256:  # names come from the code and the config: a few
            _keys[name] = key
    return key


class Head(Mapping[str, str]):
    """A request's headers, read from its head's bytes as they are looked up (names in any case; a repeated
    header's first value, as aiohttp's ``get`` gives it; ``getall`` every value). llhttp has checked the head: each
    header line is ``name:value`` with optional whitespace around the value, no line folded. Looking a few names up
    costs less than building a dict of every header through a parser callback per header (about 4 k instructions
    each, callgrind)."""

    __slots__ = ("_head", "low")

    def __init__(self, head: bytes) -> None:
        self._head = head  # up to the blank line's first CRLF: every line ends with CRLF
        self.low = head.lower()  # ASCII only: offsets stay the head's

    def get(self, name: str, default: Any = None) -> Any:
        # One Python frame per lookup (this one): the key's bytes cached, the value cut out here.
        key = _keys.get(name) or _key(name)
        at = self.low.find(key)
        if at < 0:
            return default
        head, start = self._head, at + len(key)
        return head[start : head.index(b"\r\n", start)].strip(b" \t").decode("utf-8", "surrogateescape")

    def getall(self, name: str, default: Any = None) -> Any:
        key, low, values = _key(name), self.low, []
        at = low.find(key)
        while at >= 0:
            start = at + len(key)
            end = self._head.index(b"\r\n", start)
            values.append(self._head[start:end].strip(b" \t").decode("utf-8", "surrogateescape"))
            at = low.find(key, start)
        return values or default

    def __getitem__(self, name: str) -> str:
        value: str | None = self.get(name)
        if value is None:
            raise KeyError(name)
        return value

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and _key(name) in self.low

    def __iter__(self) -> Iterator[str]:
        head = self._head
        for line in head[head.index(b"\r\n") + 2 :].split(b"\r\n"):
            if line:
                yield line.partition(b":")[0].decode("latin-1")

    def __len__(self) -> int:
        return self._head.count(b"\r\n") - 1


class OwnStream:
    """A chunked streamed answer on an ``OwnConnection`` (``Stream``)."""

    __slots__ = ("_connection",)

    def __init__(self, connection: OwnConnection) -> None:
        self._connection = connection

    async def write(self, data: bytes) -> None:
        if not data:  # an empty chunk would end the stream
            return
        connection = self._connection
        transport = connection.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        if connection.write_paused:
            await connection.drain()

    async def write_eof(self) -> None:
        connection = self._connection
        transport = connection.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        transport.write(b"0\r\n\r\n")
        if connection.write_paused:
            await connection.drain()


class OwnRequest:
    """One inference request on an ``OwnConnection`` (``Incoming``)."""

    __slots__ = ("_body_waiter", "_connection", "body", "headers", "keep_alive", "kind", "started")

    def __init__(self, connection: OwnConnection, headers: Head, kind: Kind, keep_alive: bool) -> None:
        self._connection = connection
        self.headers: Mapping[str, str] = headers
        self.kind: Kind = kind
        self.keep_alive = keep_alive
        self.body: bytes | None = None
        self._body_waiter: asyncio.Future[bytes] | None = None
        # Whether an answer's head went out (an error after it cannot be answered).
        self.started = False

    @property
    def remote(self) -> str | None:
        transport = self._connection.transport
        peer = transport.get_extra_info("peername") if transport is not None else None
        return str(peer[0]) if isinstance(peer, (tuple, list)) and peer else None

    @property
    def transport(self) -> asyncio.Transport | None:
        return self._connection.transport

    def body_in(self) -> bool:
        return self.body is not None

    def body_now(self) -> bytes | None:
        return self.body

    async def read_body(self) -> bytes:
        if self.body is not None:
            return self.body
        waiter = self._body_waiter = asyncio.get_running_loop().create_future()
        body: bytes = await waiter
        return body

    def arrived(self, body: bytes) -> None:
        self.body = body
        waiter = self._body_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(body)

    def authenticated(self) -> None:
        self._connection.guard.authenticated(self._connection)

    def _keep(self) -> bool:
        """Whether the connection goes on after this answer: the client asked for it and the server is not closing
        (a body still coming is read after the answer, as aiohttp's lingering read does: OwnConnection._linger)."""
        keep = self.keep_alive = self.keep_alive and not self._connection.closing
        return keep

    async def answer(self, status: int, body: bytes, variant: str | None) -> bool:
        connection = self._connection
        transport = connection.transport
        if transport is None or transport.is_closing():
            return False
        if not plain_header_value(variant):  # as aiohttp refuses such a header value: an error, nothing written
            raise ValueError("Newline or NUL character in the variant header's value")
        self.started = True
        # _status_line, _tail and _keep inline: the one answer of nearly every request, three frames less.
        line = _status_lines.get(status) or _status_line(status)
        keep = self.keep_alive = self.keep_alive and not connection.closing
        date = rfc822_formatted_time()
        if date is not _tails[0]:
            _tail(keep)
        variant_line = b"" if variant is None else f"{VARIANT_HEADER}: {variant}\r\n".encode()
        if status in _EMPTY_BODY or status < 200:  # no body, no length: as aiohttp answers such a status
            transport.write(b"%b%bContent-Type: application/json\r\n%b" % (line, variant_line, _tail(keep)))
            return True
        transport.write(
            b"%b%bContent-Type: application/json\r\nContent-Length: %d\r\n%b%b"
            % (line, variant_line, len(body), _tails[1] if keep else _tails[2], body)
        )
        return True

    async def stream(self, status: int, headers: Mapping[str, str]) -> OwnStream:
        transport = self._connection.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        if not all(plain_header_value(value) for value in headers.values()):
            raise ValueError("Newline or NUL character in a header's value")
        self.started = True
        lines = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        transport.write(
            b"%b%bTransfer-Encoding: chunked\r\n%b" % (_status_line(status), lines.encode(), _tail(self._keep()))
        )
        return OwnStream(self._connection)

    def error(self, exc: Exception, app: web.Application) -> None:
        """Answer what the handler raised, as error_answers.py answers it on aiohttp's server."""
        path = "/v1/completions" if self.kind == "completions" else "/v1/chat/completions"
        if isinstance(exc, RefusedInput):
            app[METRICS].refused_inputs.labels("tenant", exc.reason).inc()
            if not app[TELEMETRY].access_log:  # else its access line says it
                errors_log.info("refused POST %s (%s): %s", path, exc.reason, exc.message[:200])
        elif not isinstance(exc, GatewayError):
            errors_log.error("unhandled error on POST %s", path, exc_info=exc)
            exc = _FAULT
        transport = self._connection.transport
        if transport is None or transport.is_closing():
            return
        self.started = True
        body = json.dumps(exc.body()).encode()  # as web.json_response writes it
        extra = "".join(f"{name}: {value}\r\n" for name, value in exc.headers.items()).encode()
        transport.write(
            b"%b%bContent-Type: application/json; charset=utf-8\r\nContent-Length: %d\r\n%b%b"
            % (_status_line(exc.status), extra, len(body), _tail(self._keep()), body)
        )


class _NoCallbacks:
    """A parser's protocol with no callbacks: llhttp only checks what it is fed."""


_NO_CALLBACKS = _NoCallbacks()


class OwnServer:
    """What the tenant listener's connections share: the app, the guard, aiohttp's handler settings (a connection
    handed over gets aiohttp's handler built as aiohttp builds it; the own connections keep its keep-alive timer,
    TCP keep-alive and lingering time), and the connections themselves (drained at shutdown)."""

    def __init__(self, app: web.Application, guard: ConnectionGuard, server: web.Server, max_body: int) -> None:
        self.app = app
        self.guard = guard
        self.server = server
        self.max_body = max_body
        kwargs = server._kwargs
        self.keepalive_timeout_s: float = kwargs.get("keepalive_timeout", _HANDLER_DEFAULTS["keepalive_timeout"])
        self.tcp_keepalive: bool = kwargs.get("tcp_keepalive", _HANDLER_DEFAULTS["tcp_keepalive"])
        self.lingering_time_s: float = kwargs.get("lingering_time", _HANDLER_DEFAULTS["lingering_time"])
        self.connections: set[OwnConnection] = set()
        self.closing = False
        self._none_left: asyncio.Event | None = None

    def left(self, connection: OwnConnection) -> None:
        """``connection`` is closed or aiohttp's now."""
        self.connections.discard(connection)
        if not self.connections and self._none_left is not None:
            self._none_left.set()

    def aiohttp_handler(self) -> GuardedHandler:
        return GuardedHandler(self.guard, self.server, loop=asyncio.get_running_loop(), **self.server._kwargs)

    async def shutdown(self, timeout_s: float) -> None:
        """Close idle connections, let the requests in flight finish within ``timeout_s`` (each connection closes
        after its answer), then close what is left and wait for its request to end (cancelled)."""
        self.closing = True
        none_left = self._none_left = asyncio.Event()
        for connection in list(self.connections):
            connection.close_when_idle()
        if self.connections:
            try:
                async with asyncio.timeout(timeout_s):
                    await none_left.wait()
            except TimeoutError:
                pass
        tasks = [connection.task for connection in self.connections if connection.task is not None]
        for connection in list(self.connections):
            connection.force_close()
        for task in tasks:
            task.cancel()
        if tasks:  # a cancelled request's own cleanup (its lease, its telemetry) before the fleet closes
            await asyncio.wait(tasks, timeout=_CANCELLED_GRACE_S)


class OwnConnection(asyncio.Protocol):
    """One client connection of the tenant listener, served by ``OwnServer`` until it is handed to aiohttp."""

    def __init__(self, server: OwnServer) -> None:
        self._server = server
        self.guard = server.guard
        self.transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self._buffer = bytearray()
        # Where the socket reads of what is in the buffer ended, counted from the connection's first byte, and how
        # many bytes were taken off the buffer's front so far: a hand-over gives aiohttp's handler the bytes read by
        # read, as it would have had them (its 400s quote the read that held the fault).
        self._read_ends: list[int] = []
        self._taken = 0
        self._parser = httptools.HttpRequestParser(self)
        # A head split over reads, as checked so far (_may_be_served): llhttp's state and how many bytes it has seen.
        self._head_parser: httptools.HttpRequestParser | None = None
        self._head_checked = 0
        # The request being served, the bytes its body still needs (None: all in), the connection's task and what
        # it waits on between requests.
        self._request: OwnRequest | None = None
        self._wanting: int | None = None
        self.task: asyncio.Task[None] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._read_paused = False
        self.closing = False
        # aiohttp's keep-alive timer (a backstop behind the guard's idle rule): one handle, moved on when it fires
        # early rather than re-armed per request, as aiohttp's _process_keepalive does.
        self._keepalive_handle: asyncio.TimerHandle | None = None
        # What the guard reads (as GuardedHandler's).
        self.opened_at = 0.0
        self.idle_since = 0.0
        self.first_byte_at: float | None = None
        self.current: OwnRequest | None = None
        self.head_at = 0.0
        self.requests = 0
        self.reads = 0
        self.read_bytes = 0

    # --- the guard's view ---------------------------------------------------------------------------------------
    def body_coming(self) -> int | None:
        """The bytes of the current request's body received so far while the rest is still coming, else None."""
        return None if self._wanting is None else len(self._buffer)

    def force_close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def close_when_idle(self) -> None:
        self.closing = True
        if self._request is None:
            self.force_close()

    # --- asyncio.Protocol -----------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio's classes
        server = self._server
        if server.tcp_keepalive:  # as aiohttp's handler does: the kernel finds a peer that vanished
            tcp_keepalive(self.transport)  # type: ignore[arg-type]
        self.opened_at = self.idle_since = now = self.guard.now()
        server.connections.add(self)
        self.guard.opened(self)
        if server.closing:  # accepted as the listener closed: nothing more is served
            self.force_close()
            return
        if server.keepalive_timeout_s > 0:  # aiohttp arms it at once: a connection that never sends a request
            self._keepalive_handle = self._loop.call_at(now + server.keepalive_timeout_s, self._keepalive_due)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.transport = None
        self._server.left(self)
        self.guard.lost(self)
        if self._keepalive_handle is not None:
            self._keepalive_handle.cancel()
            self._keepalive_handle = None
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the request in flight (and its engine request) with it
        drain = self._drain_waiter
        if drain is not None and not drain.done():
            drain.set_exception(ConnectionResetError("Connection lost"))

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        drain = self._drain_waiter
        if drain is not None and not drain.done():
            drain.set_result(None)

    async def drain(self) -> None:
        if not self.write_paused:
            return
        if self.transport is None:
            raise ConnectionResetError("Connection lost")
        waiter = self._drain_waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._drain_waiter = None

    def data_received(self, data: bytes) -> None:
        if self.current is None and self.first_byte_at is None:
            self.first_byte_at = self.guard.now()
        if not self.guard.read(self, len(data)):
            return
        buffer = self._buffer
        buffer += data
        if self._wanting is not None:
            self._body_progress()
            return
        self._read_ends.append(self._taken + len(buffer))
        if self._request is None:
            self._next_head()
        elif len(buffer) > PIPELINE_BYTES and not self._read_paused and self.transport is not None:
            self._read_paused = True
            self.transport.pause_reading()

    def _keepalive_due(self) -> None:
        """aiohttp's keep-alive timeout: a connection with no request in progress for that long is closed."""
        self._keepalive_handle = None
        if self.transport is None:
            return
        if self._request is not None:  # busy: re-armed when it goes idle
            return
        close_at = self.idle_since + self._server.keepalive_timeout_s
        if self._loop.time() < close_at:  # a request came and went since it was armed
            self._keepalive_handle = self._loop.call_at(close_at, self._keepalive_due)
            return
        self.force_close()

    # --- framing ----------------------------------------------------------------------------------------------------
    def _next_head(self) -> None:
        """Parse the next request's head if it has all arrived: serve it, or hand the connection to aiohttp. Only
        between requests: pipelined bytes wait in the buffer while one is served."""
        buffer = self._buffer
        if not buffer or self._request is not None or self.transport is None:
            return
        end = buffer.find(b"\r\n\r\n")
        if end < 0:  # not all in: aiohttp's now if it is too long, not a request line served here, or has a bare LF
            if len(buffer) > MAX_HEAD or not self._may_be_served(buffer):
                self._hand_over()
            return
        size = end + 4
        head = bytes(buffer[: end + 2])  # every line with its CRLF, not the blank one
        line_end = head.find(b"\r\n")
        request_line = head[:line_end].split(b" ")
        kind = _KINDS.get(request_line[1]) if len(request_line) == 3 else None
        if (
            kind is None  # the common refusals first: before the parser has seen the head
            or request_line[0] != b"POST"
            or request_line[2] != b"HTTP/1.1"
            or size > MAX_HEAD
            or head.count(b"\n") > MAX_HEADERS + 1  # llhttp refuses a bare LF: every line ends with CRLF
        ):
            self._hand_over()
            return
        parser = self._parser
        try:
            parser.feed_data(buffer[:size])  # llhttp checks the head (and, fed the body later, stays in step)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):  # the latter is no HttpParserError
            self._hand_over()
            return
        headers = Head(head)
        noted = _NOTED.findall(headers.low)  # one scan for every header name that decides (C, not a loop here)
        length = headers.get("content-length")
        if (
            # No Content-Length: chunked (llhttp refuses Transfer-Encoding beside Content-Length) or no body.
            length is None  # (llhttp checked it is digits when it is there)
            or len(noted) != len(set(noted))  # a singleton repeated: aiohttp's 400
            or b"host" not in noted  # no Host: aiohttp's 400
            or not _HANDED_OVER.isdisjoint(noted)  # Expect, Content-Encoding, Transfer-Encoding, Upgrade...
            # Leading zeros stripped: llhttp takes any number of them, int() no more than 4,300 digits (it raised).
            or (wanting := int(length.lstrip("0") or "0")) > self._server.max_body
        ):
            self._hand_over()
            return
        del buffer[:size]
        self._head_parser, self._head_checked = None, 0  # the next head split over reads is checked from its start
        request = self._request = self.current = OwnRequest(self, headers, kind, parser.should_keep_alive())
        self.head_at, self.first_byte_at = self.guard.now(), None
        self.requests += 1
        self.reads = self.read_bytes = 0
        if len(buffer) >= wanting:  # the whole body is in (the usual case): _body_progress inline
            body = bytes(buffer[:wanting])
            del buffer[:wanting]
            self._taken += size + wanting
            if body:
                parser.feed_data(body)
            request.body = body
        else:
            self._taken += size
            self._wanting = wanting
        if not buffer:
            self._read_ends.clear()
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            waiter.set_result(None)
        elif self.task is None:
            self.task = self._loop.create_task(self._serve())

    def _may_be_served(self, buffer: bytearray) -> bool:
        """Whether a head not all in yet (a head split over reads: rare) may still be one served here: it starts as
        a served request line does, has no bare LF, and llhttp finds nothing wrong in it so far (a parser of its own:
        the connection's is fed whole heads only). Else it is aiohttp's at once, which answers what it refuses as
        soon as it sees it; waiting for the rest would only delay that. Only the bytes new since the last check are
        looked at: each read re-checking the whole head cost a head sent in 64-byte reads (as ``fragmented``
        allows) 0.85 ms of llhttp for 8 KB, four times a whole request's cost, from a client with no key."""
        start = bytes(buffer[:36])
        if not any(line.startswith(start[: len(line)]) for line in _LINES):
            return False
        checked = self._head_checked
        # A bare LF among the new bytes (a CRLF whose CR came in the last check's bytes counts as new).
        new = buffer[checked:]
        if new.count(b"\n") != buffer.count(b"\r\n", max(0, checked - 1)):
            return False
        parser = self._head_parser
        if parser is None:
            parser = self._head_parser = httptools.HttpRequestParser(_NO_CALLBACKS)
        self._head_checked = len(buffer)
        try:
            parser.feed_data(new)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            return False
        return True

    def _body_progress(self) -> None:
        request, wanting, buffer = self._request, self._wanting, self._buffer
        assert request is not None and wanting is not None
        if len(buffer) < wanting:
            return
        body = bytes(buffer[:wanting])
        del buffer[:wanting]
        self._taken += wanting
        self._wanting = None
        if buffer:  # the rest of the read: the next request's first bytes
            self._read_ends.append(self._taken + len(buffer))
        self.reads = self.read_bytes = 0  # what comes next is the next request's head
        if body:
            self._parser.feed_data(body)  # llhttp frames it as this did (Content-Length, no Transfer-Encoding)
        request.arrived(body)
        if self._buffer and self.first_byte_at is None and self.current is None:
            self.first_byte_at = self.guard.now()

    def _hand_over(self) -> None:
        """The connection is aiohttp's from here: its handler gets every byte since the request began, and the
        guard's view of it carries over (when it opened, when this request's first byte came, its key)."""
        transport = self.transport
        if transport is None:
            return
        handler = self._server.aiohttp_handler()
        authenticated = self not in self.guard.unauthenticated
        self._server.left(self)
        self.guard.lost(self)
        self.transport = None
        if self._keepalive_handle is not None:
            self._keepalive_handle.cancel()
            self._keepalive_handle = None
        transport.set_protocol(handler)
        handler.connection_made(transport)
        if handler.transport is None:  # the guard refused it (over the connection cap): closed
            return
        handler.opened_at, handler.first_byte_at = self.opened_at, self.first_byte_at or self.guard.now()
        handler.requests = self.requests
        if authenticated:
            self.guard.authenticated(handler)
        if self.write_paused:  # the transport told this protocol, not aiohttp's: tell it
            handler.pause_writing()
        if self._read_paused:
            transport.resume_reading()
        data = bytes(self._buffer)
        self._buffer.clear()
        waiter = self._waiter
        if waiter is not None:  # the connection's task waits for a request that will never come: let it end
            self._waiter = None
            waiter.set_result(None)
        start = 0
        for end in self._read_ends:  # read by read, as aiohttp's handler would have had them
            end -= self._taken
            if start < end <= len(data) and handler.transport is not None:
                handler.data_received(data[start:end])
                start = end
        if start < len(data) and handler.transport is not None:
            handler.data_received(data[start:])

    # --- serving ------------------------------------------------------------------------------------------------------
    async def _serve(self) -> None:
        """The connection's task: its requests, one after another. Nothing a request raises ends it but the
        connection's loss (then the task is cancelled) or its close; a fault of this server's own closes the
        connection, never more."""
        app = self._server.app
        try:
            while self.transport is not None:
                request = self._request
                if request is None:
                    waiter = self._waiter = self._loop.create_future()
                    await waiter
                    continue
                failed = False
                try:
                    await ingress.inference(request, app, request.kind)
                except (asyncio.CancelledError, ConnectionResetError):
                    self.force_close()
                    raise
                except Exception as exc:
                    if request.started:  # an answer began: nothing more can be said on this connection
                        log.exception("request failed after its answer began")
                        request.keep_alive, failed = False, True
                    else:
                        request.error(exc, app)
                if self._wanting is not None and not failed and not self.closing:
                    await self._linger(request)  # even before a close: the client reads its answer, not a reset
                if not request.keep_alive or self.transport is None or self.closing:
                    self.force_close()
                    return
                if self.write_paused:  # the answer taken before the next request is read
                    # The request is done: the connection is idle while its client takes the answer, as on aiohttp's
                    # server (where this wait comes after the request has ended), so the guard's idle rule holds.
                    self.current, self.idle_since = None, self.guard.now()
                    await self.drain()
                self._request = self.current = None
                self.idle_since = self.guard.now()
                self.reads = self.read_bytes = 0
                if self._buffer:  # the next request's first bytes came while this one was served
                    self.first_byte_at = self.idle_since
                if self._keepalive_handle is None and self._server.keepalive_timeout_s > 0:
                    self._keepalive_handle = self._loop.call_at(
                        self.idle_since + self._server.keepalive_timeout_s, self._keepalive_due
                    )
                if self._read_paused and self.transport is not None:
                    self._read_paused = False
                    self.transport.resume_reading()
                self._next_head()
        except ConnectionResetError:  # the client left while its answer was taken or its body read
            self.force_close()
        except Exception:
            log.exception("the gateway's own server failed on a connection: closing it")
            self.force_close()

    async def _linger(self, request: OwnRequest) -> None:
        """A request answered before its body had all arrived: read the rest, as aiohttp's lingering read does (up to
        its ``lingering_time``, the guard's body rate holding meanwhile), so the connection can carry the next
        request and the client, still sending, is not reset before it has read its answer. A body that does not
        come in time closes the connection."""
        lingering_s = self._server.lingering_time_s
        if lingering_s > 0:
            try:
                async with asyncio.timeout(lingering_s):
                    await request.read_body()
            except TimeoutError:
                pass
        if self._wanting is not None:
            request.keep_alive = False


class OwnSite(GuardedSite):
    """The tenant listener with the own server: its connections are ``OwnConnection``s of one ``OwnServer``. Its
    stop closes the listener and begins the own connections' drain; with ``drains`` (the runner's:
    ``GatewayRunner.drains``) the drain is left to run beside aiohttp's (the runner awaits both before the app's
    cleanup closes the fleet they are served by), so the two kinds of connection drain within one
    ``drain_timeout_s``, not one after the other; without it the stop awaits the drain itself."""

    def __init__(
        self,
        runner: web.AppRunner,
        guard: ConnectionGuard,
        host: str,
        port: int,
        sock: socket.socket | None = None,
        drain_timeout_s: float = 60.0,
        drains: list[asyncio.Task[None]] | None = None,
    ) -> None:
        super().__init__(runner, guard, host, port, sock)
        self._drain_timeout_s = drain_timeout_s
        self._drains = drains
        self.own: OwnServer | None = None

    def connection(self, server: web.Server) -> OwnConnection:  # type: ignore[override]
        own = self.own
        if own is None:
            runner = self._runner
            assert isinstance(runner, web.AppRunner)
            app = runner.app
            own = self.own = OwnServer(app, self._guard, server, app[STATE].config.limits.max_body_bytes)
        return OwnConnection(own)

    async def stop(self) -> None:
        await super().stop()
        if self.own is None:
            return
        drain = asyncio.create_task(self.own.shutdown(self._drain_timeout_s), name="own server drain")
        if self._drains is not None:
            self._drains.append(drain)
        else:
            await drain
