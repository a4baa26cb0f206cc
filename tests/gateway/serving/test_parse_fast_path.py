"""``parse_inference``'s cheaper checks (the allow-list asked per key, the typed fields in one pass over the body's
items, the empty sets shared) accept and refuse exactly what the plain checks did, with the same message: the plain
version is kept here as the reference."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gateway.errors import InvalidRequest
from gateway.serving.json_body import parse_object
from gateway.serving.openai_request import (
    _ALLOWED,
    _TYPED,
    InferenceRequest,
    Kind,
    _check_messages,
    _check_prompt,
    _optional,
    _prompts,
    _template_kwargs,
    parse_inference,
)


def plain(
    raw: bytes, kind: Kind, *, max_depth: int = 32, max_prompt_chars: int = 200_000, max_choices: int = 128
) -> InferenceRequest:
    """parse_inference as it was before the cut (main at c8b04a0, with max_choices as main has it since)."""
    body = parse_object(raw, max_depth)
    if body.keys() - _ALLOWED[kind]:
        unknown = sorted(body.keys() - _ALLOWED[kind])
        raise InvalidRequest(f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0])
    for field, kind_of, described in _TYPED:
        if field in body:
            value = _optional(body, field, kind_of, described)
            if kind_of is int and value is not None and value < 1:
                raise InvalidRequest(f"'{field}' must be an integer of at least 1.", param=field)
    model, stream, user = body.get("model") or None, body.get("stream"), body.get("user")
    part_types: set[str] = set()
    part_urls: list[str] = []
    template_kwargs: frozenset[str] = frozenset()
    prompts = 1
    if kind == "completions":
        prompt = body.get("prompt")
        prompt_chars = _check_prompt(prompt)
        prompts = _prompts(prompt)
        max_tokens = body.get("max_tokens")
    else:
        prompt_chars = _check_messages(body.get("messages"), part_types, part_urls)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        template_kwargs = _template_kwargs(body.get("chat_template_kwargs"))
    if prompt_chars > max_prompt_chars:
        param = "prompt" if kind == "completions" else "messages"
        raise InvalidRequest(f"The prompt is longer than {max_prompt_chars} characters.", param=param)
    best_of = body.get("best_of")
    each = max(body.get("n") or 1, best_of if isinstance(best_of, int) and not isinstance(best_of, bool) else 1)
    choices = prompts * each
    if choices > max_choices:
        raise InvalidRequest(
            f"The request asks for {choices} completions ({prompts} prompts x {each} each); at most {max_choices}.",
            param="n" if prompts == 1 else "prompt",
        )
    return InferenceRequest(
        body, model, bool(stream), user, max_tokens, prompt_chars, choices, frozenset(part_types),
        template_kwargs, tuple(part_urls),
    )  # fmt: skip


def outcome(parse: Any, raw: bytes, kind: Kind) -> object:
    try:
        return parse(raw, kind, max_prompt_chars=30, max_choices=2)
    except InvalidRequest as exc:
        return ("refused", str(exc), exc.param)


VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-2, 3), st.sampled_from([1.5, 4.0, "", "x" * 40, "lora", [], {}]),
    st.sampled_from([["a", "b"], [1, 2], [True], {"include_usage": True}]),
)  # fmt: skip
FIELDS = st.sampled_from(
    ["model", "stream", "stream_options", "user", "max_tokens", "max_completion_tokens", "n", "best_of", "prompt",
     "messages", "chat_template_kwargs", "temperature", "unknown_field", "suffix", "tools"]
)  # fmt: skip
MESSAGES = st.sampled_from(
    [[{"role": "user", "content": "hi"}], [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
     [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]}], "no"]
)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(FIELDS, VALUES, max_size=7), st.sampled_from(["completions", "chat"]), MESSAGES, st.booleans())
@example({"model": "lora-t01", "prompt": "how fast", "max_tokens": 4}, "completions", [], False)
@example({"model": 3, "n": 0, "prompt": "x"}, "completions", [], False)  # two wrong: the first in _TYPED's order
@example({"n": 0, "stream": "yes", "prompt": "x"}, "completions", [], False)
@example({"max_tokens": True, "prompt": "x"}, "completions", [], False)  # a bool is no integer
def test_the_fast_checks_decide_as_the_plain_ones(
    body: dict[str, Any], kind: Kind, messages: Any, with_messages: bool
) -> None:
    if with_messages:
        body = {**body, "messages": messages}
    raw = orjson.dumps(body)
    assert outcome(parse_inference, raw, kind) == outcome(plain, raw, kind)


def python_events(call: Any, *args: Any) -> int:
    """How many Python-level calls and generator resumptions ``call`` makes (sys.setprofile's ``call`` events):
    what a C loop does not add per item."""
    import sys

    events = 0

    def count(frame: Any, event: str, arg: Any) -> None:
        nonlocal events
        events += event == "call"

    sys.setprofile(count)
    try:
        call(*args)
    finally:
        sys.setprofile(None)
    return events


@pytest.mark.parametrize(
    "prompt",
    [
        pytest.param([1] * 300_000, id="token ids"),
        pytest.param(["ab"] * 300_000, id="strings"),
        pytest.param(["ab", *[7] * 300_000], id="mixed"),
    ],
)
def test_a_long_prompt_list_is_read_without_a_python_step_per_item(prompt: list[object]) -> None:
    """300,000 token ids in a completions prompt (600 KB, within max_body_bytes): _check_prompt's all() and sum()
    resumed a generator per item, twice, ~95 ms of the event loop for one request, which was then refused (longer
    than max_prompt_chars) or not. The same figures now, read by C loops."""
    expected = sum(len(p) if isinstance(p, str) else 4 for p in prompt)
    assert _check_prompt(prompt) == expected
    assert python_events(_check_prompt, prompt) < 20
    assert python_events(_prompts, prompt) < 20
    assert _prompts(prompt) == (len(prompt) if all(isinstance(p, str) for p in prompt) else 1)


def test_a_batch_of_token_id_prompts_is_a_batch_read_by_c_loops() -> None:
    """OpenAI's fourth prompt shape, a list of token-id lists, is a batch (each list one prompt with its own n
    choices): it was refused as "'prompt' is required". Its figures are read without a Python step per item."""
    request = parse_inference(orjson.dumps({"prompt": [[1, 2, 3], [4]], "n": 2}), "completions")
    assert (request.prompt_chars, request.choices) == (16, 4)
    batch = [[7] * 1_000] * 300
    assert _check_prompt(batch) == 4 * 300_000
    assert python_events(_check_prompt, batch) < 20
    assert _prompts(batch) == 300
    assert python_events(_prompts, batch) < 20


@pytest.mark.parametrize(
    "prompt",
    [[[1], []], [[1], ["a"]], [[True]], [[1.5]], [[1], 2], [[[1]]], [[]]],
    ids=["an empty list", "a string inside", "a bool", "a float", "a list and an id", "nested deeper", "one empty"],
)
def test_a_malformed_batch_of_token_id_prompts_is_refused(prompt: list[object]) -> None:
    with pytest.raises(InvalidRequest, match="'prompt' is required") as refused:
        parse_inference(orjson.dumps({"prompt": prompt}), "completions")
    assert refused.value.param == "prompt"
