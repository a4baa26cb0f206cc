"""OpenAI <-> TensorRT-LLM translation: requests become model calls, answers keep vLLM's shapes."""

from __future__ import annotations

import json

import pytest

from backends.errors import EngineRejected
from backends.triton_openai import AnswerWriter, ChatTemplate, TritonCall, parse_request, usage

TEMPLATE = ChatTemplate(None)


def _parse(chat: bool = False, **body: object) -> TritonCall:
    return parse_request(chat, json.dumps(body).encode(), TEMPLATE, default_max_tokens=1024)


def test_a_completion_becomes_a_call_with_its_sampling() -> None:
    call = _parse(model="m", prompt=["hi"], max_tokens=4, temperature=0.5, top_k=3, seed=7, stop="\n", stream=True)
    assert (call.prompt, call.max_tokens, call.stream, call.stop) == ("hi", 4, True, ("\n",))
    assert call.sampling == {"temperature": 0.5, "top_k": 3, "seed": 7}


def test_fields_with_no_effect_or_unset_pass() -> None:
    call = _parse(prompt="x", user="u", logprobs=None, tools=[], tool_choice="none", skip_special_tokens=True)
    assert call.prompt == "x"
    assert _parse(prompt="x", repetition_penalty=1.1, min_tokens=2).sampling == {
        "repetition_penalty": 1.1,
        "min_tokens": 2,
    }


def test_max_tokens_defaults_and_chat_prefers_max_completion_tokens() -> None:
    assert _parse(prompt="x").max_tokens == 16  # OpenAI's default for completions
    assert _parse(True, messages=[{"role": "user", "content": "x"}]).max_tokens == 1024  # the pool's, for chat
    chat = _parse(True, messages=[{"role": "user", "content": "x"}], max_tokens=3, max_completion_tokens=9)
    assert chat.max_tokens == 9


def test_chat_renders_the_default_chatml_template_with_text_parts() -> None:
    call = _parse(
        True,
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]},
        ],
    )
    assert call.prompt == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_pools_own_template_is_used_and_cannot_escape_the_sandbox() -> None:
    template = ChatTemplate("{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}")
    assert template.render([{"role": "user", "content": "x"}]) == "[user] x"
    hostile = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(EngineRejected, match="chat template"):
        hostile.render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    ("chat", "body", "message"),
    [
        (False, {"prompt": [1, 2, 3]}, "'prompt' must be a string"),
        (False, {"prompt": "x", "logprobs": 1}, "'logprobs' is not supported"),
        (False, {"prompt": "x", "n": 3}, "'n' must be 1"),
        (False, {"prompt": "x", "max_tokens": "many"}, "'max_tokens' must be an integer"),
        (False, {"prompt": "x", "temperature": "hot"}, "'temperature' must be a number"),
        (False, {"prompt": "x", "seed": -1}, "'seed' must be an integer between 0 and"),
        (False, {"prompt": "x", "stop": [1]}, "'stop' must be a string or a list of strings"),
        (False, {"prompt": "x", "seed": 2**64}, "'seed' must be an integer between 0 and"),
        (False, {"prompt": "x", "max_tokens": 2**31}, "'max_tokens' must be between 1 and"),
        (False, {"prompt": "x", "max_tokens": 0}, "'max_tokens' must be between 1 and"),
        (False, {"prompt": "x", "ignore_eos": True}, "'ignore_eos' is not supported"),
        (False, {"prompt": "x", "stop_token_ids": [2]}, "'stop_token_ids' is not supported"),
        (True, {"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}, "'functions'"),
        (True, {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "'tool_choice'"),
        (True, {"messages": []}, "'messages' must be a non-empty list"),
        (True, {"messages": [{"content": "x"}]}, "must be an object with a 'role'"),
        (True, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text parts"),
        (True, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "'tools'"),
    ],
)
def test_what_tensorrt_llm_cannot_honour_is_refused_by_name(chat: bool, body: dict[str, object], message: str) -> None:
    with pytest.raises(EngineRejected, match=message) as caught:
        _parse(chat, **body)
    assert caught.value.status == 400


def test_not_json_is_a_400() -> None:
    with pytest.raises(EngineRejected, match="not JSON"):
        parse_request(False, b"{", TEMPLATE, 16)


def test_whole_answers_have_vllms_shapes() -> None:
    completion = json.loads(AnswerWriter(_parse(model="m", prompt="x", max_tokens=2)).whole("ab", usage(3, 2)))
    assert completion["object"] == "text_completion" and completion["id"].startswith("cmpl-")
    assert completion["choices"] == [
        {"index": 0, "text": "ab", "logprobs": None, "finish_reason": "length", "stop_reason": None}
    ]
    assert completion["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    chat_call = _parse(True, model="m", messages=[{"role": "user", "content": "x"}], max_tokens=5)
    chat = json.loads(AnswerWriter(chat_call).whole("ab", usage(3, 2)))
    assert chat["object"] == "chat.completion" and chat["id"].startswith("chatcmpl-")
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "ab"}
    assert chat["choices"][0]["finish_reason"] == "stop"
    assert "usage" not in json.loads(AnswerWriter(chat_call).whole("ab", usage(None, None)))


def test_stream_chunks_end_with_finish_usage_and_done() -> None:
    writer = AnswerWriter(
        _parse(True, model="m", messages=[{"role": "user", "content": "x"}], stream=True,
               stream_options={"include_usage": True}, max_tokens=2)
    )  # fmt: skip
    raw = writer.opening() + writer.chunk("a") + writer.chunk("b") + writer.ending(usage(1, 2))
    events = [event.removeprefix(b"data: ") for event in raw.split(b"\n\n") if event]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks[:4]]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "a"}, {"content": "b"}, {"content": ""}]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:4]] == [None, None, None, "length"]
    assert chunks[4]["choices"] == [] and chunks[4]["usage"]["total_tokens"] == 3
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
