"""The connection guard (gateway/serving/connections.py) against a real aiohttp server on 127.0.0.1, one rule at a
time, through raw sockets: what a slow or idle client is allowed, and when it is closed. These tests pin the layer to
the aiohttp version in use: they are what to run when aiohttp moves. The same rules on the gateway's own server (the
tenant listener's, for the inference routes) are tests/gateway/serving/test_own_server.py's."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import resource
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from gateway.config import ListenConfig
from gateway.observe.metrics import GatewayMetrics
from gateway.serving.connections import (
    FRAMING_SLACK_BYTES,
    MIN_BYTES_PER_READ,
    READ_SLACK,
    ConnectionGuard,
    GuardedSite,
    authenticated,
    keepalive_timeout,
    phases,
)

GOOD_KEY = "good"


async def echo(request: web.Request) -> web.Response:
    """Reads the body; a request with the good key authenticates its connection."""
    if request.headers.get("x-key") == GOOD_KEY:
        authenticated(request)
    body = await request.read()
    return web.Response(text=str(len(body)))


class Server:
    def __init__(self, guard: ConnectionGuard, port: int) -> None:
        self.guard, self.port = guard, port

    def closed(self, reason: str) -> float:
        value: float = self.guard._metrics.client_connections_closed.labels(reason)._value.get()
        return value

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Any]]:
    runners: list[tuple[web.AppRunner, ConnectionGuard]] = []

    async def start(**listen: Any) -> Server:
        config = ListenConfig(**{"header_timeout_s": 30, "idle_timeout_s": 30, "body_grace_s": 30, **listen})
        app = web.Application(middlewares=[phases])
        app.router.add_post("/", echo)
        runner = web.AppRunner(app, handler_cancellation=True, keepalive_timeout=keepalive_timeout(config))
        await runner.setup()
        guard = ConnectionGuard(config, GatewayMetrics())
        site = GuardedSite(runner, guard, "127.0.0.1", 0)
        await site.start()
        guard.start()
        runners.append((runner, guard))
        return Server(guard, site.port)

    yield start
    for runner, guard in runners:
        await guard.stop()
        await runner.cleanup()


async def closed_by_server(reader: asyncio.StreamReader, within_s: float = 10) -> bytes:
    """Everything the server sent until it closed the connection (bounded); a client still writing sees the close
    as a reset or a broken pipe (then nothing was read)."""
    try:
        return await asyncio.wait_for(reader.read(), within_s)
    except (ConnectionResetError, BrokenPipeError):
        return b""


def head(length: int, key: str = "") -> bytes:
    extra = f"x-key: {key}\r\n" if key else ""
    return f"POST / HTTP/1.1\r\nHost: gw\r\nContent-Length: {length}\r\n{extra}\r\n".encode()


async def test_a_half_sent_head_is_closed_at_the_header_deadline(serve: Callable[..., Any]) -> None:
    server: Server = await serve(header_timeout_s=0.3)
    reader, writer = await server.connect()
    writer.write(b"POST / HTTP/1.1\r\nHost: gw\r\n")  # and never the rest
    assert await closed_by_server(reader) == b""
    silent, _ = await server.connect()  # a connection that sends nothing at all: the request line's deadline
    assert await closed_by_server(silent) == b""
    assert server.closed("header_timeout") == 2


async def test_a_trickled_body_is_closed_after_the_grace_and_a_slow_steady_one_is_served(
    serve: Callable[..., Any],
) -> None:
    server: Server = await serve(body_grace_s=0.5, min_body_bytes_per_s=400)
    trickle_reader, trickle = await server.connect()
    trickle.write(head(10_000))

    async def drip() -> None:
        for _ in range(100):  # 10 bytes/s
            if trickle.is_closing():
                return
            trickle.write(b"x")
            await asyncio.sleep(0.1)

    dripping = asyncio.create_task(drip())
    # A large body on a slow but steady link (about 1,000 bytes/s for 1.5 s, past the grace) is legitimate.
    steady_reader, steady = await server.connect()
    steady.write(head(1_500))
    for _ in range(15):
        steady.write(b"y" * 100)
        await asyncio.sleep(0.1)
    answer = await asyncio.wait_for(steady_reader.readuntil(b"1500"), 10)
    assert answer.startswith(b"HTTP/1.1 200")
    assert await closed_by_server(trickle_reader) == b""
    dripping.cancel()
    assert server.closed("body_rate") == 1


async def test_an_idle_kept_alive_connection_is_closed(serve: Callable[..., Any]) -> None:
    server: Server = await serve(idle_timeout_s=0.3)
    reader, writer = await server.connect()
    writer.write(head(2) + b"hi")
    assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n2"), 10)).startswith(b"HTTP/1.1 200")
    assert await closed_by_server(reader) == b""
    assert server.closed("idle") == 1


async def test_a_newcomer_over_the_unauthenticated_cap_closes_the_oldest_stalled_connection(
    serve: Callable[..., Any],
) -> None:
    server: Server = await serve(max_unauthenticated_connections=3)
    known_reader, known = await server.connect()  # a client that presented a valid key: it is never evicted
    known.write(head(2, GOOD_KEY) + b"hi")
    await asyncio.wait_for(known_reader.readuntil(b"\r\n\r\n2"), 10)
    stalled = [await server.connect() for _ in range(3)]
    for _, writer in stalled:
        writer.write(b"POST / HTTP/1.1\r\n")
    newcomer_reader, newcomer = await server.connect()
    assert await closed_by_server(stalled[0][0]) == b""  # the oldest stalled one made room
    newcomer.write(head(2) + b"ok")
    assert (await asyncio.wait_for(newcomer_reader.readuntil(b"\r\n\r\n2"), 10)).startswith(b"HTTP/1.1 200")
    known.write(head(2, GOOD_KEY) + b"hi")  # still open
    assert (await asyncio.wait_for(known_reader.readuntil(b"\r\n\r\n2"), 10)).startswith(b"HTTP/1.1 200")
    assert server.closed("max_unauthenticated") == 1


async def test_a_connection_over_max_connections_is_closed_at_once(serve: Callable[..., Any]) -> None:
    server: Server = await serve(max_connections=2)
    held = [await server.connect() for _ in range(2)]
    for reader, writer in held:
        writer.write(head(2, GOOD_KEY) + b"hi")
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n2"), 10)
    third, _ = await server.connect()
    assert await closed_by_server(third) == b""
    assert server.closed("max_connections") == 1


def test_the_defaults_the_readme_states() -> None:
    listen = ListenConfig()
    assert (listen.header_timeout_s, listen.min_body_bytes_per_s, listen.body_grace_s, listen.idle_timeout_s) == (
        10.0,
        1024,
        10.0,
        75.0,
    )
    assert (listen.max_connections, listen.max_unauthenticated_connections) == (4096, 256)
    # aiohttp's own keep-alive timeout, what the gateway had before: an hour.
    assert inspect.signature(RequestHandler.__init__).parameters["keepalive_timeout"].default == 3630


@pytest.mark.parametrize(
    ("extra", "status"),
    [
        (b"x-big: " + b"a" * 8_000 + b"\r\n", 200),
        (b"x-big: " + b"a" * 9_000 + b"\r\n", 431),
        (b"".join(b"x-h%d: v\r\n" % n for n in range(126)), 200),
        (b"".join(b"x-h%d: v\r\n" % n for n in range(127)), 431),
    ],
    ids=["8,000-byte field", "9,000-byte field", "128 headers", "129 headers"],
)  # fmt: skip
async def test_a_head_over_aiohttps_bounds_is_a_431_with_an_openai_error_body(
    serve: Callable[..., Any], extra: bytes, status: int
) -> None:
    """README, Global protection: header size is aiohttp's bound (8,190 bytes a request line or field, 128 header
    fields), the gateway's runner (gateway/server.py) setting no other, as this fixture's does not; past it the
    tenant listener answers 431 with an OpenAI error body (GuardedHandler.handle_error), not aiohttp's plain text,
    and closes the connection."""
    server: Server = await serve()
    reader, writer = await server.connect()
    writer.write(b"POST / HTTP/1.1\r\nHost: gw\r\nContent-Length: 0\r\n" + extra + b"\r\n")
    answer = await closed_by_server(reader) if status != 200 else await reader.readuntil(b"\r\n\r\n")
    writer.close()
    assert answer.split(b" ")[1] == str(status).encode(), answer[:200]
    if status != 200:
        head, _, body = answer.partition(b"\r\n\r\n")
        assert b"Content-Type: application/json" in head, head
        assert json.loads(body)["error"]["code"] == "request_header_fields_too_large"


async def test_never_more_connections_than_half_the_file_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))
    try:
        assert ConnectionGuard(ListenConfig(), GatewayMetrics()).max_connections == 256
        assert ConnectionGuard(ListenConfig(max_connections=100), GatewayMetrics()).max_connections == 100
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_the_gauge_counts_open_and_unauthenticated_connections(serve: Callable[..., Any]) -> None:
    server: Server = await serve()
    known_reader, known = await server.connect()
    known.write(head(2, GOOD_KEY) + b"hi")
    await asyncio.wait_for(known_reader.readuntil(b"\r\n\r\n2"), 10)
    stalled = [await server.connect() for _ in range(2)]
    gauge = server.guard._metrics.client_connections

    def state() -> tuple[float, float]:
        return gauge.labels("open")._value.get(), gauge.labels("unauthenticated")._value.get()

    for _ in range(200):  # the sweeper sets the gauge a few times a second
        if state() == (3, 2):
            break
        await asyncio.sleep(0.05)
    assert state() == (3, 2)
    for _, writer in stalled:
        writer.close()


def chunked_head(key: str = "") -> bytes:
    extra = f"x-key: {key}\r\n" if key else ""
    return f"POST / HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n{extra}\r\n".encode()


@pytest.mark.parametrize("chunk", [b"1\r\nx\r\n", b"1;" + b"e" * 40 + b"\r\nx\r\n"], ids=["1-byte", "extension"])
async def test_a_body_of_tiny_chunks_is_closed_when_its_framing_outweighs_it(
    serve: Callable[..., Any], chunk: bytes
) -> None:
    """A body sent as 1-byte chunks (6 bytes on the wire for each body byte), or padded with chunk extensions: the
    parser hands each chunk to the request's stream, a Python call each, so 1,000,000 such chunks (a 1 MB body,
    within max_body_bytes) took ~0.7 s of the event loop, at a socket read's worth (~10,000 chunks) at a time, from
    whoever sent them (a 401 answered first reads the rest: aiohttp lingers). The connection is closed once the
    bytes received for a body pass its own by more than the slack (``body_framing``); a body in chunks of a few
    hundred bytes is served."""
    server = await serve()
    reader, writer = await server.connect()
    writer.write(chunked_head())
    sent = 0
    try:
        for _ in range(200):  # up to 200 x 5,000 chunks
            writer.write(chunk * 5_000)
            await writer.drain()
            sent += 5_000
    except (ConnectionResetError, BrokenPipeError):
        pass
    answer = await closed_by_server(reader)
    assert server.closed("body_framing") == 1 and sent < 200 * 5_000
    assert b"HTTP/1.1 200" not in answer
    writer.close()
    reader, writer = await server.connect()  # a body in 300-byte chunks: framing of ~2%
    writer.write(chunked_head(GOOD_KEY) + (b"12c\r\n" + b"y" * 300 + b"\r\n") * 3_000 + b"0\r\n\r\n")
    await writer.drain()
    assert (await reader.readuntil(b"900000")).startswith(b"HTTP/1.1 200")
    writer.close()


@pytest.mark.parametrize(("size", "closed"), [(25, False), (16, True)], ids=["framing 24%", "framing 37.5%"])
async def test_a_bodys_framing_may_pass_it_by_a_quarter_and_no_more(
    serve: Callable[..., Any], size: int, closed: bool
) -> None:
    """README's "a quarter": a 1,000,000-byte body in 25-byte chunks (6 bytes of framing each, 24%) is served; in
    16-byte chunks (37.5%) it passes the body by a quarter plus the slack once about 520 KB are in, and is closed."""
    server = await serve()
    reader, writer = await server.connect()
    chunk = f"{size:x}\r\n".encode() + b"z" * size + b"\r\n"
    writer.write(chunked_head(GOOD_KEY) + chunk * (1_000_000 // size) + b"0\r\n\r\n")
    with contextlib.suppress(ConnectionResetError, BrokenPipeError):
        await writer.drain()
    if closed:
        assert b"HTTP/1.1 200" not in await closed_by_server(reader)
        assert server.closed("body_framing") == 1
    else:
        assert (await reader.readuntil(b"1000000")).startswith(b"HTTP/1.1 200")
        assert server.closed("body_framing") == 0
    writer.close()


async def dribble(writer: asyncio.StreamWriter, data: bytes, piece: int) -> int:
    """Send ``data`` ``piece`` bytes at a time, letting the server read each before the next (the server runs on this
    loop: two loop turns take it through its selector); the bytes sent until the server closed the connection."""
    sent = 0
    try:
        for start in range(0, len(data), piece):
            writer.write(data[start : start + piece])
            await writer.drain()
            sent += len(data[start : start + piece])
            for _ in range(2):
                await asyncio.sleep(0)
            if writer.transport.is_closing():
                break
    except (ConnectionResetError, BrokenPipeError):
        pass
    return sent


async def test_a_head_or_body_sent_a_byte_a_read_is_closed_and_one_in_real_reads_is_served(
    serve: Callable[..., Any],
) -> None:
    """Each socket read is a call into aiohttp's parser whatever its size: a client sending its request one byte per
    TCP segment (its head, or its body, or a head after each 401 on a kept-alive connection) made the gateway pay a
    few microseconds per byte. A head or body may take READ_SLACK reads and one more per MIN_BYTES_PER_READ bytes;
    past that the connection is closed (``fragmented``). A head in a few pieces and a body in 1 KB reads are served."""
    server = await serve()
    reader, writer = await server.connect()
    padded = head(10).replace(b"Host: gw\r\n", b"Host: gw\r\nx-pad: " + b"p" * 2_000 + b"\r\n")
    sent = await dribble(writer, padded + b"x" * 10, 1)
    assert b"HTTP/1.1" not in await closed_by_server(reader)
    assert server.closed("fragmented") == 1 and sent < 2_000
    writer.close()

    reader, writer = await server.connect()  # the head whole, the body a byte a read
    writer.write(head(5_000, GOOD_KEY))
    sent = await dribble(writer, b"y" * 5_000, 1)
    assert b"HTTP/1.1 200" not in await closed_by_server(reader)
    assert server.closed("fragmented") == 2 and sent < 5_000
    writer.close()

    reader, writer = await server.connect()  # a real client: a few pieces of head, a body in 1 KB reads, twice
    for _ in range(2):
        request = head(100_000, GOOD_KEY)
        await dribble(writer, request, len(request) // 3 + 1)
        await dribble(writer, b"z" * 100_000, 1_024)
        assert (await reader.readuntil(b"100000")).startswith(b"HTTP/1.1 200")
    assert server.closed("fragmented") == 2
    writer.close()


async def test_real_clients_ways_of_sending_are_never_fragmented(serve: Callable[..., Any]) -> None:
    """What a legitimate client does is within the read rule, each on one kept-alive connection: a head written a
    header line per write (a naive client without buffering, 40 lines), an Expect: 100-continue head whose body
    follows the 100 in segments of a slow link's size, a chunked body streamed in 512-byte chunks, and ten requests
    pipelined each in two writes (head, then body) before the first answer is read."""
    server: Server = await serve()
    reader, writer = await server.connect()
    lines = [b"POST / HTTP/1.1\r\n", b"Host: gw\r\n", f"x-key: {GOOD_KEY}\r\n".encode(), b"Content-Length: 2\r\n"]
    lines += [f"x-header-{n}: value {n}\r\n".encode() for n in range(36)]
    for line in [*lines, b"\r\n", b"hi"]:
        await dribble(writer, line, len(line))
    assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n2"), 10)).startswith(b"HTTP/1.1 200")

    writer.write(head(50_000, GOOD_KEY).replace(b"\r\n\r\n", b"\r\nExpect: 100-continue\r\n\r\n"))
    assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).startswith(b"HTTP/1.1 100")
    await dribble(writer, b"e" * 50_000, 536)  # the smallest segment an IPv4 path carries
    assert (await asyncio.wait_for(reader.readuntil(b"50000"), 10)).startswith(b"HTTP/1.1 200")

    writer.write(f"POST / HTTP/1.1\r\nHost: gw\r\nx-key: {GOOD_KEY}\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
    chunk = b"200\r\n" + b"c" * 512 + b"\r\n"
    await dribble(writer, chunk * 100 + b"0\r\n\r\n", len(chunk))
    assert (await asyncio.wait_for(reader.readuntil(b"51200"), 10)).startswith(b"HTTP/1.1 200")

    for _ in range(10):
        writer.write(head(3, GOOD_KEY))
        await writer.drain()
        writer.write(b"abc")
        await writer.drain()
    for _ in range(10):
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n3"), 10)).startswith(b"HTTP/1.1 200")
    assert server.closed("fragmented") == 0
    writer.close()


def test_the_docs_read_and_framing_figures_are_the_codes() -> None:
    """README's Global protection and the runbook's closed-connection reasons give the read rule's and the framing
    rule's figures: they are connections.py's constants."""
    root = Path(__file__).resolve().parents[3]
    readme = " ".join((root / "README.md").read_text().split())
    runbook = " ".join((root / "docs" / "operations.md").read_text().split())
    assert (
        f"may take {READ_SLACK} socket reads and one more per {MIN_BYTES_PER_READ} bytes in them (`fragmented`"
        in readme
    )
    assert f"`FRAMING_SLACK_BYTES` ({FRAMING_SLACK_BYTES:,})" in readme
    assert f"more socket reads than {READ_SLACK} and one per {MIN_BYTES_PER_READ} bytes" in runbook
