"""The part of an OpenAI request the gateway must understand, checked; the body passes through untouched.

Fields outside the allow-lists below are refused as OpenAI refuses them, so nothing unexpected reaches an engine.
The lists are OpenAI's completion and chat parameters plus vLLM's sampling extras.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from gateway.errors import InvalidRequest

Kind = Literal["completions", "chat"]

_COMMON = frozenset(
    {
        "model", "stream", "stream_options", "max_tokens", "n", "temperature", "top_p", "stop", "seed", "user",
        "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
        # vLLM's extras (its sampling parameters)
        "top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids",
        "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens", "length_penalty",
    }
)  # fmt: skip
_ALLOWED: dict[Kind, frozenset[str]] = {
    "completions": _COMMON | {"prompt", "suffix", "echo", "best_of"},
    "chat": _COMMON
    | {
        "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
        "response_format", "metadata", "store", "modalities", "reasoning_effort", "service_tier", "functions",
        "function_call", "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
    },
}  # fmt: skip


@dataclass(frozen=True)
class InferenceRequest:
    raw: bytes
    body: dict[str, Any]
    model: str | None
    stream: bool
    user: str | None
    max_tokens: int | None
    prompt_chars: int
    # How many completions the engine generates for it (n, or best_of when larger).
    choices: int = 1

    def for_engine(self, engine_model: str) -> bytes:
        """The body to send upstream: the original bytes unless the model name must change."""
        if self.model == engine_model:
            return self.raw
        return json.dumps({**self.body, "model": engine_model}, separators=(",", ":")).encode()


def parse_inference(
    raw: bytes, kind: Kind, *, max_depth: int = 32, max_prompt_chars: int = 200_000
) -> InferenceRequest:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    # Cheap first: only a body with many brackets can nest deeper than the bound.
    if raw.count(b"[") + raw.count(b"{") > max_depth and _depth(body) > max_depth:
        raise InvalidRequest(f"The request body nests deeper than {max_depth} levels.")
    unknown = sorted(set(body) - _ALLOWED[kind])
    if unknown:
        raise InvalidRequest(f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0])
    model = _optional(body, "model", str, "a string")
    stream = _optional(body, "stream", bool, "a boolean")
    user = _optional(body, "user", str, "a string")
    for field in ("max_tokens", "max_completion_tokens", "n"):
        value = _optional(body, field, int, "an integer")
        if value is not None and (isinstance(value, bool) or value < 1):
            raise InvalidRequest(f"'{field}' must be an integer of at least 1.", param=field)
    if kind == "completions":
        prompt_chars = _check_prompt(body.get("prompt"))
        max_tokens = body.get("max_tokens")
    else:
        prompt_chars = _check_messages(body.get("messages"))
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    if prompt_chars > max_prompt_chars:
        param = "prompt" if kind == "completions" else "messages"
        raise InvalidRequest(f"The prompt is longer than {max_prompt_chars} characters.", param=param)
    best_of = body.get("best_of")
    choices = max(body.get("n") or 1, best_of if isinstance(best_of, int) and not isinstance(best_of, bool) else 1)
    return InferenceRequest(raw, body, model, bool(stream), user, max_tokens, prompt_chars, choices)


def _optional(body: dict[str, Any], field: str, kind: type, described: str) -> Any:
    value = body.get(field)
    if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
        raise InvalidRequest(f"'{field}' must be {described}.", param=field)
    return value


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


def _check_prompt(prompt: Any) -> int:
    """The prompt's length in characters (token ids count 4 each, as a token is about 4 characters)."""
    if isinstance(prompt, str) and prompt:
        return len(prompt)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, str | int) and not isinstance(p, bool) for p in prompt)
    ):
        return sum(len(p) if isinstance(p, str) else 4 for p in prompt)
    raise InvalidRequest("'prompt' is required: a non-empty string or list.", param="prompt")


def _check_messages(messages: Any) -> int:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' is required: a non-empty list of messages.", param="messages")
    chars = 0
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequest(f"'messages[{index}]' must be an object with a string 'role'.", param="messages")
        content = message.get("content")
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            for part in content:
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise InvalidRequest(
                        f"'messages[{index}].content' parts must be objects with a 'type'.", param="messages"
                    )
                if part["type"] == "text" and not isinstance(part.get("text"), str):
                    raise InvalidRequest(
                        f"'messages[{index}].content' text parts need a string 'text'.", param="messages"
                    )
                chars += len(part.get("text") or "")
        elif content is not None:
            raise InvalidRequest(f"'messages[{index}].content' must be a string or a list.", param="messages")
    return chars
