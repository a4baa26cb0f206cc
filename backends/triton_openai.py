"""OpenAI requests in, TensorRT-LLM model calls out, and OpenAI answers back: the translation the Triton driver
needs, with no I/O, so every shape is tested without a server.

A tenant must not be able to tell which engine served it: answers have the same fields, ids, chunking and
``[DONE]`` ending as vLLM's. Fields TensorRT-LLM cannot honour are refused with a 400 naming them, not dropped.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from backends.errors import EngineRejected

# ChatML, which most instruction-tuned models understand; pools set their model's own template in config.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_SAMPLING_FLOATS = (
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "length_penalty",
)
_SAMPLING_INTS = {"top_k": 2**31 - 1, "seed": 2**64 - 1, "min_tokens": 2**31 - 1}  # and their largest values
_INT32_MAX = 2**31 - 1
# What this translation honours; everything else the gateway lets through (vLLM's extras, tools, logprobs, ...)
# is refused while it asks for something, so no request is silently served differently than it asked.
_HONOURED = frozenset(
    {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options", "stop", "echo",
     "n", "best_of", "add_generation_prompt", *_SAMPLING_FLOATS, *_SAMPLING_INTS}
)  # fmt: skip
# Fields with no effect on the answer (bookkeeping, detokenizer options TensorRT-LLM's postprocessing fixes).
_NO_EFFECT = frozenset(
    {"user", "metadata", "store", "service_tier", "skip_special_tokens", "spaces_between_special_tokens",
     "parallel_tool_calls"}
)  # fmt: skip
_UNSET: tuple[Any, ...] = (None, False, [], {}, "none", "auto", ["text"])


@dataclass(frozen=True)
class TritonCall:
    """One OpenAI request as a TensorRT-LLM model call, plus what the answer needs to look like."""

    chat: bool
    model: str
    prompt: str
    max_tokens: int
    stream: bool
    include_usage: bool = False
    echo: bool = False
    sampling: dict[str, float | int] = field(default_factory=dict)
    stop: tuple[str, ...] = ()


class ChatTemplate:
    """A pool's chat template, compiled once; rendering runs in Jinja's sandbox (the messages are tenant input)."""

    def __init__(self, source: str | None) -> None:
        environment = ImmutableSandboxedEnvironment(trim_blocks=False, autoescape=False)
        self._template = environment.from_string(source or DEFAULT_CHAT_TEMPLATE)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt)
        except TemplateError as exc:
            raise EngineRejected(400, f"the chat could not be rendered by the model's chat template: {exc}") from exc


def parse_request(chat: bool, body: bytes, template: ChatTemplate, default_max_tokens: int) -> TritonCall:
    """The request body (an OpenAI completion or chat request) as a model call; ``EngineRejected(400)`` if not.
    ``default_max_tokens`` applies to chat; completions default to 16, as OpenAI's API does."""
    try:
        request = orjson.loads(body)
    except ValueError as exc:
        raise EngineRejected(400, f"the request body is not JSON: {exc}") from exc
    if not isinstance(request, dict):
        raise EngineRejected(400, "the request body must be a JSON object")
    for name, value in request.items():
        if name not in _HONOURED and name not in _NO_EFFECT and value not in _UNSET:
            raise EngineRejected(400, f"'{name}' is not supported by this model's engine (Triton/TensorRT-LLM)")
    for name in ("n", "best_of"):
        if request.get(name, 1) not in (1, None):
            raise EngineRejected(400, f"'{name}' must be 1 on this model's engine (Triton/TensorRT-LLM)")
    prompt = _chat_prompt(request, template) if chat else _completion_prompt(request)
    limit = request.get("max_completion_tokens") if chat else None
    default = default_max_tokens if chat else 16
    max_tokens = _int(request, "max_completion_tokens" if limit is not None else "max_tokens", default)
    if not 1 <= max_tokens <= _INT32_MAX:
        raise EngineRejected(400, f"'max_tokens' must be between 1 and {_INT32_MAX}")
    options = request.get("stream_options") or {}
    return TritonCall(
        chat=chat,
        model=str(request.get("model", "")),
        prompt=prompt,
        max_tokens=max_tokens,
        stream=bool(request.get("stream")),
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        echo=bool(request.get("echo")) and not chat,
        sampling=_sampling(request),
        stop=_stop(request.get("stop")),
    )


def _completion_prompt(request: dict[str, Any]) -> str:
    prompt = request.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise EngineRejected(400, "'prompt' must be a string (token ids and batches are not supported by this engine)")
    return prompt


def _chat_prompt(request: dict[str, Any], template: ChatTemplate) -> str:
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        raise EngineRejected(400, "'messages' must be a non-empty list")
    flat = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise EngineRejected(400, f"messages[{index}] must be an object with a 'role'")
        flat.append({"role": message["role"], "content": _text_content(message.get("content"), index)})
    return template.render(flat, request.get("add_generation_prompt", True) is not False)


def _text_content(content: Any, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise EngineRejected(400, f"messages[{index}].content: only text parts are supported by this engine")
            parts.append(part["text"])
        return "".join(parts)
    raise EngineRejected(400, f"messages[{index}].content must be a string or a list of text parts")


def _int(request: dict[str, Any], name: str, default: int) -> int:
    value = request.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise EngineRejected(400, f"'{name}' must be an integer")
    return value


def _sampling(request: dict[str, Any]) -> dict[str, float | int]:
    sampling: dict[str, float | int] = {}
    for name in _SAMPLING_FLOATS:
        value = request.get(name)
        if value is not None:
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise EngineRejected(400, f"'{name}' must be a number")
            sampling[name] = float(value)
    for name, largest in _SAMPLING_INTS.items():
        value = request.get(name)
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= largest:
                raise EngineRejected(400, f"'{name}' must be an integer between 0 and {largest}")
            sampling[name] = value
    return sampling


def _stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(word, str) for word in stop):
        return tuple(stop)
    raise EngineRejected(400, "'stop' must be a string or a list of strings")


class AnswerWriter:
    """Builds one request's OpenAI answer, whole or as SSE chunks, with vLLM's shapes."""

    def __init__(self, call: TritonCall) -> None:
        self.call = call
        self.id = f"{'chatcmpl' if call.chat else 'cmpl'}-{secrets.token_hex(16)}"  # as uuid4().hex, for less
        self.created = int(time.time())
        self._object = "chat.completion" if call.chat else "text_completion"

    def finish_reason(self, output_tokens: int | None) -> str:
        return "length" if output_tokens is not None and output_tokens >= self.call.max_tokens else "stop"

    def whole(self, text: str, usage: dict[str, int] | None) -> bytes:
        finish = self.finish_reason(usage["completion_tokens"] if usage else None)
        if self.call.chat:
            message = {"role": "assistant", "content": text}
            choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        choice["stop_reason"] = None
        answer = {"id": self.id, "object": self._object, "created": self.created, "model": self.call.model}
        answer["choices"] = [choice]
        if usage is not None:
            answer["usage"] = usage
        return orjson.dumps(answer)

    def opening(self) -> bytes:
        """Chat streams open with the assistant's role, as vLLM's do; completions need no opening."""
        if not self.call.chat:
            return b""
        delta = {"role": "assistant", "content": ""}
        return self._event({"choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]})

    def chunk(self, text: str, finish: str | None = None) -> bytes:
        if self.call.chat:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
        return self._event({"choices": [choice]})

    def ending(self, usage: dict[str, int] | None) -> bytes:
        """The chunk with the finish reason (the engine's stream says it ended only by ending), the usage chunk
        when asked for, and ``[DONE]``."""
        finish = self.finish_reason(usage["completion_tokens"] if usage else None)
        events = self.chunk("", finish=finish)
        if self.call.include_usage and usage is not None:
            events += self._event({"choices": [], "usage": usage})
        return events + b"data: [DONE]\n\n"

    def _event(self, payload: dict[str, Any]) -> bytes:
        head = {"id": self.id, "object": f"{self._object}.chunk" if self.call.chat else self._object}
        body = {**head, "created": self.created, "model": self.call.model, **payload}
        return b"data: " + orjson.dumps(body) + b"\n\n"


def usage(prompt_tokens: int | None, completion_tokens: int | None) -> dict[str, int] | None:
    if prompt_tokens is None or completion_tokens is None:
        return None
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
