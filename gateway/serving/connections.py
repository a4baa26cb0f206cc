"""Slow and idle clients cost nothing: deadlines and caps on the tenant listener's connections.

aiohttp's server has one client-side timer, the keep-alive timeout (an hour by default), and it stops as soon as a
byte arrives: a client that sends half a header, or a body one byte a minute, holds its connection (and a file
descriptor) for ever. This layer adds, per connection (``listen.*`` in the config; defaults in the README):

- **request line and headers**: a new connection, or the next request on a kept-alive one once its first byte has
  come, must have sent its whole head within ``header_timeout_s``;
- **body rate**: once the head is in, the body must arrive at ``min_body_bytes_per_s`` on average from its start,
  after a grace of ``body_grace_s`` (a large prompt on a slow link is legitimate; a trickle is not);
- **body framing**: the bytes received for a body may exceed the body's own by a quarter and ``FRAMING_SLACK_BYTES``
  (chunked encoding's framing, a few bytes a chunk); past that the connection is closed (``body_framing``). aiohttp's
  parser hands each chunk to the request's stream, a Python call each: a 1 MB body in 1-byte chunks (6 MB on the
  wire) took ~0.7 s of the event loop, ~10,000 chunks per socket read, from anyone (a request answered before its
  body was read, a 401, still reads the rest: aiohttp lingers);
- **reads**: a request's head, and then its body, may take ``READ_SLACK`` socket reads and one more for every
  ``MIN_BYTES_PER_READ`` bytes; past that the connection is closed (``fragmented``). Each read is a Python call
  into aiohttp's parser of a few microseconds whatever its size, so a client that sends its bytes one TCP segment
  at a time (a request head in 8,000 segments, then the next, each answered 401) made the gateway pay per byte
  (200 such connections took about 69% of a core, measured in review). A real client's head comes in one or two
  reads, its body in reads of a few kilobytes (a socket read takes all that has arrived);
- **idle keep-alive**: a connection with no request for ``idle_timeout_s`` is closed (aiohttp's own keep-alive
  timer is set a little longer, as a backstop: ``keepalive_timeout``);
- **caps**: at most ``max_connections`` open (never more than half the process's file limit: the rest is for the
  engines, Redis and the listening sockets); a newcomer over it is closed at once. At most
  ``max_unauthenticated_connections`` that have not yet presented a valid key: a newcomer over it closes the
  oldest of them (a stalled client is the oldest; a real one presents its key within milliseconds), so stalled
  clients cannot lock real ones out.
Each close is counted in ``tenantgate_client_connections_closed_total{reason}``.

A tenant's bodies being read count against its concurrency (``Admission.reading_body``, in ingress).

How it hooks in, and why it is pinned to aiohttp 3.14 (pyproject: >=3.14,<3.15): ``GuardedSite`` is aiohttp's
``TCPSite`` (through ``HandlerSite``, which the operator listener's site shares) whose protocol factory builds
``GuardedHandler``, a ``RequestHandler`` subclass (through ``InlineRequestHandler``, whose connection loop runs each
request in the connection's task: gateway/serving/inline_requests.py) that only adds bookkeeping around its protocol
methods (``connection_made``, ``data_received``, ``connection_lost``) and closes with ``force_close``. Two private parts
are read: the server's handler arguments (``Server._kwargs``, to build a handler as ``Server.__call__`` does) and
``TCPSite``'s own fields in ``start``; ``InlineRequestHandler`` is aiohttp's connection loop, copied. The request's
phase comes from an outermost middleware (``request_began``, in gateway/app.py's ``front``; ``phases`` is it as a
middleware of its own), and a request's body progress from ``request.content.total_bytes`` (bytes received so far). One
sweeper task checks every connection a few times per deadline.
tests/gateway/serving/test_slow_clients.py exercises each rule against a real server (test_inline_requests.py the
connection loop): run them when aiohttp moves. On the gateway the tenant listener is ``OwnSite``
(gateway/serving/own_server.py): its connections are the gateway's own server's until one is handed to
``GuardedHandler``; the guard sees both through ``Guarded``, and tests/gateway/serving/test_own_server.py runs each
rule through an inference route on the own server.
A connection counts as authenticated once a request on it presented a valid tenant key, the admin token or a
status-page session; probes and metric scrapes never do, so they count as unauthenticated while open.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import StreamReader, web
from aiohttp.web_protocol import RequestHandler

from gateway.config import ListenConfig
from gateway.error_answers import unparsable_answer
from gateway.observe.metrics import GatewayMetrics
from gateway.serving.inline_requests import InlineRequestHandler
from gateway.tasks import cancel_and_wait

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def keepalive_timeout(config: ListenConfig) -> float:
    """aiohttp's own keep-alive timer: a backstop a little after the guard's idle deadline (which counts the close)."""
    return config.idle_timeout_s + 5.0


# What a body's framing may add to it: a quarter of the body, and this much (chunk sizes, line ends, extensions of a
# body sent in chunks of a few dozen bytes or more; a socket read's worth of anything).
FRAMING_SLACK_BYTES = 65_536
FRAMING_SHARE = 1.25
# The socket reads a request's head or body may take: this many, and one more per this many bytes in them.
READ_SLACK = 64
MIN_BYTES_PER_READ = 64


class Guarded(Protocol):
    """A connection as the guard sees it: aiohttp's (``GuardedHandler``) or the own server's
    (gateway/serving/own_server.py). Between requests ``current`` is None; ``first_byte_at`` is when the next
    request's first byte came (None: none yet)."""

    opened_at: float
    idle_since: float
    first_byte_at: float | None
    head_at: float
    requests: int
    # The socket reads and their bytes since the head, or the body, began to come (``READ_SLACK``).
    reads: int
    read_bytes: int

    @property
    def current(self) -> object | None: ...

    @property
    def transport(self) -> asyncio.Transport | None: ...

    def body_coming(self) -> int | None:
        """The bytes of the current request's body received so far while the rest is still coming, else None."""
        ...

    def force_close(self) -> None: ...


class GuardedHandler(InlineRequestHandler):
    """aiohttp's request handler (one per connection) with what the guard needs to know about it."""

    def __init__(self, guard: ConnectionGuard, server: web.Server, **kwargs: Any) -> None:
        super().__init__(server, **kwargs)
        self.guard = guard
        self.opened_at = 0.0
        # Between requests: when the connection fell idle, and when the next request's first byte came (None: none
        # yet). During a request: the request, and when its head was in.
        self.idle_since = 0.0
        self.first_byte_at: float | None = None
        self.current: web.BaseRequest | None = None
        self.head_at = 0.0
        self.requests = 0
        # The body being received (until its end, after its request was answered too), the bytes received since, and
        # the body's bytes already parsed when counting began (the rest of the read that held the request's head):
        # framing is weighed against the body received since, or that first read's body would widen the allowance
        # by ten times its size at 1-byte-chunk framing.
        self.receiving: StreamReader | None = None
        self.received = 0
        self.body_before = 0
        # The socket reads and their bytes since the head, or the body, began to come (``READ_SLACK``).
        self.reads = 0
        self.read_bytes = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.opened_at = self.idle_since = self.guard.now()
        self.guard.opened(self)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.guard.lost(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if data and self.current is None and self.first_byte_at is None:
            self.first_byte_at = self.guard.now()
        # aiohttp calls this with b"" itself to go on parsing what it had paused on: not a read
        if data and not self.guard.read(self, len(data)):
            return
        super().data_received(data)
        body = self.receiving
        if body is not None:
            self.received += len(data)
            if body.is_eof():
                self.receiving = None
            elif self.received > FRAMING_SLACK_BYTES + FRAMING_SHARE * (body.total_bytes - self.body_before):
                self.receiving = None
                self.guard.close(self, "body_framing")

    def handle_error(
        self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        """aiohttp's answer to a request it could not handle (its logging, its check that nothing was sent yet), but
        a request its parser refused gets an OpenAI error body, not aiohttp's plain text (error_answers.py)."""
        answer = super().handle_error(request, status, exc, message)
        return (status == 400 and unparsable_answer(exc)) or answer

    def body_coming(self) -> int | None:
        request = self.current
        if request is None or request.content.is_eof():
            return None
        return request.content.total_bytes

    def began(self, request: web.BaseRequest) -> None:
        self.current, self.head_at, self.first_byte_at = request, self.guard.now(), None
        self.requests += 1
        self.receiving, self.received = (None if request.content.is_eof() else request.content), 0
        self.body_before = request.content.total_bytes
        self.reads = self.read_bytes = 0

    def ended(self) -> None:
        self.current, self.idle_since = None, self.guard.now()
        if self.receiving is None:  # the next request's head is counted from here; a body still coming, from its own
            self.reads = self.read_bytes = 0


class ConnectionGuard:
    """The tenant listener's connections, their deadlines and caps (the module docstring says which)."""

    def __init__(self, config: ListenConfig, metrics: GatewayMetrics, now: Callable[[], float] | None = None) -> None:
        self.config = config
        self._metrics = metrics
        self.now = now or asyncio.get_running_loop().time
        soft_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.max_connections = (
            config.max_connections
            if soft_limit == resource.RLIM_INFINITY
            else min(config.max_connections, soft_limit // 2)
        )
        self.open: set[Guarded] = set()
        # Not yet shown a valid key, oldest first (a dict keeps insertion order).
        self.unauthenticated: dict[Guarded, None] = {}
        self._sweeper: asyncio.Task[None] | None = None

    # --- the connections' life ---------------------------------------------------------------------------------
    def opened(self, connection: Guarded) -> None:
        if len(self.open) >= self.max_connections:
            self._close(connection, "max_connections")
            return
        self.open.add(connection)
        if len(self.unauthenticated) >= self.config.max_unauthenticated_connections:
            self._close(next(iter(self.unauthenticated)), "max_unauthenticated")
        self.unauthenticated[connection] = None

    def lost(self, connection: Guarded) -> None:
        self.open.discard(connection)
        self.unauthenticated.pop(connection, None)

    def authenticated(self, connection: Guarded) -> None:
        self.unauthenticated.pop(connection, None)

    def close(self, connection: Guarded, reason: str) -> None:
        """Close ``connection`` now, counted under ``reason`` (and logged)."""
        log.info("closing a client connection: %s", reason)
        self._close(connection, reason)

    def _close(self, connection: Guarded, reason: str) -> None:
        self.lost(connection)
        self._metrics.client_connections_closed.labels(reason).inc()
        transport = connection.transport
        connection.force_close()
        # A transport's close waits for its unsent bytes to go out: with a client that does not read them (an answer
        # it never takes) the socket, and its file descriptor, would be held for ever, no longer counted here.
        if transport is not None and transport.get_write_buffer_size():
            transport.abort()

    def read(self, connection: Guarded, size: int) -> bool:
        """Count one socket read of ``size`` bytes on ``connection``; past ``READ_SLACK`` reads and one more per
        ``MIN_BYTES_PER_READ`` bytes, close it (``fragmented``) and return False. One rule for both servers' reads."""
        connection.reads += 1
        connection.read_bytes += size
        if connection.reads > READ_SLACK + connection.read_bytes // MIN_BYTES_PER_READ:
            connection.reads = connection.read_bytes = 0
            self.close(connection, "fragmented")
            return False
        return True

    # --- deadlines -----------------------------------------------------------------------------------------------
    def overdue(self, connection: Guarded, now: float) -> str | None:
        """Why ``connection`` is to be closed now, or None."""
        config = self.config
        if connection.current is not None:
            received = connection.body_coming()
            if received is None:
                return None  # the request is being served: its own deadline covers it
            elapsed = now - connection.head_at
            if elapsed > config.body_grace_s and received < config.min_body_bytes_per_s * elapsed:
                return "body_rate"
            return None
        if connection.first_byte_at is not None:  # a request's head is coming in
            return "header_timeout" if now - connection.first_byte_at > config.header_timeout_s else None
        if connection.requests == 0:  # a new connection must send its request line in time
            return "header_timeout" if now - connection.opened_at > config.header_timeout_s else None
        return "idle" if now - connection.idle_since > config.idle_timeout_s else None

    def sweep(self) -> None:
        now = self.now()
        for connection in list(self.open):
            reason = self.overdue(connection, now)
            if reason is not None:
                log.info("closing a client connection: %s", reason)
                self._close(connection, reason)
        gauge = self._metrics.client_connections
        gauge.labels("open").set(len(self.open))
        gauge.labels("unauthenticated").set(len(self.unauthenticated))

    async def _sweep_forever(self) -> None:
        config = self.config
        shortest = min(config.header_timeout_s, config.body_grace_s, config.idle_timeout_s)
        interval = min(1.0, max(0.05, shortest / 4))
        while True:
            await asyncio.sleep(interval)
            self.sweep()

    def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep_forever(), name="client connection deadlines")

    async def stop(self) -> None:
        await cancel_and_wait([self._sweeper])


class HandlerSite(web.TCPSite):
    """aiohttp's TCP site whose connections are built by ``connection`` (a subclass of aiohttp's handler marks or
    watches them), on its own address or on a listening socket the process inherited (serve --workers:
    gateway/workers.py). ``port`` is the bound port once started, the real one when the config says 0."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, sock: socket.socket | None = None) -> None:
        super().__init__(runner, host, port)
        self._sock = sock

    def connection(self, server: web.Server) -> asyncio.Protocol:
        """One connection's protocol: aiohttp's handler, built as ``Server.__call__`` builds it."""
        return RequestHandler(server, loop=asyncio.get_running_loop(), **server._kwargs)

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner, as TCPSite.start does
        server = self._runner.server
        assert server is not None

        def factory() -> asyncio.Protocol:
            return self.connection(server)

        loop = asyncio.get_running_loop()
        if self._sock is not None:
            self._server = await loop.create_server(factory, sock=self._sock, backlog=self._backlog)
        else:
            self._server = await loop.create_server(factory, self._host, self._port, backlog=self._backlog)
        self._bound_port = self._server.sockets[0].getsockname()[1] if self._server.sockets else self._port


class GuardedSite(HandlerSite):
    """A TCP site whose connections are ``GuardedHandler``s of ``guard``."""

    def __init__(
        self, runner: web.AppRunner, guard: ConnectionGuard, host: str, port: int, sock: socket.socket | None = None
    ) -> None:
        super().__init__(runner, host, port, sock)
        self._guard = guard

    def connection(self, server: web.Server) -> GuardedHandler:
        return GuardedHandler(self._guard, server, loop=asyncio.get_running_loop(), **server._kwargs)


def request_began(request: web.BaseRequest) -> GuardedHandler | None:
    """Tell the connection's guard a request's head is in; its connection, to be told ``ended()`` when the request
    is done, or None when it is served without the guard (in-process tests)."""
    connection = request.protocol
    if not isinstance(connection, GuardedHandler):
        return None
    connection.began(request)
    return connection


@web.middleware
async def phases(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The guard's phases as a middleware of their own (the gateway's app does this in its one middleware,
    gateway/app.py's ``front``): when a request's head is in and when it is done."""
    connection = request_began(request)
    try:
        return await handler(request)
    finally:
        if connection is not None:
            connection.ended()


def authenticated(request: web.BaseRequest) -> None:
    """The request presented a valid key: its connection no longer counts as unauthenticated."""
    connection = request.protocol
    if isinstance(connection, GuardedHandler):
        connection.guard.authenticated(connection)
