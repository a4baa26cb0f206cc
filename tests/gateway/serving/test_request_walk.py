"""One request walks a straight path: each stage of the request's life is entered once, in order, and only the
releases come back on the way out.

The walk is recorded with ``sys.setprofile`` on the request's own task, through an in-process gateway whose pool
runs a fake engine (registered as any engine is). It lists the modules the corridor (``serving.ingress`` and
``serving.dispatch``) calls into, in order: what a stage calls in turn (the pool asking routing and residency) is
that stage's own business and not listed. Left out, as the issue that asked for this test says: errors (and the
failure table), config and telemetry. Config here includes ``gateway.state``, the holder of what serves now (config,
directory, fleet), which ingress reads again after admission on purpose: a reload may have swapped it meanwhile.
Also left out is the request's own data model (``serving.openai_request`` and the JSON it is read from,
``serving.json_body``: parsed first, then written again for the engine once the tenant's directory has said what it
runs on). So is the connection's own bookkeeping (``serving.connections``: that it presented a valid key), and so
is the request itself: the corridor reads its headers and body and answers it through the request type
(``serving.incoming``), which is aiohttp's request wrapped (``AiohttpIncoming``) or the gateway's own server's request
(``serving.own_server``'s ``OwnRequest``); its methods are the request's data and its connection's, not a stage.
The walk is taken on both servers: aiohttp's (the in-process test server) and the own one (the tenant listener's).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from backends.registry import EngineSpec, NoSettings, register
from gateway.app import GatewayRunner, create_app
from gateway.appkeys import METRICS
from gateway.config import GatewayConfig, ListenConfig
from gateway.serving import ingress
from gateway.serving.connections import ConnectionGuard
from gateway.serving.own_server import OwnSite
from loadtests.fleet import api_key, gateway_config, write_adapters
from tests.gateway.residency.fakes import FakeDriver, FakeEngine

CORRIDOR = {"gateway.serving.ingress", "gateway.serving.dispatch"}
NOT_STAGES = (
    "gateway.config",
    "gateway.state",
    "gateway.errors",
    "gateway.failures",
    "gateway.observe.",
    "gateway.serving.openai_request",
    "gateway.serving.json_body",
    "gateway.serving.connections",
    "gateway.serving.incoming",
    "gateway.serving.own_server",
)
# The request type's modules: left out of the walk above, but the corridor does call into them (the check that the
# leaving out hides nothing else is the stage list itself).
REQUEST_TYPE = {"gateway.serving.incoming", "gateway.serving.own_server"}
LEFT_OUT: set[str] = set()  # the request type's modules the corridor called (a test sets its own)
# What may come back after the answer is relayed: the lease's release (and its one outcome report), and the
# admission ticket's, which gives back the tenant's concurrency slot and settles its token estimate.
RELEASES = {"gateway.fleet.pool", "gateway.tenants.admission"}

ENGINE = FakeEngine()
register(EngineSpec("walk-fake", NoSettings, lambda settings, pool: FakeDriver(ENGINE)))


def _module(frame: FrameType | None) -> str:
    return "" if frame is None else str(frame.f_globals.get("__name__", ""))


def _ours(module: str) -> bool:
    return module.startswith(("gateway.", "backends.")) and not module.startswith(NOT_STAGES)


@contextmanager
def walk_of(task: asyncio.Task[Any], walk: list[str]) -> Iterator[None]:
    """Record into ``walk`` each module the corridor calls into, on ``task`` only (other tasks interleave)."""

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event != "call" or asyncio.current_task() is not task:
            return
        callee = _module(frame)
        from_corridor = _module(frame.f_back) in CORRIDOR
        if from_corridor and callee in REQUEST_TYPE:
            LEFT_OUT.add(callee)
        entered = _ours(callee) and callee not in CORRIDOR and from_corridor
        if entered and (not walk or walk[-1] != callee):
            walk.append(callee)

    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(None)


def recorder(walks: list[list[str]]) -> Callable[..., Any]:
    """``ingress.inference`` (where either server hands an inference request to the corridor) with its walk
    recorded."""
    inference = ingress.inference

    async def record_walk(request: Any, app: web.Application, kind: Any) -> int:
        task = asyncio.current_task()
        assert task is not None
        walks.append([])
        with walk_of(task, walks[-1]):
            return await inference(request, app, kind)

    return record_walk


@asynccontextmanager
async def served(app: web.Application, server: str) -> AsyncIterator[str]:
    """``app`` served on aiohttp's in-process test server, or on the gateway's own (as the tenant listener serves);
    its base URL."""
    if server == "aiohttp":
        async with TestServer(app) as test_server:
            yield str(test_server.make_url(""))
        return
    runner = GatewayRunner(app, handler_cancellation=True)
    await runner.setup()
    guard = ConnectionGuard(ListenConfig(), app[METRICS])
    site = OwnSite(runner, guard, "127.0.0.1", 0, drains=runner.drains)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site.port}"
    finally:
        await runner.cleanup()
        await guard.stop()


def config(tmp_path: Path) -> GatewayConfig:
    adapters = write_adapters(tmp_path, ["lora-a"])
    raw = gateway_config(
        {"r0": "http://127.0.0.1:9", "r1": "http://127.0.0.1:10"}, {"acme": ["lora-a"]}, adapters, port=0
    )
    raw["pools"][0]["backend"] = "walk-fake"
    return GatewayConfig.model_validate(raw)


def the_way_in_and_out(walk: list[str]) -> tuple[list[str], list[str]]:
    relayed = walk.index("gateway.serving.relay")
    return walk[: relayed + 1], walk[relayed + 1 :]


@pytest.mark.parametrize("server", ["aiohttp", "own"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_one_request_enters_each_stage_once(
    tmp_path: Path, stream: bool, server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    walks: list[list[str]] = []
    monkeypatch.setattr(ingress, "inference", recorder(walks))
    request_type: set[str] = set()
    monkeypatch.setattr(sys.modules[__name__], "LEFT_OUT", request_type)
    app = create_app(config(tmp_path))
    async with served(app, server) as url, aiohttp.ClientSession() as session:
        headers = {"Authorization": f"Bearer {api_key('acme')}"}
        body = {"model": "lora-a", "prompt": "hello", "max_tokens": 4, "stream": stream}
        for _ in range(2):  # the first loads the adapter on its replica; the second finds it resident
            async with session.post(url + "/v1/completions", json=body, headers=headers) as response:
                assert response.status == 200, await response.text()
                await response.read()
    assert len(walks) == 2
    assert request_type == {"gateway.serving.incoming" if server == "aiohttp" else "gateway.serving.own_server"}
    for walk in walks:
        way_in, way_out = the_way_in_and_out(walk)
        assert len(way_in) == len(set(way_in)), f"a stage entered twice on the way in: {way_in}"
        assert set(way_out) <= RELEASES, f"on the way out, more than the releases: {way_out}"
        # The stages in the request's order (a fixed path: any new stage or reordering is a deliberate change).
        assert way_in == [
            "gateway.tenants.identity",
            "gateway.tenants.directory",
            "gateway.tenants.admission",
            "gateway.fleet.fleet",
            "gateway.fleet.pool",
            # (the engine request, backends.base's EngineRequest, is a named tuple: built without a frame of that
            # module, so the recorder does not list it; the driver is the test's fake)
            "gateway.serving.relay",
        ]


def test_the_recorder_sees_a_module_entered_twice() -> None:
    """The walk's check is not vacuous: a corridor that goes back to a stage it left shows it twice."""
    walk = ["gateway.tenants.identity", "gateway.fleet.pool", "gateway.tenants.identity", "gateway.serving.relay"]
    way_in, _ = the_way_in_and_out(walk)
    assert len(way_in) != len(set(way_in))
