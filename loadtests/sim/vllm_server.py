"""vLLM's OpenAI-compatible HTTP API over the simulated engine: the same routes, bodies, errors and streams.

Shapes were taken from a real vLLM 0.32 server (see tests/engines): a gateway in front must not be able to tell
the two apart except by timing and text.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from loadtests.sim.adapters import AdapterError
from loadtests.sim.control import ControlError, apply_control, engine_stats
from loadtests.sim.engine import PromptTooLong, SimEngine, SimRequest
from loadtests.sim.faults import Faults
from loadtests.sim.metrics import engine_metrics, render

ENGINE = web.AppKey("engine", SimEngine)
FAULTS = web.AppKey("faults", Faults)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ApiError(Exception):
    def __init__(self, message: str, status: int, error_type: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.error_type, self.param = status, error_type, param

    def response(self) -> web.Response:
        error = {"message": str(self), "type": self.error_type, "param": self.param, "code": self.status}
        return web.json_response({"error": error}, status=self.status)


def _bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(message, 400, "BadRequestError", param)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPNotFound:  # what FastAPI answers, e.g. to a router probing /model_info
        return web.json_response({"detail": "Not Found"}, status=404)
    except web.HTTPMethodNotAllowed:
        return web.json_response({"detail": "Method Not Allowed"}, status=405)


# --- request parsing ----------------------------------------------------------------------------------------
async def _json_object(request: web.Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.read())
    except ValueError as exc:
        raise ApiError(f"JSON decode error: {exc}", 400, "Bad Request", "body") from exc
    if not isinstance(body, dict):
        raise ApiError("Input should be a valid dictionary", 400, "Bad Request", "body")
    return body


def _optional_int(body: dict[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(f"Input should be a valid integer ({name})", 400, "Bad Request", f"body.{name}")
    if value < minimum:
        raise _bad_request(f"{name} must be at least {minimum}, got {value}.", name)
    return value


def _adapter_for(engine: SimEngine, model: Any) -> str | None:
    """None for the base model (named, empty or absent), else a registered adapter's name."""
    if model is None or model == "" or model == engine.model_name:
        return None
    if isinstance(model, str) and model in engine.adapters.registered:
        return model
    raise ApiError(
        f"The model `{model}` does not exist. Valid aliases: {engine.model_name}.", 404, "NotFoundError", "model"
    )


def _completion_prompts(body: dict[str, Any]) -> list[str]:
    """The completions request's prompts: one, or a batch (a list of strings, or of token-id lists), each answered
    as its own request. Token ids are read as text of their numbers (the simulator has no tokenizer)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(_token_ids(p) for p in prompt):
        return [" ".join(map(str, p)) for p in prompt]
    if isinstance(prompt, list) and _token_ids(prompt):
        return [" ".join(map(str, prompt))]
    prompts = prompt if isinstance(prompt, list) else [prompt]
    if not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise _bad_request("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    return [str(p) for p in prompts]


def _token_ids(prompt: Any) -> bool:
    """A non-empty list of integers (vLLM's prompt of token ids)."""
    return isinstance(prompt, list) and bool(prompt) and all(type(p) is int for p in prompt)


def _chat_prompt(body: dict[str, Any]) -> str:
    """Render messages with the tiny model's chat template (tests/engines/make_tiny_model.py)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("Field required (messages)", 400, "Bad Request", "body.messages")
    parts: list[str] = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError("Each message needs a role", 400, "Bad Request", "body.messages")
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if content is not None and not isinstance(content, str):
            raise ApiError("Message content should be a string", 400, "Bad Request", "body.messages")
        parts.append(f"<|{message['role']}|>\n{content or ''}\n")
    return "".join(parts) + "<|assistant|>\n"


def _submit(
    engine: SimEngine, adapter: str | None, prompt: str, max_tokens: int | None, body: dict[str, Any]
) -> SimRequest:
    try:
        salt = body.get("cache_salt")
        return engine.submit(
            adapter, prompt, max_tokens, ignore_eos=body.get("ignore_eos") is True,
            cache_salt=salt if isinstance(salt, str) and salt else None,
        )  # fmt: skip
    except PromptTooLong as exc:
        raise _bad_request(str(exc), "max_tokens") from exc


async def _tokens(engine: SimEngine, request: SimRequest) -> AsyncIterator[str]:
    """The request's tokens as the engine emits them; aborts the engine request if the consumer goes away."""
    try:
        while (token := await request.tokens.get()) is not None:
            yield token
    finally:
        engine.abort(request)


def _usage(faults: Faults, request: SimRequest) -> dict[str, int]:
    prompt, completion = len(request.prompt_tokens), len(request.answer)
    if faults.reported_completion_tokens is not None:
        completion = faults.reported_completion_tokens
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream") is True
    options = body.get("stream_options")
    if options is not None and not stream:
        raise _bad_request("Stream options can only be defined when `stream=True`.", "stream_options")
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    return stream, include_usage


def _check_n(body: dict[str, Any]) -> None:
    if body.get("n", 1) != 1:
        raise _bad_request("The simulator serves n=1 only.", "n")


# --- handlers -----------------------------------------------------------------------------------------------
def _fail_if_told(request: web.Request, adapter: str | None) -> None:
    if adapter is not None and adapter in request.app[FAULTS].failing_adapters:
        raise ApiError(f"Injected failure of adapter {adapter}", 500, "InternalServerError")


def _note_request(engine: SimEngine, request: web.Request) -> None:
    """What an inference request's headers said: all of them (a test checks what a router passes on), and the W3C
    traceparent, as vLLM takes it for its own traces."""
    engine.stats.request_headers.append(dict(request.headers))
    traceparent = request.headers.get("traceparent")
    if traceparent:
        engine.stats.traceparents.append(traceparent)


async def completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    _note_request(engine, request)
    body = await _json_object(request)
    adapter = _adapter_for(engine, body.get("model"))
    _fail_if_told(request, adapter)
    prompts = _completion_prompts(body)
    max_tokens = _optional_int(body, "max_tokens", 1)
    _check_n(body)
    stream, include_usage = _stream_options(body)
    if stream and len(prompts) > 1:
        raise _bad_request("The simulator streams one prompt at a time.", "prompt")
    if max_tokens is None:
        max_tokens = engine.params.default_completion_max_tokens
    batch = [_submit(engine, adapter, prompt, max_tokens, body) for prompt in prompts]
    head = {
        "id": f"cmpl-{uuid.uuid4().hex[:16]}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.get("model") or engine.model_name,
    }
    if not stream:  # a batch as vLLM answers one: a choice per prompt, in order, and their usage summed
        choices, usage = [], {"prompt_tokens": 0, "total_tokens": 0, "completion_tokens": 0}
        for index, each in enumerate(batch):
            words = [token async for token in _tokens(engine, each)]
            text = " ".join(words)
            choices.append(
                {
                    "index": index,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": each.finish_reason,
                    "stop_reason": None,
                }
            )
            for field, count in _usage(request.app[FAULTS], each).items():
                usage[field] += count
        return web.json_response({**head, "choices": choices, "usage": usage})
    sim_request = batch[0]

    response = await _start_sse(request)

    def text_choice(piece: str, finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": piece, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}

    await _stream_tokens(request, response, head, sim_request, text_choice)
    return await _end_sse(request, response, head, sim_request, include_usage)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    _note_request(engine, request)
    body = await _json_object(request)
    adapter = _adapter_for(engine, body.get("model"))
    _fail_if_told(request, adapter)
    prompt = _chat_prompt(body)
    max_tokens = _optional_int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _optional_int(body, "max_tokens", 1)
    _check_n(body)
    stream, include_usage = _stream_options(body)
    sim_request = _submit(engine, adapter, prompt, max_tokens, body)
    head = {
        "id": f"chatcmpl-{uuid.uuid4().hex[:16]}",
        "object": "chat.completion" if not stream else "chat.completion.chunk",
        "created": int(time.time()),
        "model": body.get("model") or engine.model_name,
    }
    if not stream:
        words = [token async for token in _tokens(engine, sim_request)]
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": " ".join(words)},
            "logprobs": None,
            "finish_reason": sim_request.finish_reason,
            "stop_reason": None,
        }
        return web.json_response({**head, "choices": [choice], "usage": _usage(request.app[FAULTS], sim_request)})

    response = await _start_sse(request)
    opening = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    await response.write(_sse({**head, "choices": [opening]}))

    def delta_choice(piece: str, finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "delta": {"content": piece}, "logprobs": None, "finish_reason": finish_reason}

    await _stream_tokens(request, response, head, sim_request, delta_choice)
    return await _end_sse(request, response, head, sim_request, include_usage)


async def _stream_tokens(
    request: web.Request,
    response: web.StreamResponse,
    head: dict[str, Any],
    sim_request: SimRequest,
    choice: Callable[[str, str | None], dict[str, Any]],
) -> None:
    """One SSE chunk per token as the engine emits it; the last one carries the finish reason."""
    index = 0
    cut_after = request.app[FAULTS].cut_stream_after
    async for token in _tokens(request.app[ENGINE], sim_request):
        if cut_after is not None and index >= cut_after:
            if request.transport is not None:  # an injected fault: the connection goes away mid-stream
                request.transport.abort()
            return
        last = index + 1 == len(sim_request.answer)
        piece = token if index == 0 else " " + token
        await response.write(_sse({**head, "choices": [choice(piece, sim_request.finish_reason if last else None)]}))
        index += 1


async def _start_sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await response.prepare(request)
    return response


async def _end_sse(
    request: web.Request,
    response: web.StreamResponse,
    head: dict[str, Any],
    sim_request: SimRequest,
    include_usage: bool,
) -> web.StreamResponse:
    if include_usage:
        await response.write(_sse({**head, "choices": [], "usage": _usage(request.app[FAULTS], sim_request)}))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    created = int(time.time())

    def card(model_id: str, root: str, parent: str | None) -> dict[str, Any]:
        return {
            "id": model_id,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": root,
            "parent": parent,
            "max_model_len": None if parent else engine.params.max_model_len,
        }

    data = [card(engine.model_name, engine.model_name, None)]
    data += [card(a.name, a.path, engine.model_name) for a in engine.adapters.registered.values()]
    return web.json_response({"object": "list", "data": data})


def _lora_name(body: dict[str, Any]) -> str:
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise ApiError("Field required (lora_name)", 400, "Bad Request", "body.lora_name")
    return name


async def load_lora_adapter(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    body = await _json_object(request)
    name, path = _lora_name(body), body.get("lora_path")
    if not isinstance(path, str) or not path:
        raise ApiError("Field required (lora_path)", 400, "Bad Request", "body.lora_path")
    try:
        await engine.load_adapter(name, path)
    except AdapterError as exc:
        raise ApiError(str(exc), exc.status, exc.error_type) from exc
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    name = _lora_name(await _json_object(request))
    try:
        engine.unload_adapter(name)
    except AdapterError as exc:
        raise ApiError(str(exc), exc.status, exc.error_type) from exc
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


async def health(request: web.Request) -> web.Response:
    request.app[ENGINE].stats.health_probes += 1
    return web.Response(status=200)


async def sim_stats(request: web.Request) -> web.Response:
    return web.json_response(engine_stats(request.app[ENGINE]))


async def sim_timeline(request: web.Request) -> web.Response:
    return web.json_response(request.app[ENGINE].timeline.as_json())


async def sim_control(request: web.Request) -> web.Response:
    try:
        state = apply_control(request.app[ENGINE], request.app[FAULTS], await _json_object(request))
    except ControlError as exc:
        raise _bad_request(str(exc), exc.param) from exc
    return web.json_response(state)


def create_app(engine: SimEngine, lora_modules: dict[str, str]) -> web.Application:
    faults = Faults()
    app = web.Application(middlewares=[_errors, faults.middleware()])
    app[ENGINE] = engine
    app[FAULTS] = faults
    registry = engine_metrics(engine)

    async def metrics(request: web.Request) -> web.Response:
        engine.stats.metrics_scrapes += 1
        return web.Response(body=render(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def engine_running(app: web.Application) -> AsyncIterator[None]:
        await engine.start()
        for name, path in lora_modules.items():  # as vLLM's --lora-modules: each goes through the load path
            await engine.load_adapter(name, path)
        yield
        await engine.stop()

    app.cleanup_ctx.append(engine_running)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/sim/stats", sim_stats)
    app.router.add_get("/sim/timeline", sim_timeline)
    app.router.add_post("/sim/control", sim_control)
    return app
