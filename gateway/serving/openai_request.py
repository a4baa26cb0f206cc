"""The part of an OpenAI request the gateway must understand, checked; what goes to the engine is the body as
parsed and checked, serialised again (gateway/serving/json_body.py), never the client's bytes: a duplicated key,
for one, reaches the engine once, with the value that was authorised.

Fields outside the allow-lists below are refused as OpenAI refuses them, so nothing unexpected reaches an engine.
The lists are OpenAI's completion and chat parameters plus vLLM's sampling extras. What a pool lets through
beyond that (chat content part types, ``chat_template_kwargs`` keys) is checked once the model's pool is known.
"""

from __future__ import annotations

from itertools import chain, compress, repeat
from operator import is_
from typing import Any, Literal, NamedTuple
from urllib.parse import urlsplit

from gateway.adapter_sources import public_host
from gateway.errors import InvalidRequest
from gateway.serving.json_body import MAX_CONTAINERS, RefusedInput, dumps, parse_object

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


class InferenceRequest(NamedTuple):  # immutable, and built per request at a third of a frozen dataclass's cost
    body: dict[str, Any]
    # None when the request names none, or names "" (as vLLM reads it): the tenant's default model.
    model: str | None
    stream: bool
    user: str | None
    max_tokens: int | None
    prompt_chars: int
    # How many completions the engine generates for it: n (or best_of when larger) for each prompt of a batch.
    choices: int = 1
    # The chat content part types the messages use, and the chat_template_kwargs keys the request sets.
    part_types: frozenset[str] = frozenset()
    template_kwargs: frozenset[str] = frozenset()
    # URLs the content parts point at (image_url and the like), for an engine to fetch.
    part_urls: tuple[str, ...] = ()

    def check_pool(self, part_types: frozenset[str], template_kwargs: frozenset[str]) -> None:
        """What the model's pool lets through: content part types, chat_template_kwargs keys (both allow-lists)."""
        parts = sorted(self.part_types - part_types) if self.part_types else None
        if parts:
            allowed = ", ".join(sorted(part_types)) or "none"
            raise RefusedInput(
                f"Content parts of type {parts[0]!r} are not accepted for this model (accepted: {allowed}).",
                "content_part",
                param="messages",
            )
        for url in self.part_urls:  # only parts a pool allows get here: never a local file or a private address
            if not _fetchable(url):
                raise RefusedInput(
                    "Content part URLs must be http(s) to a public address, or data: URLs.", "content_part",
                    param="messages",
                )  # fmt: skip
        keys = sorted(self.template_kwargs - template_kwargs) if self.template_kwargs else None
        if keys:
            allowed = ", ".join(sorted(template_kwargs)) or "none"
            raise RefusedInput(
                f"chat_template_kwargs key {keys[0]!r} is not accepted for this model (accepted: {allowed}).",
                "template_kwargs",
                param="chat_template_kwargs",
            )

    @property
    def client_wants_usage(self) -> bool:
        options = self.body.get("stream_options")
        return isinstance(options, dict) and options.get("include_usage") is True

    def for_engine(self, engine_model: str, *, max_tokens: int | None = None, cache_salt: str | None = None) -> bytes:
        """The body to send upstream: the one that was parsed and checked, with the engine's model name;
        ``max_tokens`` when the request named none (the tenant's cap). A stream always asks the engine for its
        usage, so its tokens are counted whatever the client asked (relay strips the usage chunk it did not).
        ``cache_salt``: the tenant's prefix-cache salt (the client cannot send one: not an allowed field)."""
        body = {**self.body, "model": engine_model}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        if max_tokens is not None and self.max_tokens is None:
            body["max_tokens"] = max_tokens
        if self.stream and not self.client_wants_usage:
            body["stream_options"] = {**(self.body.get("stream_options") or {}), "include_usage": True}
        return dumps(body)


def parse_inference(
    raw: bytes, kind: Kind, *, max_depth: int = 32, max_prompt_chars: int = 200_000, max_choices: int = 128,
    max_containers: int = MAX_CONTAINERS,
) -> InferenceRequest:  # fmt: skip
    body = parse_object(raw, max_depth, max_containers)
    allowed = _ALLOWED[kind]
    # Each of the body's few keys looked up in the allow-list: ``body.keys() - allowed`` walked the whole list (about
    # 5,000 instructions a request, for nothing in the usual case).
    if not body.keys() <= allowed:
        unknown = sorted(body.keys() - allowed)
        raise InvalidRequest(f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0])
    # The typed fields the body sets, each of exactly its type (JSON gives no subclass but bool, which is no
    # integer here) and an integer at least 1: one pass over the body's items. Anything else goes to _check_typed,
    # which names the first wrong one in _TYPED's order, as it always did.
    for field, value in body.items():
        expected = _TYPE_OF.get(field)
        if (
            expected is not None
            and value is not None
            and (type(value) is not expected or (expected is int and value < 1))
        ):
            _check_typed(body)
            break
    model, stream, user = body.get("model") or None, body.get("stream"), body.get("user")
    part_types, template_kwargs, part_urls = _NO_NAMES, _NO_NAMES, _NO_URLS
    if kind == "completions":
        prompt = body.get("prompt")
        prompt_chars = _check_prompt(prompt)
        prompts = _prompts(prompt)
        max_tokens = body.get("max_tokens")
        if prompt_chars > max_prompt_chars:
            raise InvalidRequest(f"The prompt is longer than {max_prompt_chars} characters.", param="prompt")
    else:
        types: set[str] = set()
        urls: list[str] = []
        prompt_chars = _check_messages(body.get("messages"), types, urls)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        template_kwargs = _template_kwargs(body.get("chat_template_kwargs"))
        if prompt_chars > max_prompt_chars:
            raise InvalidRequest(f"The prompt is longer than {max_prompt_chars} characters.", param="messages")
        prompts, part_types, part_urls = 1, frozenset(types), tuple(urls)
    best_of = body.get("best_of")
    each = max(body.get("n") or 1, best_of if isinstance(best_of, int) and not isinstance(best_of, bool) else 1)
    choices = prompts * each
    if choices > max_choices:  # each is a sequence of its own on the engine (config.LimitsConfig.max_choices)
        raise InvalidRequest(
            f"The request asks for {choices} completions ({prompts} prompts x {each} each); at most {max_choices}.",
            param="n" if prompts == 1 else "prompt",
        )
    return InferenceRequest(
        body, model, bool(stream), user, max_tokens, prompt_chars, choices, part_types, template_kwargs, part_urls,
    )  # fmt: skip


def _check_typed(body: dict[str, Any]) -> None:
    """Refuse the first of _TYPED's fields, in its order, that the body sets to a value of another type (or, for an
    integer, below 1)."""
    for field, kind_of, described in _TYPED:
        if field in body:  # most requests set few of them: only those are checked
            value = _optional(body, field, kind_of, described)
            if kind_of is int and value is not None and value < 1:
                raise InvalidRequest(f"'{field}' must be an integer of at least 1.", param=field)


_NO_NAMES: frozenset[str] = frozenset()
_NO_URLS: tuple[str, ...] = ()


# The fields whose type is checked, in the order they are (the first wrong one is the error); integers at least 1.
_TYPED: tuple[tuple[str, type, str], ...] = (
    ("model", str, "a string"), ("stream", bool, "a boolean"), ("stream_options", dict, "an object"),
    ("user", str, "a string"), ("max_tokens", int, "an integer"), ("max_completion_tokens", int, "an integer"),
    ("n", int, "an integer"),
)  # fmt: skip
_TYPE_OF: dict[str, Any] = {field: kind_of for field, kind_of, _ in _TYPED}


def _fetchable(url: str) -> bool:
    try:
        parts = urlsplit(url)
        scheme, host = parts.scheme.lower(), parts.hostname or ""
    except ValueError:  # e.g. a bracketed host that is no IPv6 address
        return False
    return scheme == "data" or (scheme in ("http", "https") and public_host(host))


def _template_kwargs(value: Any) -> frozenset[str]:
    if value is None:
        return frozenset()
    if not isinstance(value, dict):
        raise InvalidRequest("'chat_template_kwargs' must be an object.", param="chat_template_kwargs")
    return frozenset(value)


def _optional(body: dict[str, Any], field: str, kind: type, described: str) -> Any:
    value = body.get(field)
    if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
        raise InvalidRequest(f"'{field}' must be {described}.", param=field)
    return value


def _check_prompt(prompt: Any) -> int:
    """The prompt's length in characters (token ids count 4 each, as a token is about 4 characters). A list is read
    by C loops (its items' types, their lengths), not a generator per item: 300,000 token ids (600 KB, within
    max_body_bytes) took two Python passes, ~95 ms of the event loop for one request, refused or not."""
    if isinstance(prompt, str) and prompt:
        return len(prompt)
    if isinstance(prompt, list) and prompt:
        types = list(map(type, prompt))  # bool is its own type: no token id
        kinds = set(types)
        if kinds == _INT:
            return 4 * len(prompt)
        if kinds == _STR:
            return sum(map(len, prompt))
        if kinds == _INT_OR_STR:
            strings = list(compress(prompt, map(is_, types, repeat(str))))
            return 4 * (len(prompt) - len(strings)) + sum(map(len, strings))
        # A batch of token-id prompts (OpenAI's fourth shape): each a non-empty list of integers, read by C loops too.
        if kinds == _LIST and all(prompt) and set(map(type, chain.from_iterable(prompt))) == _INT:
            return 4 * sum(map(len, prompt))
    raise InvalidRequest(
        "'prompt' is required: a non-empty string, list of strings, list of token ids or list of token-id lists.",
        param="prompt",
    )


_INT, _STR, _INT_OR_STR, _LIST = frozenset({int}), frozenset({str}), frozenset({int, str}), frozenset({list})


def _prompts(prompt: Any) -> int:
    """How many prompts a (checked) completions ``prompt`` holds: a list of strings is a batch, each prompt answered
    with its own ``n`` choices, and so is a list of token-id lists (an engine reads a list of integers as one prompt's
    token ids)."""
    if isinstance(prompt, list) and frozenset(map(type, prompt)) in (_STR, _LIST):
        return len(prompt)
    return 1


def _check_messages(messages: Any, part_types: set[str], part_urls: list[str]) -> int:
    """The messages' text length in characters; the content part types they use are added to ``part_types``, and
    the URLs parts point at (``{"type": T, T: {"url": ...}}``) to ``part_urls``."""
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
                part_types.add(part["type"])
                payload = part.get(part["type"])
                if isinstance(payload, dict) and "url" in payload:
                    if not isinstance(payload["url"], str):
                        raise InvalidRequest(
                            f"'messages[{index}].content' part URLs must be strings.", param="messages"
                        )
                    part_urls.append(payload["url"])
                text = part.get("text")
                chars += len(text) if isinstance(text, str) else 0
        elif content is not None:
            raise InvalidRequest(f"'messages[{index}].content' must be a string or a list.", param="messages")
    return chars
