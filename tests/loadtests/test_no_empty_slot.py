"""The start-up benchmark's client: its timed requests run with the client's own garbage collector held off, so a
collection's pause in the load generator is never read as the router's tail (loadtests/no_empty_slot.py)."""

from __future__ import annotations

import gc
import json

from aiohttp import web
from aiohttp.test_utils import TestServer

from loadtests.collector import collector_held
from loadtests.no_empty_slot import TENANTS, traffic


def _stub(seen: list[bool]) -> web.Application:
    """An OpenAI-shaped server of two routes that notes, per completion, whether the collector was on: it runs in
    the client's process, so it sees the client's collector as the request is made."""

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": []})

    async def completions(request: web.Request) -> web.StreamResponse:
        seen.append(gc.isenabled())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk = {
            "id": "c",
            "object": "text_completion",
            "created": 0,
            "model": "m",
            "choices": [{"index": 0, "text": "x", "finish_reason": "length", "logprobs": None}],
        }
        await response.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    return app


async def test_the_timed_requests_run_with_the_clients_collector_held_off_and_it_is_back_after() -> None:
    seen: list[bool] = []
    assert gc.isenabled()
    async with TestServer(_stub(seen), host="127.0.0.1") as server:
        base = str(server.make_url("")).rstrip("/")
        ttfts = await traffic(dict.fromkeys(TENANTS, base), dict.fromkeys(TENANTS, "key"), 1)
    assert len(ttfts) == len(seen) == len(TENANTS)
    assert not any(seen)
    assert gc.isenabled()


def test_the_collector_is_left_off_after_the_block_where_it_was_off_before() -> None:
    gc.disable()
    try:
        with collector_held():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


async def test_the_routing_benchmarks_replay_runs_with_the_clients_collector_held_off() -> None:
    """bench_routing's replay times its trace as no_empty_slot does (loadtests/collector.py)."""
    from loadtests.bench_routing import Arrival, replay

    seen: list[bool] = []
    app = _stub(seen)

    async def stats(request: web.Request) -> web.Response:
        return web.json_response({"cold_loads": 0})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text="")

    app.router.add_get("/sim/stats", stats)
    app.router.add_get("/metrics", metrics)
    async with TestServer(app, host="127.0.0.1") as server:
        base = str(server.make_url("")).rstrip("/")
        trace = [Arrival(offset_s=0.01 * i, tenant=f"t{i}", prompt="p") for i in range(4)]
        observed = await replay([base], "vllm-router", trace, {"r0": base})
    assert observed.failures == 0 and len(observed.ttft) == len(seen) == 4
    assert not any(seen)
    assert gc.isenabled()
