"""Engine answers the vLLM driver must read whatever their bytes: a refusal it turns into the driver's own error,
never an exception the gateway does not expect (a 500 for the request, neither retried nor counted)."""

from __future__ import annotations

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from backends.base import AdapterRef, Endpoint, EngineRequest
from backends.errors import AdapterLoadFailed, EngineRejected, EngineUnavailable
from backends.vllm import VllmDriver


async def test_a_load_refusal_with_bytes_that_are_not_utf8_is_a_load_failure() -> None:
    """The runtime LoRA API's answer is read the same way: a refusal whose text is not UTF-8 is the adapter's load
    failure (its status and text), not a UnicodeDecodeError out of the driver (a 500 for the request)."""

    async def load(_: web.Request) -> web.Response:
        return web.Response(
            body=b'{"error": {"message": "bad \xff path"}}', status=400, content_type="application/json"
        )

    app = web.Application()
    app.router.add_post("/v1/load_lora_adapter", load)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    driver = VllmDriver(
        connect_timeout_s=2, request_timeout_s=5, adapter_load_timeout_s=5, max_connections_per_replica=4,
        probe_timeout_s=5,
    )  # fmt: skip
    try:
        with pytest.raises(AdapterLoadFailed, match="bad"):
            await driver.load_adapter(Endpoint("r0", str(server.make_url("")).rstrip("/")), AdapterRef("a", "/a"))
    finally:
        await driver.close()
        await server.close()


async def test_an_error_answer_nested_past_the_parsers_depth_is_the_engines_refusal() -> None:
    """An error body nested deeper than the JSON parser recurses (a broken engine, or anything on its port) is read
    as text: the engine's refusal with its status, not a RecursionError out of the driver (a 500 for the request,
    neither retried nor counted against the replica)."""

    async def complete(_: web.Request) -> web.Response:
        return web.Response(body=b'{"error": ' + b"[" * 100_000, status=500, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    driver = VllmDriver(
        connect_timeout_s=2, request_timeout_s=5, adapter_load_timeout_s=5, max_connections_per_replica=4,
        probe_timeout_s=5,
    )  # fmt: skip
    try:
        with pytest.raises(EngineRejected) as refused:
            replica = Endpoint("r0", str(server.make_url("")).rstrip("/"))
            await driver.send(replica, EngineRequest("/v1/completions", b"{}", False))
        assert refused.value.status == 500
    finally:
        await driver.close()
        await server.close()


@pytest.mark.parametrize(
    ("body", "listed"),
    [
        pytest.param(b"[1]", None, id="a-list"),
        pytest.param(b'{"data": 5}', None, id="data-not-a-list"),
        pytest.param(b'{"data": [{"parent": "m"}, {"id": "a", "parent": "m"}, {"id": 7, "parent": "m"}]}', {"a"},
                     id="entries-without-a-name"),
    ],
)  # fmt: skip
async def test_a_model_list_of_another_shape_is_no_listing_or_its_readable_entries(
    body: bytes, listed: set[str] | None
) -> None:
    """GET /v1/models of another shape (a broken engine, or anything on its port) is the replica not listing its
    models (EngineUnavailable, which reconciliation skips), and entries without a name are left out: an
    AttributeError, TypeError or KeyError out of the driver ended reconciliation for the pool's other replicas, and
    at start-up the gateway never became ready."""

    async def models(_: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    app.router.add_get("/v1/models", models)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    driver = VllmDriver(
        connect_timeout_s=2, request_timeout_s=5, adapter_load_timeout_s=5, max_connections_per_replica=4,
        probe_timeout_s=5,
    )  # fmt: skip
    replica = Endpoint("r0", str(server.make_url("")).rstrip("/"))
    try:
        if listed is None:
            with pytest.raises(EngineUnavailable):
                await driver.list_adapters(replica)
        else:
            assert await driver.list_adapters(replica) == listed
    finally:
        await driver.close()
        await server.close()
