"""A Triton replica is ready for a pool only when the server has the pool's model ready: a pool whose
triton.model names a model the server does not have finds every replica down from its first probe, and the log
says why, instead of answering every request "the model could not be loaded"."""

from __future__ import annotations

import logging

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from backends.triton import TritonDriver
from backends.triton_config import TritonEndpoint
from loadtests.processes import free_port
from tests.servers import TritonProcess


def driver(model: str) -> TritonDriver:
    return TritonDriver(
        model=model, lora_dtype="float16", default_max_tokens=4, chat_template=None, request_timeout_s=30,
        adapter_load_timeout_s=30, probe_timeout_s=5,
    )  # fmt: skip


async def test_a_server_without_the_pools_model_is_not_ready_and_the_log_says_why(
    triton_lane: TritonProcess, caplog: pytest.LogCaptureFixture
) -> None:
    engine = triton_lane  # the simulator, and a real Triton server (engine lane)
    replica = TritonEndpoint("t0", engine.http_url, engine.grpc_address, engine.metrics_url)
    caplog.set_level(logging.WARNING, logger="backends.triton")
    right, wrong = driver(engine.model), driver("llama_chatml_typo")
    try:
        assert await right.healthy(replica)
        assert not await wrong.healthy(replica)
        assert not await wrong.healthy(replica)  # logged once, not at every probe
        [message] = [r.getMessage() for r in caplog.records]
        assert "model 'llama_chatml_typo' is not ready there" in message and "triton.model" in message
        gone = TritonEndpoint("t1", f"http://127.0.0.1:{free_port()}", "127.0.0.1:1", "http://127.0.0.1:1/metrics")
        assert not await right.healthy(gone)
        assert "t1 is not ready: unreachable" in caplog.records[-1].getMessage()
    finally:
        await right.close()
        await wrong.close()


async def test_a_ready_check_answered_with_a_redirect_is_not_ready() -> None:
    """A replica URL one hop off the server (a front that redirects): the probe does not follow the redirect to a
    page of the front's that answers 200; the replica is not ready, as its requests would fail."""

    async def moved(_: web.Request) -> web.StreamResponse:
        raise web.HTTPFound("/elsewhere")

    async def elsewhere(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/v2/models/m/ready", moved)
    app.router.add_get("/v2/health/ready", moved)
    app.router.add_get("/elsewhere", elsewhere)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    probe = driver("m")
    url = str(server.make_url("")).rstrip("/")
    try:
        assert not await probe.healthy(TritonEndpoint("t0", url, "127.0.0.1:1", url + "/metrics"))
    finally:
        await probe.close()
        await server.close()
