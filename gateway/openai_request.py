"""The part of an OpenAI request the gateway must understand; everything else passes through untouched."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from gateway.errors import InvalidRequest

Kind = Literal["completions", "chat"]


@dataclass(frozen=True)
class InferenceRequest:
    raw: bytes
    body: dict[str, Any]
    model: str | None
    stream: bool
    user: str | None

    def for_engine(self, engine_model: str) -> bytes:
        """The body to send upstream: the original bytes unless the model name must change."""
        if self.model == engine_model:
            return self.raw
        return json.dumps({**self.body, "model": engine_model}, separators=(",", ":")).encode()


def parse_inference(raw: bytes, kind: Kind) -> InferenceRequest:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    model = _optional(body, "model", str, "a string")
    stream = _optional(body, "stream", bool, "a boolean")
    user = _optional(body, "user", str, "a string")
    for field in ("max_tokens", "max_completion_tokens", "n"):
        value = _optional(body, field, int, "an integer")
        if value is not None and (isinstance(value, bool) or value < 1):
            raise InvalidRequest(f"'{field}' must be an integer of at least 1.", param=field)
    if kind == "completions":
        _check_prompt(body.get("prompt"))
    else:
        _check_messages(body.get("messages"))
    return InferenceRequest(raw=raw, body=body, model=model, stream=bool(stream), user=user)


def _optional(body: dict[str, Any], field: str, kind: type, described: str) -> Any:
    value = body.get(field)
    if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
        raise InvalidRequest(f"'{field}' must be {described}.", param=field)
    return value


def _check_prompt(prompt: Any) -> None:
    if isinstance(prompt, str) and prompt:
        return
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | int) for p in prompt):
        return
    raise InvalidRequest("'prompt' is required: a non-empty string or list.", param="prompt")


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' is required: a non-empty list of messages.", param="messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequest(f"'messages[{index}]' must be an object with a string 'role'.", param="messages")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise InvalidRequest(f"'messages[{index}].content' must be a string or a list.", param="messages")
