"""A whole answer reaches the client before the gateway books the request (the lease's release and outcome report,
the admission ticket's settlement, the request's telemetry): gateway/serving/relay.py's ``respond`` writes it
before it returns, rather than leaving the write to aiohttp once the handler has returned. An in-process gateway on
a real server, over the fake engine of test_request_walk; the client in a thread of its own, so that the gateway's
event loop can be held while the client reads."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from aiohttp.test_utils import TestServer

from backends.base import Endpoint, EngineRequest
from backends.registry import EngineSpec, NoSettings, register
from gateway.app import create_app
from gateway.appkeys import METRICS, STATE, TELEMETRY
from gateway.config import GatewayConfig
from gateway.observe.telemetry import RequestRecord
from loadtests.fleet import api_key
from tests.gateway.residency.fakes import FakeDriver, FakeEngine, FakeResponse
from tests.gateway.serving.own_sites import two_sites
from tests.gateway.serving.test_request_walk import config

REQUESTS = 2  # the first loads the adapter on its replica; the second finds it resident


async def test_the_client_has_a_whole_answer_while_the_gateway_books_the_request(tmp_path: Path) -> None:
    app = create_app(config(tmp_path))
    telemetry = app[TELEMETRY]
    book = telemetry.finish
    received = [threading.Event() for _ in range(REQUESTS)]  # set by the client as it has each answer
    seen_while_booking: list[bool] = []

    def finish(record: RequestRecord) -> None:
        # The event loop is held here: only an answer already written can reach the client meanwhile.
        seen_while_booking.append(received[len(seen_while_booking)].wait(timeout=10))
        book(record)

    telemetry.finish = finish  # type: ignore[method-assign]  # the instance's, for this test
    async with TestServer(app, host="127.0.0.1") as server:
        url = str(server.make_url("/v1/completions"))

        def client() -> list[int]:
            headers = {"Authorization": f"Bearer {api_key('acme')}"}
            body = {"model": "lora-a", "prompt": "hello", "max_tokens": 4}
            statuses = []
            for answered in received:
                statuses.append(httpx.post(url, json=body, headers=headers, timeout=30).status_code)
                answered.set()
            return statuses

        assert await asyncio.to_thread(client) == [200] * REQUESTS
    assert seen_while_booking == [True] * REQUESTS


BIG = 16 * 1024 * 1024  # far more than a socket's buffers hold for a client that does not read


class BigAnswer(FakeResponse):
    async def read(self) -> bytes:
        return b'{"text": "' + b"x" * BIG + b'"}'


class BigAnswers(FakeDriver):
    """The fake engine, answering a request whose prompt says "big" with a 16 MiB answer."""

    async def send(self, replica: Endpoint, request: EngineRequest) -> FakeResponse:
        return BigAnswer() if b"big" in request.body else await super().send(replica, request)


register(EngineSpec("answer-fake", NoSettings, lambda settings, pool: BigAnswers(FakeEngine())))


async def stalled_request(port: int, headers: dict[str, str], body: dict[str, Any]) -> socket.socket:
    """A client that sends ``body`` and never reads (a small receive buffer, so the gateway's writes fill up)."""
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(stalled, ("127.0.0.1", port))
    head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    raw = json.dumps(body).encode()
    await loop.sock_sendall(
        stalled,
        f"POST /v1/completions HTTP/1.1\r\nHost: gw\r\n{head}Content-Type: application/json\r\n"
        f"Content-Length: {len(raw)}\r\n\r\n".encode()
        + raw,
    )
    return stalled


async def statuses_until_served(url: str, headers: dict[str, str], tries: int) -> list[int]:
    """A small request sent every 50 ms, at most ``tries`` times, until one is served: the statuses it got (503 while
    the gateway's one place in flight is taken)."""
    small = {"model": "lora-a", "prompt": "hello", "max_tokens": 4}
    statuses: list[int] = []
    async with httpx.AsyncClient(timeout=10) as client:
        for _ in range(tries):  # bounded
            statuses.append((await client.post(url, json=small, headers=headers)).status_code)
            if statuses[-1] == 200:
                break
            await asyncio.sleep(0.05)
    return statuses


async def test_a_client_that_does_not_read_its_answer_holds_no_request_in_flight(tmp_path: Path) -> None:
    """The answer is handed to the connection before the request is booked, but the wait for the client to take it
    comes after: a client that stops reading holds its connection only, not the request's place in flight (here
    the gateway's only one: limits.max_in_flight 1), its lease on the replica or its tenant's concurrency."""
    raw = config(tmp_path).model_dump(mode="json")
    raw["pools"][0]["backend"] = "answer-fake"
    raw["limits"]["max_in_flight"] = 1
    app = create_app(GatewayConfig.model_validate(raw))
    async with TestServer(app, host="127.0.0.1") as server:
        headers = {"Authorization": f"Bearer {api_key('acme')}"}
        big = {"model": "lora-a", "prompt": "big", "max_tokens": 4}
        stalled = await stalled_request(server.port or 0, headers, big)
        url = str(server.make_url("/v1/completions"))
        try:
            statuses = await statuses_until_served(url, headers, tries=100)  # 503 until the big answer is out
        finally:
            stalled.close()
    assert statuses[-1] == 200, statuses


async def test_on_the_own_server_a_client_that_does_not_read_its_answer_holds_no_request_in_flight(
    tmp_path: Path,
) -> None:
    """The same on the gateway's own server for the inference routes (serving/own_server.py, as `tenantgate serve`
    listens): the 16 MiB answer is handed to the stalled connection, and the gateway's one place in flight is free
    for the next request while the client does not read it."""
    sites = await two_sites(tmp_path, limits={"max_in_flight": 1}, backend="answer-fake")
    try:
        headers = {"Authorization": f"Bearer {api_key('acme')}"}
        stalled = await stalled_request(sites.own, headers, {"model": "lora-a", "prompt": "big", "max_tokens": 4})
        try:
            statuses = await statuses_until_served(f"http://127.0.0.1:{sites.own}/v1/completions", headers, tries=100)
        finally:
            stalled.close()
    finally:
        await sites.runner.cleanup()
        await sites.guard.stop()
    assert statuses[-1] == 200, statuses


EVENT = b'data: {"choices": [{"index": 0, "text": "' + b"x" * 1000 + b'"}]}\n\n'


class LongStream(FakeResponse):
    async def chunks(self) -> AsyncIterator[bytes]:
        for _ in range(BIG // len(EVENT)):
            yield EVENT
        yield b"data: [DONE]\n\n"


class LongStreams(FakeDriver):
    """The fake engine, streaming 16 MiB of events to a request whose prompt says "long"."""

    async def send(self, replica: Endpoint, request: EngineRequest) -> FakeResponse:
        return LongStream() if b"long" in request.body else await super().send(replica, request)


register(EngineSpec("stream-fake", NoSettings, lambda settings, pool: LongStreams(FakeEngine())))


async def test_a_stream_to_a_client_that_stops_reading_ends_past_the_requests_deadline(tmp_path: Path) -> None:
    """A stream waits for a slow client to take its events (the engine's answer is not buffered without bound), but
    not past the request's deadline (and STALLED_WRITE_GRACE_S): then the connection is closed, and the request's
    place in flight (here the gateway's only one) and its lease are given back. Before, a client that stopped
    reading held them for as long as it liked."""
    raw = config(tmp_path).model_dump(mode="json")
    raw["pools"][0]["backend"] = "stream-fake"
    raw["pools"][0]["request_timeout_s"] = 1.0
    raw["limits"]["max_in_flight"] = 1
    app = create_app(GatewayConfig.model_validate(raw))
    async with TestServer(app, host="127.0.0.1") as server:
        headers = {"Authorization": f"Bearer {api_key('acme')}"}
        long = {"model": "lora-a", "prompt": "long", "stream": True}
        stalled = await stalled_request(server.port or 0, headers, long)
        url = str(server.make_url("/v1/completions"))
        try:
            statuses = await statuses_until_served(url, headers, tries=200)  # 503 until the stream is ended
        finally:
            stalled.close()
    assert statuses[-1] == 200, statuses
    closed = app[METRICS].registry.get_sample_value(
        "tenantgate_client_connections_closed_total", {"reason": "stalled_write"}
    )
    assert closed == 1  # counted, as the connection caps' closes are


async def test_on_the_own_server_a_stalled_stream_ends_past_the_deadline_and_other_tenants_are_served_meanwhile(
    tmp_path: Path,
) -> None:
    """The same on the gateway's own server (OwnStream's writes wait on the connection's drain): while acme's stream
    waits for its client, another tenant's requests on the same replica are served; past the request's deadline
    (and STALLED_WRITE_GRACE_S) the connection is closed and the replica's request in flight given back."""
    timeout_s = 2.0  # the stalled stream holds its place this long at least: the other tenant is served meanwhile
    sites = await two_sites(
        tmp_path, backend="stream-fake", pool={"request_timeout_s": timeout_s},
        tenants={"acme": ["lora-a"], "beta": ["lora-b"]},
    )  # fmt: skip
    fleet = sites.runner.app[STATE].serving.fleet
    loop = asyncio.get_running_loop()
    try:
        long = {"model": "lora-a", "prompt": "long", "stream": True}
        sent_at = loop.time()
        stalled = await stalled_request(sites.own, {"Authorization": f"Bearer {api_key('acme')}"}, long)
        try:
            for _ in range(200):  # bounded: the stream placed on the replica
                if fleet.in_flight:
                    break
                await asyncio.sleep(0.01)
            assert fleet.in_flight == 1
            beta = {"Authorization": f"Bearer {api_key('beta')}"}
            small = {"model": "lora-b", "prompt": "hello", "max_tokens": 4}
            async with httpx.AsyncClient(timeout=10) as client:
                url = f"http://127.0.0.1:{sites.own}/v1/completions"
                statuses = [(await client.post(url, json=small, headers=beta)).status_code for _ in range(3)]
            assert statuses == [200] * 3
            assert fleet.in_flight == 1 and sites.closed("stalled_write") == 0  # meanwhile: the stream still held
            for _ in range(400):  # bounded (20 s): until the stalled stream's request is given back
                if not fleet.in_flight:
                    break
                await asyncio.sleep(0.05)
            given_back_at = loop.time()
        finally:
            stalled.close()
    finally:
        await sites.runner.cleanup()
        await sites.guard.stop()
    assert fleet.in_flight == 0
    assert given_back_at - sent_at >= timeout_s  # not before the request's deadline
    assert sites.closed("stalled_write") == 1


def server_sockets(port: int) -> int:
    """The gateway's open sockets of client connections to ``port`` (this process is the client too: the client's
    sockets have ``port`` as their remote one)."""
    return sum(
        1
        for connection in psutil.Process().net_connections(kind="tcp")
        if connection.laddr and connection.laddr.port == port and connection.status != psutil.CONN_LISTEN
    )


@pytest.mark.parametrize("server", ["own", "aiohttp"])
async def test_a_client_that_never_reads_its_answer_is_closed_idle_and_its_socket_freed(
    tmp_path: Path, server: str
) -> None:
    """Holding its connection only is holding it up to idle_timeout_s: then the guard closes it, and the socket is
    freed though the client never read the answer waiting in it. Before, on the own server the wait for the client to
    take the answer counted as the request being served (no rule applied: held for ever, against max_connections);
    on aiohttp's the guard counted an idle close but the transport's close waited for the client to take the answer
    (the socket and its file descriptor held for ever, no longer counted against max_connections). A tenant that
    asked for large answers and never read them could so lock every tenant out, or run the process out of files."""
    sites = await two_sites(tmp_path, listen={"idle_timeout_s": 1}, backend="answer-fake")
    port = sites.own if server == "own" else sites.aiohttp
    try:
        headers = {"Authorization": f"Bearer {api_key('acme')}"}
        stalled = await stalled_request(port, headers, {"model": "lora-a", "prompt": "big", "max_tokens": 4})
        try:
            for _ in range(200):  # bounded (10 s): closed idle 1 s after the answer, and its socket gone
                if sites.closed("idle") and not server_sockets(port):
                    break
                await asyncio.sleep(0.05)
            left = server_sockets(port)
        finally:
            stalled.close()
    finally:
        await sites.runner.cleanup()
        await sites.guard.stop()
    assert sites.closed("idle") == 1
    assert left == 0
