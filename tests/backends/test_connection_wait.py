"""A request that waits in the gateway for a connection to a replica (the pool's ``max_connections_per_replica``
are all in use) until its deadline was never sent: the drivers answer it as the request's deadline
(``DeadlineExceeded``: a 504, not retried, nothing against the replica), not as the replica's timeout, which the
outlier detector counts. An engine that does not answer in time is still the replica's timeout. One waiting when the
pool closes is failed at once, and tried on another replica."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from backends.base import Endpoint, EngineRequest
from backends.errors import DeadlineExceeded, EngineTimeout, EngineUnavailable
from backends.vllm import VllmDriver
from gateway.failures import classify
from tests.backends.test_vllm_odd_answers import engine


@contextlib.asynccontextmanager
async def every_connection_held() -> AsyncIterator[tuple[VllmDriver, Endpoint]]:
    """A driver whose replica's 4 connections each carry a request the engine holds until the block ends."""
    released, arrived = asyncio.Event(), []

    async def held(request: web.Request) -> web.Response:
        arrived.append(request)
        await released.wait()
        return web.json_response({})

    async with engine("POST", "/v1/completions", held) as (driver, replica):  # 4 connections per replica
        busy = [
            asyncio.create_task(driver.send(replica, EngineRequest("/v1/completions", b"{}", False))) for _ in range(4)
        ]
        for _ in range(500):  # bounded poll: the four reached the engine (each on a connection of its own)
            if len(arrived) == 4:
                break
            await asyncio.sleep(0.01)
        assert len(arrived) == 4
        yield driver, replica
        released.set()
        for response in await asyncio.gather(*busy):
            response.release()


async def test_a_request_that_never_got_a_connection_is_its_deadline_not_the_replicas_timeout() -> None:
    async with every_connection_held() as (driver, replica):
        with pytest.raises(DeadlineExceeded) as waited:
            await driver.send(replica, EngineRequest("/v1/completions", b"{}", False, timeout_s=0.2))
        verdict = classify(waited.value)
        assert verdict.blame == "none" and not verdict.retryable and verdict.error.status == 504


async def test_a_request_waiting_for_a_connection_when_the_pool_closes_is_tried_elsewhere_at_once() -> None:
    """Closing the driver (its pool retired) fails the request waiting for a connection at once, as a replica it
    cannot reach (retryable), not at its deadline (30 s here)."""
    async with every_connection_held() as (driver, replica):
        waiting = asyncio.create_task(
            driver.send(replica, EngineRequest("/v1/completions", b"{}", False, timeout_s=30))
        )
        origin = driver._origins[replica.url]
        for _ in range(500):  # bounded poll: it waits for a connection
            if origin._waiters:
                break
            await asyncio.sleep(0.01)
        assert origin._waiters
        await driver.close()
        done, _ = await asyncio.wait({waiting}, timeout=5)
        assert done, "the waiting request was not failed when the pool closed"
        with pytest.raises(EngineUnavailable, match="pool is closed") as failed:
            waiting.result()
        assert classify(failed.value).retryable


async def test_an_engine_that_does_not_answer_in_time_is_still_the_replicas_timeout() -> None:
    async def silent(_: web.Request) -> web.Response:
        await asyncio.sleep(30)
        return web.json_response({})

    async with engine("POST", "/v1/completions", silent) as (driver, replica):
        with pytest.raises(EngineTimeout) as timed_out:
            await driver.send(replica, EngineRequest("/v1/completions", b"{}", False, timeout_s=0.2))
        assert not isinstance(timed_out.value, DeadlineExceeded)
