"""Triton's KServe v2 HTTP endpoint over the simulated TensorRT-LLM model: health, server and model metadata, the
model config, ``/metrics``, infer refused as Triton refuses it for a decoupled model, and the generate extension's
``generate_stream`` (what the gateway's driver sends streaming requests over). Errors are Triton's
``{"error": "<message>"}``. The simulator's own /sim routes (loadtests/sim/control.py) add the PEFT cache.

``generate_stream`` as Triton 2.51 answers it (checked against the real server; server ``src/http_server.cc``):
the body is a JSON object whose keys that name an input carry its value; the answer is server-sent events, one
``data: {...}`` per model response (``model_name``, ``model_version`` and the outputs by name, one-element outputs as
a scalar); the first response sets the status (an error first: its HTTP status, and one ``data: {"error": ...}``
event); an error later is a ``data: {"error": ...}`` event; a request Triton cannot read (not JSON, a value of the
wrong type, FP16) is a plain ``{"error": ...}`` with 400 or 500. A client that closes the connection cancels the
request (Triton notices at the model's next response; here at once)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from loadtests.sim.control import ControlError, apply_control, engine_stats
from loadtests.sim.faults import Faults
from loadtests.sim.triton_contract import (
    EXTENSIONS,
    SERVER_NAME,
    SERVER_VERSION,
    VERSION,
    GenerateRequest,
    check_model,
    config_json,
    metadata_json,
    parse_json_request,
)
from loadtests.sim.triton_errors import Kind, TritonError, decoupled_refused
from loadtests.sim.triton_metrics import triton_metrics
from loadtests.sim.triton_model import Reply, TrtLlmModel, refuse_by_faults

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


async def generate_stream(request: web.Request) -> web.StreamResponse:
    name = _checked_model(request)
    try:
        body = json.loads(await request.read())
    except ValueError as exc:
        raise TritonError(f"failed to parse the request JSON buffer: {exc}", Kind.INTERNAL) from exc
    parsed = parse_json_request(name, body)
    request.app[MODEL].protocols["http"] += 1
    faults = request.app[FAULTS]
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    try:
        refuse_by_faults(faults, parsed)
        sent = 0
        async with contextlib.aclosing(request.app[MODEL].generate(parsed)) as replies:
            async for reply in replies:
                if faults.cut_stream_after is not None and sent >= faults.cut_stream_after:
                    if request.transport is not None:  # an injected fault: the connection goes away mid-answer
                        request.transport.abort()
                    return response
                if not response.prepared:
                    await response.prepare(request)
                await response.write(_event(_outputs(name, parsed, reply)))
                sent += 1
    except TritonError as exc:
        if not response.prepared:  # the first response is the error: its status, then the event
            response.set_status(exc.kind.http_status)
            await response.prepare(request)
        await response.write(_event({"error": str(exc)}))
    if not response.prepared:
        await response.prepare(request)
    await response.write_eof()
    return response


def _outputs(model: str, request: GenerateRequest, reply: Reply) -> dict[str, Any]:
    outputs: dict[str, Any] = {"model_name": model, "model_version": VERSION, "text_output": reply.text}
    if request.return_num_input_tokens:
        outputs["num_input_tokens"] = reply.num_input_tokens
    if request.return_num_output_tokens:
        outputs["num_output_tokens"] = reply.num_output_tokens
    return outputs


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


async def sim_stats(request: web.Request) -> web.Response:
    peft = request.app[MODEL].peft
    cache = {
        "capacity": peft.capacity,
        "cached": [str(task) for task in peft.cached],
        "in_flight": {str(task): n for task, n in peft.in_flight.items()},
        "weights_at": {str(task): at for task, at in peft.weights_at.items()},
        "released_at": {str(task): at for task, at in peft.released_at.items()},
    }
    protocols = {"requests_by_protocol": dict(request.app[MODEL].protocols)}
    stats = {**engine_stats(request.app[MODEL].engine), "peft_cache": cache, **peft.stats.as_json(), **protocols}
    return web.json_response(stats)


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
    routes: list[tuple[str, str, Callable[[web.Request], Awaitable[web.StreamResponse]]]] = [
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
            ("POST", f"{base}/generate_stream", generate_stream),
        ]
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)
    return app
