"""A whole answer reaches the client before the gateway books the request (the lease's release and outcome report,
the admission ticket's settlement, the request's telemetry): gateway/serving/relay.py's ``respond`` writes it
before it returns, rather than leaving the write to aiohttp once the handler has returned. An in-process gateway on
a real server, over the fake engine of test_request_walk; the client in a thread of its own, so that the gateway's
event loop can be held while the client reads."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import httpx
from aiohttp.test_utils import TestServer

from gateway.app import create_app
from gateway.appkeys import TELEMETRY
from gateway.observe.telemetry import RequestRecord
from loadtests.fleet import api_key
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
