"""backends/http1.py, the engine calls' HTTP/1.1 client, against a real TCP server on the loopback whose answers
each test scripts byte by byte: framing, keep-alive reuse, timeouts, cancellation, early release, connection
errors, the per-origin connection limit and flow control."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import pytest
from yarl import URL

from backends import http1

Script = Callable[["Server", asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
T = TypeVar("T")
LINES = b"".join(b"X-%d: b\r\n" % i for i in range(20_000))  # 180 KB of complete header lines
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


@dataclass
class Server:
    """A loopback server running ``script`` on each connection; counts connections and sees them close."""

    port: int = 0
    connections: int = 0
    closed: int = 0
    requests: list[bytes] = field(default_factory=list)
    closed_event: asyncio.Event = field(default_factory=asyncio.Event)

    def origin(self, limit: int = 8, connect_timeout_s: float = 2.0, idle_timeout_s: float = 15.0) -> http1.Origin:
        url = URL(f"http://127.0.0.1:{self.port}")
        return http1.Origin(url, limit=limit, connect_timeout_s=connect_timeout_s, idle_timeout_s=idle_timeout_s)


async def read_request(reader: asyncio.StreamReader, server: Server) -> bool:
    """One request (head and Content-Length body) into ``server.requests``; False at the connection's end."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return False
    length = next(
        (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0
    )
    server.requests.append(head + await reader.readexactly(length))
    return True


@contextlib.asynccontextmanager
async def serving(script: Script) -> AsyncIterator[Server]:
    server = Server()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        server.connections += 1
        try:
            await script(server, reader, writer)
            await reader.read()  # until the client closes
        except ConnectionError:
            pass
        finally:
            server.closed += 1
            server.closed_event.set()
            writer.close()

    listening = await asyncio.start_server(handle, "127.0.0.1", 0)
    server.port = listening.sockets[0].getsockname()[1]
    async with listening:
        yield server


def answering(*answers: bytes) -> Script:
    """Per connection: read a request, write the next answer, as long as there are answers."""
    pending = list(answers)

    async def script(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while pending and await read_request(reader, server):
            writer.write(pending.pop(0))
            await writer.drain()

    return script


def answers(*scripted: bytes) -> contextlib.AbstractAsyncContextManager[Server]:
    return serving(answering(*scripted))


async def silent(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.read()  # never answers; sees the client close


async def one_chunk_then_holds(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_request(reader, server)
    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
    await reader.read()  # the rest never comes; sees the client close


async def post(origin: http1.Origin, body: bytes = b"{}", timeout_s: float = 5.0) -> http1.Response:
    head = origin.request_head("POST", "/v1/completions", "application/json", {}, len(body))
    return await origin.request(head, body, timeout_s)


async def whole(origin: http1.Origin) -> bytes:
    """One request's whole answer, its connection handed back."""
    response = await post(origin)
    try:
        return await response.read()
    finally:
        response.release()


async def within(awaitable: Awaitable[T], seconds: float = 5) -> T:
    """The awaitable's outcome, which must come within ``seconds`` (a bound that is not a TimeoutError of its own,
    so a test of the client's timeout cannot pass on it)."""
    task = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if not done:
        task.cancel()
        raise AssertionError(f"no outcome within {seconds} s")
    return task.result()


async def until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(500):  # bounded poll: up to 5 s
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(what)


async def test_a_content_length_answer_is_read_and_its_connection_reused() -> None:
    async with answers(OK, OK) as server:
        origin = server.origin()
        for _ in range(2):
            response = await post(origin, b'{"a":1}')
            assert (response.status, response.headers["content-type"]) == (200, "application/json")
            assert await response.read() == b"{}"
            response.release()
        assert server.connections == 1
        assert server.requests[0].startswith(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:")
        assert b'\r\nContent-Type: application/json\r\nContent-Length: 7\r\n\r\n{"a":1}' in server.requests[0]
        origin.close()


async def test_the_request_carries_its_extra_headers_and_refuses_a_line_break_in_one() -> None:
    async with answers(OK) as server:
        origin = server.origin()
        head = origin.request_head("POST", "/v1/x", "application/json", {"traceparent": "00-ab-cd-01"}, 2)
        (await origin.request(head, b"{}", 5)).release()
        assert b"\r\ntraceparent: 00-ab-cd-01\r\n" in server.requests[0]
        with pytest.raises(ValueError, match="line break"):
            origin.request_head("POST", "/v1/x", "application/json", {"x": "a\r\nEvil: 1"}, 2)
        origin.close()


async def test_a_chunked_stream_arrives_chunk_by_chunk_and_its_connection_is_reused() -> None:
    """Each chunk reaches the reader before the server sends the next; extensions, trailers and a chunk split
    over many reads are read right; the connection then serves the next request."""
    sent = asyncio.Event()

    async def script(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader, server)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n6;ext=1\r\ndata:1\r\n")
        await writer.drain()
        await sent.wait()
        for byte in b"6\r\ndata:2\r\n0\r\nX-Trailer: t\r\n\r\n":  # one byte per write
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0)
        await read_request(reader, server)
        writer.write(OK)

    async with serving(script) as server:
        origin = server.origin()
        response = await post(origin)
        got = []
        async for chunk in response.chunks():
            got.append(chunk)
            sent.set()
        assert b"".join(got) == b"data:1data:2" and got[0] == b"data:1"
        response.release()
        assert await whole(origin) == b"{}"
        assert server.connections == 1
        origin.close()


async def test_interim_answers_are_skipped_and_no_content_has_no_body() -> None:
    async with answers(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n", OK) as server:
        origin = server.origin()
        response = await post(origin)
        assert (response.status, await response.read()) == (204, b"")
        response.release()
        assert await whole(origin) == b"{}"
        assert server.connections == 1
        origin.close()


async def test_a_body_until_close_and_connection_close_are_not_reused() -> None:
    until_close = b"HTTP/1.1 200 OK\r\n\r\nall of it"
    closing = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}"

    async def script(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader, server)
        writer.write(until_close if server.connections == 1 else closing)
        writer.close()

    async with serving(script) as server:
        origin = server.origin()
        response = await post(origin)
        assert await response.read() == b"all of it"
        response.release()
        assert await whole(origin) == b"{}"
        response = await post(origin)
        response.release()
        assert server.connections == 3
        origin.close()


async def test_a_connection_idle_past_the_idle_timeout_is_not_reused() -> None:
    """Dropped by the client before the engine's own keep-alive timeout can close it under a request (vLLM closes
    idle connections after 5 s; the vLLM driver drops them after 4)."""
    async with answers(OK, OK, OK) as server:
        origin = server.origin(idle_timeout_s=0.2)
        assert await whole(origin) == b"{}"
        assert await whole(origin) == b"{}"  # at once: the same connection
        assert server.connections == 1
        await asyncio.sleep(0.3)  # past the idle timeout (not a timing assertion: the clock only moves on)
        assert await whole(origin) == b"{}"
        assert server.connections == 2
        await asyncio.wait_for(server.closed_event.wait(), 5)  # the idle one was closed
        origin.close()


async def test_an_idle_connection_the_engine_closed_is_not_reused() -> None:

    async def script(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader, server)
        writer.write(OK)
        await writer.drain()
        writer.close()  # the engine's keep-alive timeout, after the answer

    async with serving(script) as server:
        origin = server.origin()
        (await post(origin)).release()  # the body arrived with the head: the connection went back idle
        await until(lambda: server.closed == 1, "the server closed its side")
        await asyncio.sleep(0.05)  # let the client's loop see the close
        assert await whole(origin) == b"{}"
        assert server.connections == 2
        origin.close()


async def test_no_answer_within_the_timeout_raises_timeout_and_drops_the_connection() -> None:
    async with serving(silent) as server:
        origin = server.origin()
        with pytest.raises(TimeoutError):
            await within(post(origin, timeout_s=0.3))
        await asyncio.wait_for(server.closed_event.wait(), 5)
        origin.close()


async def test_a_body_that_stalls_past_the_timeout_raises_timeout_after_what_arrived() -> None:
    async with serving(one_chunk_then_holds) as server:
        origin = server.origin()
        response = await post(origin, timeout_s=0.5)
        got = []

        async def read_all() -> http1.Response:
            async for chunk in response.chunks():
                got.append(chunk)
            return response

        with pytest.raises(TimeoutError):
            await within(read_all())
        assert got == [b"first"]
        response.release()
        await asyncio.wait_for(server.closed_event.wait(), 5)
        origin.close()


async def test_a_cancelled_request_closes_its_connection_so_the_engine_sees_it() -> None:
    async with serving(silent) as server:
        origin = server.origin(limit=1)
        task = asyncio.create_task(post(origin))
        await until(lambda: server.connections == 1, "the request reached the server")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(server.closed_event.wait(), 5)
        # Its place is free again (limit 1): the next request opens a new connection instead of waiting.
        task = asyncio.create_task(post(origin))
        await until(lambda: server.connections == 2, "the next request got a connection")
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        origin.close()


async def test_an_answer_released_before_its_end_drops_its_connection() -> None:
    async with serving(one_chunk_then_holds) as server:
        origin = server.origin()
        response = await post(origin)
        async for _ in response.chunks():
            break
        response.release()
        response.release()  # twice is harmless
        await asyncio.wait_for(server.closed_event.wait(), 5)
        origin.close()


@pytest.mark.parametrize(
    ("answer", "at"),
    [
        pytest.param(b"", "head", id="closed before answering"),
        pytest.param(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf", "body", id="closed mid-body"),
        pytest.param(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nhalf", "body", id="closed mid-chunk"),
        pytest.param(b"garbage\r\n\r\n", "head", id="not HTTP"),
        pytest.param(b"HTTP/1.1 000 Zero\r\nContent-Length: 0\r\n\r\n", "head", id="status below 100"),
        pytest.param(b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", "head", id="bad length"),
        pytest.param(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "body", id="bad chunk size"),
        pytest.param(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}", "head", id="two lengths"),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}",
            "head",
            id="length and chunked",
        ),
        pytest.param(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n", "head", id="an upgrade"),
    ],
)
async def test_an_answer_that_breaks_off_or_cannot_be_read_raises_response_error(answer: bytes, at: str) -> None:

    async def breaks(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader, server)
        writer.write(answer)
        await writer.drain()
        writer.close()

    async with serving(breaks) as server:
        origin = server.origin()
        if at == "head":
            with pytest.raises(http1.ResponseError):
                await post(origin)
        else:
            response = await post(origin)
            with pytest.raises(http1.ResponseError):
                await response.read()
            response.release()
        origin.close()


async def test_a_refused_connection_raises_os_error() -> None:
    async with serving(answering()) as server:
        port = server.port
    origin = http1.Origin(URL(f"http://127.0.0.1:{port}"), limit=1, connect_timeout_s=2)
    with pytest.raises(OSError):
        await post(origin)
    with pytest.raises(OSError):  # and its place in the limit was given back
        await post(origin)
    origin.close()


async def test_at_the_limit_a_request_waits_for_a_connection_and_a_cancelled_waiter_passes_its_turn() -> None:
    async with answers(OK, OK, OK) as server:
        origin = server.origin(limit=1)
        first = await post(origin)
        waiting = asyncio.create_task(post(origin))
        gives_up = asyncio.create_task(post(origin))
        await asyncio.sleep(0.05)
        assert not waiting.done() and server.connections == 1
        gives_up.cancel()
        await first.read()
        first.release()
        second = await asyncio.wait_for(waiting, 5)
        assert await second.read() == b"{}"
        second.release()
        assert server.connections == 1
        with pytest.raises(asyncio.CancelledError):
            await gives_up
        with pytest.raises(TimeoutError):  # waiting for a connection counts against the timeout too
            held = await post(origin)
            try:
                await within(post(origin, timeout_s=0.2))
            finally:
                held.release()
        origin.close()


async def test_closing_the_origin_fails_the_requests_waiting_for_a_connection_at_once() -> None:
    """Not at their deadlines (30 s here): the connection they wait for may be a stream that runs for minutes. The
    request holding it is left to finish."""
    async with serving(one_chunk_then_holds) as server:
        origin = server.origin(limit=1)
        holding = await post(origin, timeout_s=30)
        waiting = [asyncio.create_task(post(origin, timeout_s=30)) for _ in range(2)]
        await until(lambda: len(origin._waiters) == 2, "the two requests wait for the connection")
        origin.close()
        for task in waiting:
            with pytest.raises(http1.ResponseError, match="pool is closed"):
                await within(task)
        assert server.connections == 1 and server.closed == 0 and origin._woken == 0
        holding.release()
        await until(lambda: server.closed == 1, "the held connection closes once its answer is released")


async def test_reading_pauses_while_the_reader_is_behind() -> None:
    size = 4 * 1024 * 1024

    async def large(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader, server)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size + b"x" * size)
        await writer.drain()

    async with serving(large) as server:
        origin = server.origin()
        response = await post(origin)
        transport = response._connection.transport if response._connection else None
        assert transport is not None
        await until(lambda: not transport.is_reading(), "reading paused with the reader behind")
        assert len(await response.read()) == size
        response.release()
        origin.close()


async def test_an_answer_that_arrived_whole_while_reading_was_paused_leaves_its_connection_reading() -> None:
    """A whole answer whose last bytes take it past the pause mark before the reader asks for it (a busy loop;
    uvloop delivers many reads per turn) pauses reading as they land: read() takes it at once, and the connection
    that goes back to the pool must read again, or the next request on it never sees its answer."""
    first, last = http1._HIGH_WATER - 1024, 16 * 1024
    buffered = asyncio.Event()

    async def script(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader, server)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (first + last) + b"x" * first)
        await buffered.wait()
        writer.write(b"y" * last)  # one write the client reads whole: it ends the answer and passes the mark
        await read_request(reader, server)
        writer.write(OK)

    async with serving(script) as server:
        origin = server.origin()
        response = await post(origin)
        connection = response._connection
        assert connection is not None
        await until(lambda: connection._buffered == first, "the first part waits for the reader")
        buffered.set()
        await until(lambda: connection._state == http1._DONE, "the whole answer arrived before the reader asked")
        assert len(await response.read()) == first + last
        response.release()
        assert await within(post(origin, timeout_s=3)) is not None
        assert server.connections == 1
        origin.close()


async def test_a_waiter_cancelled_just_before_its_turn_raises_its_cancellation_not_a_value_error() -> None:
    """A request waiting at the limit is cancelled (its client left, or its deadline passed: a timeout cancels it
    the same way) and, before its task runs again, a connection comes back: the wake skips the cancelled waiter and
    hands the turn to the next. The cancelled request must end as cancelled, not as a ValueError from removing a
    waiter the wake already took off the queue (a 500 for the client, and a cancellation lost)."""
    async with answers(OK, OK) as server:
        origin = server.origin(limit=1)
        held = await post(origin)
        cancelled = asyncio.create_task(post(origin))
        waiting = asyncio.create_task(post(origin))
        await until(lambda: len(origin._waiters) == 2, "two requests wait for the one connection")
        await held.read()
        cancelled.cancel()  # its waiter is cancelled now; its task runs later
        held.release()  # the wake takes the cancelled waiter off the queue and wakes the next
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        next_one = await within(waiting)
        assert await next_one.read() == b"{}"
        next_one.release()
        assert server.connections == 1 and origin._open == 1


async def test_at_the_limit_the_connection_that_comes_back_goes_to_the_request_waiting_first() -> None:
    """Waiters are served in their order, and a request that arrives as a connection comes back queues behind them:
    it does not take the connection the wake handed to the first waiter (which, overtaken so at every turn by new
    arrivals at a busy replica, would wait on to its deadline while later requests were served)."""
    async with answers(OK, OK, OK) as server:
        origin = server.origin(limit=1)
        held = await post(origin)
        first_waiter = asyncio.create_task(post(origin))
        await until(lambda: len(origin._waiters) == 1, "a request waits for the one connection")
        await held.read()
        newcomer = asyncio.create_task(post(origin))  # ready to run before the waiter's wake-up
        held.release()
        served = await within(first_waiter, 2)
        assert not newcomer.done() and len(origin._waiters) == 1  # the newcomer waits its turn
        assert await served.read() == b"{}"
        served.release()
        last = await within(newcomer)
        assert await last.read() == b"{}"
        last.release()
        assert server.connections == 1 and origin._open == 1 and origin._woken == 0


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(b"HTTP/1.1 200 OK\r\nX-Endless: " + b"a" * 100_000, id="head"),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nX-T: " + b"a" * 100_000,
            id="trailers",
        ),
        pytest.param(b"HTTP/1.1 200 OK\r\n" + LINES, id="head of many lines"),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n" + LINES,
            id="trailers of many lines",
        ),
    ],
)
async def test_a_head_or_trailers_that_never_end_are_refused_while_the_engine_holds_the_connection(
    answer: bytes,
) -> None:
    """The parser would buffer a header line that never ends, and the head would grow with line after line: past
    64 KiB of head (or trailers) the answer is refused at once (not at the request's timeout, the head's memory
    grown all along: 369 MB in 3 s of distinct header lines), and the connection dropped."""

    async def endless(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader, server)
        writer.write(answer)
        await writer.drain()
        await reader.read()  # holds the connection open; sees the client close

    async with serving(endless) as server:
        origin = server.origin()

        async def exchange() -> bytes:
            response = await post(origin, timeout_s=60)
            try:
                return await response.read()
            finally:
                response.release()

        with pytest.raises(http1.ResponseError, match="too large"):
            await within(exchange(), 5)
        await until(lambda: server.closed == 1, "the connection was not dropped")
        origin.close()


async def test_a_body_until_close_cut_by_a_reset_is_broken_not_complete() -> None:
    """An answer without a length ends when the engine closes; a reset (the engine crashed) mid-way is no end."""

    async def resets(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader, server)
        writer.write(b"HTTP/1.1 200 OK\r\n\r\npart of it")
        await writer.drain()
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # linger 0: the close is a reset

    async with serving(resets) as server:
        origin = server.origin()
        response = await post(origin)
        with pytest.raises(http1.ResponseError):
            await within(response.read())
        response.release()
        origin.close()


async def test_bytes_after_a_whole_answer_leave_the_answer_whole_and_the_connection_unused() -> None:
    """An engine that writes more than its answer (junk, or a second answer nobody asked for) in the same packet:
    the answer, whole before it, is the client's; the connection is not used again."""
    async with answers(OK + b"junk that is no answer\r\n\r\n", OK) as server:
        origin = server.origin()
        assert await whole(origin) == b"{}"
        assert await whole(origin) == b"{}"
        assert server.connections == 2
        origin.close()


async def test_a_kept_alive_connection_the_engine_closes_as_the_request_arrives_is_tried_once_on_a_new_one() -> None:
    """An engine closes a connection idle for its keep-alive timeout (vLLM: 5 s; the pool keeps them 15 s): a request
    sent on it just then meets the close, not an answer (a separate-process engine closing at 50 ms, requests sent
    50 +- 3 ms after the last: 24 of 1,000 failed), which the gateway took for a broken replica. A reused connection
    that ends before any byte of an answer is tried once more on a new connection; a new one that does is an error."""

    async def closes_on_the_second(server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if server.connections == 1:
            await read_request(reader, server)
            writer.write(OK)
            await writer.drain()
            await reader.readuntil(b"\r\n\r\n")  # the next request arrives as the engine closes the idle connection
            writer.transport.abort()
        elif server.connections == 2:
            await read_request(reader, server)
            writer.write(OK)
        else:
            await read_request(reader, server)
            writer.transport.abort()  # a new connection closed before answering: no second try

    async with serving(closes_on_the_second) as server:
        origin = server.origin()
        assert await whole(origin) == b"{}"
        assert await within(whole(origin)) == b"{}"
        assert server.connections == 2
        origin.close()
        fresh = server.origin()  # no connection kept: the request opens one, which closes unanswered
        with pytest.raises(http1.ResponseError):
            await within(whole(fresh))
        assert server.connections == 3
        fresh.close()


async def test_a_whole_answer_over_the_limit_is_refused() -> None:
    """A buggy engine's huge whole answer is not held in memory: a Content-Length over the limit is refused before
    any of the body is read (the connection dropped), and a chunked body once it passes the limit."""
    chunk = b"a" * 600
    async with answers(
        b"HTTP/1.1 200 OK\r\nContent-Length: 100000000\r\n\r\n" + b"x" * 10,
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + (b"258\r\n" + chunk + b"\r\n") * 4 + b"0\r\n\r\n",
    ) as server:
        origin = server.origin()
        response = await post(origin)
        with pytest.raises(http1.ResponseError, match="100000000 bytes, over the 1000"):
            await asyncio.wait_for(response.read(limit=1000), 5)
        response.release()
        await until(lambda: server.closed == 1, "the connection was not dropped")
        response = await post(origin)
        with pytest.raises(http1.ResponseError, match="over the 1000 bytes"):
            await asyncio.wait_for(response.read(limit=1000), 5)
        response.release()
        origin.close()
