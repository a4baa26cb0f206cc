"""Engine answers the vLLM driver must read whatever their bytes: a refusal it turns into the driver's own error,
never an exception the gateway does not expect (a 500 for the request, neither retried nor counted), and never more
of an answer in memory than a bound."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

import backends.vllm
from backends.base import AdapterRef, Endpoint, EngineRequest
from backends.errors import AdapterLoadFailed, EngineRejected, EngineUnavailable
from backends.side_reads import MAX_METRICS_PAGE
from backends.vllm import VllmDriver
from gateway.failures import classify
from tests.backends.test_vllm_load_signals import PAGE

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@contextlib.asynccontextmanager
async def engine(
    method: str, path: str, handler: Handler, also: Sequence[tuple[str, str, Handler]] = ()
) -> AsyncIterator[tuple[VllmDriver, Endpoint]]:
    """A driver, and a replica whose route answers with ``handler`` (and ``also``'s routes theirs)."""
    app = web.Application()
    for route in ((method, path, handler), *also):
        app.router.add_route(*route)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    driver = VllmDriver(
        connect_timeout_s=2, request_timeout_s=5, adapter_load_timeout_s=5, max_connections_per_replica=4,
        probe_timeout_s=30,
    )  # fmt: skip
    try:
        yield driver, Endpoint("r0", str(server.make_url("")).rstrip("/"))
    finally:
        await driver.close()
        await server.close()


def answer(body: bytes, status: int = 200, content_type: str = "application/json") -> Handler:
    async def handler(_: web.Request) -> web.Response:
        return web.Response(body=body, status=status, content_type=content_type)

    return handler


async def test_a_load_refusal_with_bytes_that_are_not_utf8_is_a_load_failure() -> None:
    """The runtime LoRA API's answer is read the same way: a refusal whose text is not UTF-8 is the adapter's load
    failure (its status and text), not a UnicodeDecodeError out of the driver (a 500 for the request)."""
    refusal = answer(b'{"error": {"message": "bad \xff path"}}', status=400)
    async with engine("POST", "/v1/load_lora_adapter", refusal) as (driver, replica):
        with pytest.raises(AdapterLoadFailed, match="bad"):
            await driver.load_adapter(replica, AdapterRef("a", "/a"))


async def test_an_error_answer_nested_past_the_parsers_depth_is_the_engines_refusal() -> None:
    """An error body nested deeper than the JSON parser recurses (a broken engine, or anything on its port) is read
    as text: the engine's refusal with its status, not a RecursionError out of the driver (a 500 for the request,
    neither retried nor counted against the replica)."""
    deep = answer(b'{"error": ' + b"[" * 100_000, status=500)
    async with engine("POST", "/v1/completions", deep) as (driver, replica):
        with pytest.raises(EngineRejected) as refused:
            await driver.send(replica, EngineRequest("/v1/completions", b"{}", False))
        assert refused.value.status == 500


@pytest.mark.parametrize(
    ("body", "listed"),
    [
        pytest.param(b"[1]", None, id="a-list"),
        pytest.param(b'{"data": 5}', None, id="data-not-a-list"),
        pytest.param(b'{"data": [{"parent": "m"}, {"id": "a", "parent": "m"}, {"id": 7, "parent": "m"}]}', {"a"},
                     id="entries-without-a-name"),
        pytest.param(b'{"data": ' + b"[" * 100_000, None, id="nested-past-the-parser"),
    ],
)  # fmt: skip
async def test_a_model_list_of_another_shape_is_no_listing_or_its_readable_entries(
    body: bytes, listed: set[str] | None
) -> None:
    """GET /v1/models of another shape (a broken engine, or anything on its port) is the replica not listing its
    models (EngineUnavailable, which reconciliation skips), and entries without a name are left out: an
    AttributeError, TypeError, KeyError or RecursionError out of the driver ended reconciliation for the pool's
    other replicas, and at start-up the gateway never became ready."""
    async with engine("GET", "/v1/models", answer(body)) as (driver, replica):
        if listed is None:
            with pytest.raises(EngineUnavailable):
                await driver.list_adapters(replica)
        else:
            assert await driver.list_adapters(replica) == listed


async def test_a_metrics_page_with_bytes_that_are_not_utf8_is_still_read() -> None:
    """A byte that is not UTF-8 in the page (an adapter's name in a label, a HELP text): the text is decoded with
    replacement characters and the gauges read. Decoding it strictly raised out of load_signals, which failed the
    pool's whole scrape (every replica's)."""
    page = answer(b"# HELP vllm:x caf\xe9\n" + PAGE.encode(), content_type="text/plain")
    async with engine("GET", "/metrics", page) as (driver, replica):
        load = await driver.load_signals(replica)
    assert load is not None and (load.running, load.waiting, load.gpu_slots) == (3.0, 2.0, 4)


async def test_a_metrics_page_over_the_read_bound_is_no_reading() -> None:
    """A metrics page over side_reads.MAX_METRICS_PAGE (a broken engine, or anything else on its port): no reading,
    and no more of it read than the bound. aiohttp read any page whole into the gateway's memory; then the bound was
    http1's 64 MiB for a whole answer, under which a page of blank lines froze the event loop for a minute a scrape:
    this page, a little over 8 MiB, was read."""
    padding = b"# " + b"x" * (MAX_METRICS_PAGE + 1024) + b"\n"

    async def endless(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()  # chunked: no Content-Length to refuse it by
        await response.prepare(request)
        await response.write(PAGE.encode())
        for start in range(0, len(padding), 1 << 20):
            await response.write(padding[start : start + (1 << 20)])
        await response.write_eof()
        return response

    async with engine("GET", "/metrics", endless) as (driver, replica):
        assert await driver.load_signals(replica) is None


async def test_the_page_is_parsed_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The page is parsed on a worker thread: the event loop, every tenant's requests, goes on however long the
    engine's page takes to read (on the event loop, 64 MiB of blank lines froze it for 57-85 s a scrape)."""
    parsed_on: list[int] = []
    parse = backends.vllm.parse_load_signals

    def recording(text: str) -> object:
        parsed_on.append(threading.get_ident())
        return parse(text)

    monkeypatch.setattr(backends.vllm, "parse_load_signals", recording)
    async with engine("GET", "/metrics", answer(PAGE.encode(), content_type="text/plain")) as (driver, replica):
        load = await driver.load_signals(replica)
    assert load is not None and load.running == 3.0
    assert parsed_on and threading.get_ident() not in parsed_on


async def redirect(_: web.Request) -> web.StreamResponse:
    """What a front (a proxy sending http to https, a moved service) answers a replica URL that is one hop off."""
    raise web.HTTPMovedPermanently("/elsewhere")


async def test_a_redirect_is_no_answer_but_the_replicas_failure() -> None:
    """A replica URL that an operator got one hop wrong answers every request with a redirect: that is the replica
    failing (an engine 5xx: tried elsewhere, counted on evidence), not an answer relayed to the client with its 3xx
    status and counted as the replica's success."""
    async with engine("POST", "/v1/completions", redirect) as (driver, replica):
        with pytest.raises(EngineRejected) as refused:
            await driver.send(replica, EngineRequest("/v1/completions", b"{}", False))
        assert refused.value.status == 502 and "301" in refused.value.message
        verdict = classify(refused.value)
        assert verdict.retryable and verdict.blame == "suspect"  # README, Retries and Health: counted on evidence


async def test_a_health_probe_answered_with_a_redirect_is_down() -> None:
    """The probe does not follow a redirect to some page that answers 200 (a front's own): the replica is down, as
    its requests would fail."""
    elsewhere = ("GET", "/elsewhere", answer(b"ok", content_type="text/plain"))
    async with engine("GET", "/health", redirect, also=[elsewhere]) as (driver, replica):
        assert not await driver.healthy(replica)


async def test_an_error_answer_of_megabytes_is_not_read_whole_or_parsed() -> None:
    """An error answer is read to give the client the engine's reason: one of 20 MB (a proxy's page, a hostile
    engine) was read whole (up to the 64 MiB an answer may take), decoded and parsed as JSON on the event loop, every
    tenant's requests behind it, and its message went on whole. Past MAX_ERROR_BODY it is read no further, and the
    engine's status stands: a 400 that echoes a large request (a validation error quoting the field it refused) is
    the request's fault, never the replica's (which a client could otherwise have ejected replicas with)."""
    for status, blame in ((400, "none"), (500, "suspect")):
        huge = answer(b'{"error": {"message": "' + b"x" * (20 << 20) + b'"}}', status=status)
        async with engine("POST", "/v1/completions", huge) as (driver, replica):
            with pytest.raises(EngineRejected) as refused:
                await driver.send(replica, EngineRequest("/v1/completions", b"{}", False))
        assert refused.value.status == status and len(refused.value.message) < 200
        assert classify(refused.value).blame == blame
    assert backends.vllm.MAX_ERROR_BODY <= 1 << 20
