"""Triton's KServe v2 HTTP endpoint over the simulated TensorRT-LLM model: health, server and model metadata, the
model config, ``/metrics``, and infer refused as Triton refuses it for a decoupled model. Errors are Triton's
``{"error": "<message>"}``. The simulator's own /sim routes (loadtests/sim/control.py) add the PEFT cache."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from loadtests.sim.control import ControlError, apply_control, engine_stats
from loadtests.sim.faults import Faults
from loadtests.sim.triton_contract import (
    EXTENSIONS,
    SERVER_NAME,
    SERVER_VERSION,
    check_model,
    config_json,
    metadata_json,
)
from loadtests.sim.triton_errors import TritonError, decoupled_refused
from loadtests.sim.triton_metrics import triton_metrics
from loadtests.sim.triton_model import TrtLlmModel

MODEL = web.AppKey("model", TrtLlmModel)
MODEL_NAME = web.AppKey("model_name", str)
FAULTS = web.AppKey("faults", Faults)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except TritonError as exc:
        return web.json_response({"error": str(exc)}, status=exc.kind.http_status)


def _checked_model(request: web.Request) -> str:
    """The model the path names, if it is the one served (else Triton's not-found error)."""
    name = request.match_info["model"]
    check_model(request.app[MODEL_NAME], name, request.match_info.get("version", ""))
    return name


async def server_metadata(request: web.Request) -> web.Response:
    return web.json_response({"name": SERVER_NAME, "version": SERVER_VERSION, "extensions": list(EXTENSIONS)})


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def model_metadata(request: web.Request) -> web.Response:
    return web.json_response(metadata_json(_checked_model(request)))


async def model_ready(request: web.Request) -> web.Response:
    try:
        _checked_model(request)
    except TritonError:
        return web.Response(status=400)  # Triton answers a model that is not ready (or not there) with 400
    return web.Response(status=200)


async def model_config(request: web.Request) -> web.Response:
    return web.json_response(config_json(_checked_model(request)))


async def infer(request: web.Request) -> web.Response:
    _checked_model(request)
    raise decoupled_refused("HTTP end point")


async def sim_stats(request: web.Request) -> web.Response:
    peft = request.app[MODEL].peft
    cache = {
        "capacity": peft.capacity,
        "cached": [str(task) for task in peft.cached],
        "in_flight": {str(task): n for task, n in peft.in_flight.items()},
        "weights_at": {str(task): at for task, at in peft.weights_at.items()},
        "released_at": {str(task): at for task, at in peft.released_at.items()},
    }
    return web.json_response({**engine_stats(request.app[MODEL].engine), "peft_cache": cache, **peft.stats.as_json()})


async def sim_control(request: web.Request) -> web.Response:
    try:
        body = json.loads(await request.read())
        if not isinstance(body, dict):
            raise ControlError("the body must be a JSON object", "body")
        state = apply_control(request.app[MODEL].engine, request.app[FAULTS], body)
    except ValueError as exc:  # ControlError, or a body that is not JSON
        raise TritonError(str(exc)) from exc
    return web.json_response(state)


def create_app(model: TrtLlmModel, faults: Faults, model_name: str) -> web.Application:
    """The HTTP endpoint; it runs the engine's step loop while the app runs."""
    app = web.Application(middlewares=[_errors, faults.middleware()])
    app[MODEL], app[MODEL_NAME], app[FAULTS] = model, model_name, faults
    registry = triton_metrics(model.engine, model_name)

    async def metrics(request: web.Request) -> web.Response:
        model.engine.stats.metrics_scrapes += 1
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def engine_running(app: web.Application) -> AsyncIterator[None]:
        await model.engine.start()
        yield
        await model.engine.stop()

    app.cleanup_ctx.append(engine_running)
    routes: list[tuple[str, str, Callable[[web.Request], Awaitable[web.Response]]]] = [
        ("GET", "/v2", server_metadata),
        ("GET", "/v2/health/live", health),
        ("GET", "/v2/health/ready", health),
        ("GET", "/metrics", metrics),
        ("GET", "/sim/stats", sim_stats),
        ("POST", "/sim/control", sim_control),
    ]
    for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        routes += [
            ("GET", base, model_metadata),
            ("GET", f"{base}/ready", model_ready),
            ("GET", f"{base}/config", model_config),
            ("POST", f"{base}/infer", infer),
        ]
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)
    return app
