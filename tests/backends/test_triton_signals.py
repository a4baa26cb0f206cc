"""The Triton driver's load signals, read from a metrics page as TensorRT-LLM's backend writes it."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from backends.base import Endpoint
from backends.side_reads import MAX_METRICS_PAGE
from backends.triton import TritonDriver
from backends.triton_config import TritonEndpoint

TRT_LLM_PAGE = """\
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{model="ensemble",version="1"} 9
# TYPE nv_trt_llm_request_metrics gauge
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="active",version="1"} 5
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="waiting",version="1"} 2
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="max",version="1"} 64
# TYPE nv_trt_llm_kv_cache_block_metrics gauge
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction",model="tensorrt_llm",version="1"} 0.25
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used",model="tensorrt_llm",version="1"} 100
# TYPE nv_gpu_utilization gauge
nv_gpu_utilization{gpu_uuid="GPU-1"} 0.9
"""
PLAIN_TRITON_PAGE = """\
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{model="ensemble",version="1"} 3
nv_inference_pending_request_count{model="preprocessing",version="1"} 3
"""


@pytest.fixture
async def driver() -> AsyncIterator[TritonDriver]:
    driver = TritonDriver(
        model="ensemble", lora_dtype="float16", default_max_tokens=16, chat_template=None,
        request_timeout_s=5, adapter_load_timeout_s=5, probe_timeout_s=5,
    )  # fmt: skip
    yield driver
    await driver.close()


async def _serve(page: str, status: int = 200) -> TestServer:
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=page, status=status)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


def _replica(server: TestServer) -> Endpoint:
    url = str(server.make_url("")).rstrip("/")
    return TritonEndpoint("r0", url, "127.0.0.1:1", url + "/metrics")


async def test_tensorrt_llm_gauges_when_present(driver: TritonDriver) -> None:
    server = await _serve(TRT_LLM_PAGE)
    try:
        load = await driver.load_signals(_replica(server))
    finally:
        await server.close()
    assert load is not None
    assert (load.running, load.waiting, load.kv_cache_usage) == (5.0, 2.0, 0.25)


async def test_the_entry_models_queue_depth_otherwise(driver: TritonDriver) -> None:
    server = await _serve(PLAIN_TRITON_PAGE)
    try:
        load = await driver.load_signals(_replica(server))
    finally:
        await server.close()
    assert load is not None
    assert (load.running, load.waiting, load.kv_cache_usage) == (
        0.0,
        3.0,
        0.0,
    )  # the ensemble's steps are not counted twice


@pytest.mark.parametrize(
    ("page", "status"),
    [('nv_trt_llm_request_metrics{request_type="active" 5\n', 200), ("", 503)],
    ids=["garbled", "503"],
)
async def test_no_signals_from_a_bad_page(driver: TritonDriver, page: str, status: int) -> None:
    server = await _serve(page + TRT_LLM_PAGE if status == 200 else page, status)
    try:
        assert await driver.load_signals(_replica(server)) is None
    finally:
        await server.close()


async def test_a_page_with_bytes_that_are_not_utf8_is_still_read(driver: TritonDriver) -> None:
    """A byte that is not UTF-8 in the page (a HELP text, a label): the text is decoded with replacement characters
    and the gauges read. Decoding it strictly raised out of load_signals, which failed the pool's whole scrape."""

    async def metrics(_: web.Request) -> web.Response:
        body = b"# HELP nv_gpu_utilization GPU \xff utilization\n" + TRT_LLM_PAGE.encode()
        return web.Response(body=body, content_type="text/plain", charset="utf-8")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        load = await driver.load_signals(_replica(server))
    finally:
        await server.close()
    assert load is not None and (load.running, load.waiting, load.kv_cache_usage) == (5.0, 2.0, 0.25)


async def test_a_page_over_the_read_bound_is_no_reading(driver: TritonDriver) -> None:
    """A metrics page over side_reads.MAX_METRICS_PAGE (a broken engine, or anything else on its port) is no reading,
    and is not read whole into the gateway's memory (aiohttp's read had no bound). The bound was http1's 64 MiB for
    a whole answer, a page whose parse froze the event loop for a minute: this page, a little over 8 MiB, was read."""
    padding = "# " + "x" * (MAX_METRICS_PAGE + 1024) + "\n"
    server = await _serve(TRT_LLM_PAGE + padding)
    try:
        assert await driver.load_signals(_replica(server)) is None
    finally:
        await server.close()


async def test_the_page_is_parsed_off_the_event_loop(driver: TritonDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    """The page is parsed on a worker thread: the event loop, every tenant's requests, goes on however long the
    engine's page takes to read (on the event loop, a hostile page of blank lines froze it for a minute)."""
    parsed_on: list[int] = []
    read_load = TritonDriver._read_load

    def recording(self: TritonDriver, text: str) -> object:
        parsed_on.append(threading.get_ident())
        return read_load(self, text)

    monkeypatch.setattr(TritonDriver, "_read_load", recording)
    server = await _serve(TRT_LLM_PAGE)
    try:
        load = await driver.load_signals(_replica(server))
    finally:
        await server.close()
    assert load is not None and load.running == 5.0
    assert parsed_on and threading.get_ident() not in parsed_on
