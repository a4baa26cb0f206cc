"""The strict JSON parser every endpoint uses, and the request the engine gets: what the gateway checked,
serialised again. orjson's behaviours the gateway relies on are pinned here, so an upgrade that changes one fails."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.app import create_app
from gateway.config import GatewayConfig, LimitsConfig
from gateway.errors import InvalidRequest
from gateway.serving.json_body import RefusedInput, dumps, parse_object
from gateway.serving.openai_request import parse_inference
from loadtests.fleet import api_key
from tests.gateway.serving.test_request_walk import config


def depth(value: Any) -> int:
    """How deeply ``value`` nests, walked with an explicit stack: the reference the gateway's byte-level check
    (``_structure``, ``_deeper``) must agree with; the gateway walked bodies this way before 7941640."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children if isinstance(child, dict | list))
    return deepest


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        pytest.param(b'{"a": NaN}', "non_finite", id="nan"),
        pytest.param(b'{"a": Infinity}', "non_finite", id="infinity"),
        pytest.param(b'{"a": [1, -Infinity]}', "non_finite", id="minus-infinity"),
        pytest.param(b'{"a": 1e400}', "non_finite", id="overflows-a-double"),
        pytest.param(b'{"a": "\\ud800"}', "unicode", id="lone-high-surrogate"),
        pytest.param(b'{"a": "\\udc00x"}', "unicode", id="lone-low-surrogate"),
        pytest.param(b'{"a": "\xed\xa0\x80"}', "unicode", id="raw-surrogate-bytes"),
        pytest.param(b'{"a": "\xff"}', "unicode", id="invalid-utf8"),
        pytest.param(b"[" * 1100 + b"]" * 1100, "depth", id="deeper-than-orjson-parses"),
        pytest.param(b"{not json", "json", id="malformed"),
        pytest.param(b'{"a": "NaN"', "json", id="nan-in-a-string-is-not-named"),
        pytest.param(b"[1, 2]", "shape", id="not-an-object"),
        pytest.param(b"", "json", id="empty"),
    ],
)
def test_what_is_refused_and_why(raw: bytes, reason: str) -> None:
    with pytest.raises(RefusedInput) as refused:
        parse_object(raw, max_depth=32)
    assert refused.value.reason == reason
    assert refused.value.status == 400


@pytest.mark.parametrize("levels", [400, 900, 1024])
def test_deep_nesting_is_a_400_not_a_recursion_error(levels: int) -> None:
    raw = b'{"a": ' + b"[" * (levels - 1) + b"]" * (levels - 1) + b"}"
    assert depth(orjson.loads(raw)) == levels  # orjson parses it: the bound is the gateway's own walk
    with pytest.raises(RefusedInput) as refused:
        parse_object(raw, max_depth=32)
    assert refused.value.reason == "depth"


def test_depth_counts_as_the_bound_does() -> None:
    assert depth({}) == 1
    assert depth({"a": [[]], "b": 1}) == 3
    assert depth("x") == 0
    assert parse_object(b'{"a": ' + b"[" * 31 + b"]" * 31 + b"}", max_depth=32)
    with pytest.raises(RefusedInput):
        parse_object(b'{"a": ' + b"[" * 32 + b"]" * 32 + b"}", max_depth=32)


def test_what_orjson_keeps_and_writes_back() -> None:
    # Duplicated keys: the last wins, and only that one is written back.
    assert parse_object(b'{"model": "a", "model": "b"}', 32) == {"model": "b"}
    # Surrogate pairs are characters; U+0000 escaped is a character too.
    assert parse_object(b'{"a": "\\ud83d\\ude00\\u0000"}', 32) == {"a": "\U0001f600\x00"}
    # Integers past 64 bits become floats: what is forwarded is what was checked (an int check then refuses it).
    assert parse_object(b'{"a": 123456789012345678901234567890}', 32) == {"a": 1.2345678901234568e29}
    assert dumps({"a": 18446744073709551615, "b": "\u00e9"}) == '{"a":18446744073709551615,"b":"é"}'.encode()
    # orjson writes NaN as null rather than refusing it: the parser never lets one in, so it never gets here.
    assert dumps({"a": float("nan")}) == b'{"a":null}'
    deepest: list[Any] = []
    for _ in range(253):
        deepest = [deepest]
    assert dumps(deepest)  # 254 levels, the most limits.max_json_depth allows
    with pytest.raises(orjson.JSONEncodeError):
        dumps([deepest])


def test_the_engine_gets_exactly_the_authorised_model_once() -> None:
    raw = b'{"model": "other-tenants-adapter", "prompt": "x", "model": "support-acme", "max_tokens": 2}'
    request = parse_inference(raw, "completions")
    assert request.model == "support-acme"
    sent = request.for_engine("support-acme")
    assert sent.count(b'"model"') == 1
    assert json.loads(sent) == {"model": "support-acme", "prompt": "x", "max_tokens": 2}


@pytest.mark.parametrize(
    ("prompt", "choices"),
    [
        pytest.param(["a", "b", "c"], 6, id="a batch: n for each prompt"),
        pytest.param([1, 2, 3], 2, id="token ids: one prompt"),
        pytest.param("abc", 2, id="one string"),
    ],
)
def test_a_completions_batch_counts_each_prompts_choices(prompt: object, choices: int) -> None:
    raw = json.dumps({"model": "m", "prompt": prompt, "n": 2, "max_tokens": 4}).encode()
    assert parse_inference(raw, "completions").choices == choices


def test_an_empty_model_is_no_model() -> None:
    assert parse_inference(b'{"model": "", "prompt": "x"}', "completions").model is None


@pytest.mark.parametrize(
    ("body", "parts", "kwargs", "reason"),
    [
        pytest.param(
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc"}}]}]},
            {"text"},
            set(),
            "content_part",
            id="image-part-on-a-text-pool",
        ),
        pytest.param(
            {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"chat_template": "{{ x }}"}},
            {"text"},
            {"enable_thinking"},
            "template_kwargs",
            id="a-template-in-kwargs",
        ),
        pytest.param(
            {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"enable_thinking": True}},
            {"text"},
            set(),
            "template_kwargs",
            id="kwargs-on-a-pool-allowing-none",
        ),
    ],
)
def test_pool_allow_lists(body: dict[str, Any], parts: set[str], kwargs: set[str], reason: str) -> None:
    request = parse_inference(json.dumps(body).encode(), "chat")
    with pytest.raises(RefusedInput) as refused:
        request.check_pool(frozenset(parts), frozenset(kwargs))
    assert refused.value.reason == reason


def test_pool_allow_lists_let_through_what_they_name() -> None:
    body = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]}],
        "chat_template_kwargs": {"enable_thinking": False},
    }
    request = parse_inference(json.dumps(body).encode(), "chat")
    request.check_pool(frozenset({"text", "image_url"}), frozenset({"enable_thinking"}))
    assert request.prompt_chars == 2


def test_a_non_text_part_with_a_non_string_text_is_not_a_crash() -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "text": 5}]}]}
    assert parse_inference(json.dumps(body).encode(), "chat").prompt_chars == 0


@pytest.mark.parametrize(
    ("url", "allowed"),
    [
        ("https://images.example.com/cat.png", True),
        ("data:image/png;base64,iVBORw0KGgo=", True),
        ("http://169.254.169.254/latest/meta-data/", False),
        ("file:///etc/passwd", False),
        ("http://localhost:8000/x", False),
        ("http://[fe80::1]/x", False),
        ("http://[not-an-ip/x", False),
        ("ftp://example.com/x", False),
    ],
)
def test_a_pool_that_allows_image_parts_still_refuses_local_urls(url: str, allowed: bool) -> None:
    """Even where image_url parts are allowed, an engine is never sent to fetch a local file or a private address."""
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}
    request = parse_inference(json.dumps(body).encode(), "chat")
    if allowed:
        request.check_pool(frozenset({"text", "image_url"}), frozenset())
        return
    with pytest.raises(RefusedInput) as refused:
        request.check_pool(frozenset({"text", "image_url"}), frozenset())
    assert refused.value.reason == "content_part"


def test_a_part_url_must_be_a_string() -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 7}}]}]}
    with pytest.raises(InvalidRequest):
        parse_inference(json.dumps(body).encode(), "chat")


def test_the_depth_limit_stops_where_orjson_can_write_back() -> None:
    assert LimitsConfig(max_json_depth=254).max_json_depth == 254
    with pytest.raises(ValueError, match="less than or equal to 254"):
        LimitsConfig(max_json_depth=255)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": ["x"] * 129}, "prompt"),
        ({"prompt": ["x"] * 2, "n": 65}, "prompt"),
        ({"prompt": "x", "n": 129}, "n"),
        ({"prompt": "x", "best_of": 200}, "n"),
    ],
)
def test_a_request_for_more_completions_than_max_choices_is_a_400(body: dict[str, Any], param: str) -> None:
    """README, Global protection: limits.max_choices (128) bounds prompts x n (or best_of) per request. Each is a
    sequence of its own on the engine, and tenant limits count requests: a batch of 1,000 prompts (a tenant with
    max_concurrent 4) took the replica for 7.6 s and another tenant's TTFT there from 29 ms to 3.6 s."""
    with pytest.raises(InvalidRequest, match="at most 128") as refused:
        parse_inference(json.dumps(body).encode(), "completions")
    assert refused.value.status == 400 and refused.value.param == param
    assert parse_inference(json.dumps({"prompt": ["x"] * 64, "n": 2}).encode(), "completions").choices == 128
    assert LimitsConfig().max_choices == 128


async def test_the_configured_max_choices_is_the_one_a_request_meets(tmp_path: Path) -> None:
    """limits.max_choices as configured reaches the tenant endpoint (ingress passes it to the parser): with 2, a
    request for 3 completions is a 400 naming n, and one for 2 is served."""
    raw = config(tmp_path).model_dump(mode="json")
    raw["limits"]["max_choices"] = 2
    async with TestClient(TestServer(create_app(GatewayConfig.model_validate(raw)))) as client:
        headers = {"Authorization": f"Bearer {api_key('acme')}"}
        body = {"model": "lora-a", "prompt": "hello", "max_tokens": 4, "n": 3}
        refused = await client.post("/v1/completions", json=body, headers=headers)
        error = (await refused.json())["error"]
        assert refused.status == 400 and error["param"] == "n" and "at most 2" in error["message"], error
        served = await client.post("/v1/completions", json={**body, "n": 2}, headers=headers)
        assert served.status == 200, await served.text()


def test_a_prompt_over_max_prompt_chars_is_a_400_naming_it() -> None:
    """README, Global protection: limits.max_prompt_chars bounds a prompt (a chat's messages counted together)."""
    assert parse_inference(b'{"prompt": "0123456789"}', "completions", max_prompt_chars=10).prompt_chars == 10
    with pytest.raises(InvalidRequest, match="longer than 10 characters") as refused:
        parse_inference(b'{"prompt": "0123456789a"}', "completions", max_prompt_chars=10)
    assert refused.value.status == 400 and refused.value.param == "prompt"
    chat = {"messages": [{"role": "user", "content": "012345"}, {"role": "user", "content": "6789a"}]}
    with pytest.raises(InvalidRequest) as refused:
        parse_inference(json.dumps(chat).encode(), "chat", max_prompt_chars=10)
    assert refused.value.param == "messages"
    assert LimitsConfig().max_prompt_chars == 200_000


def many_containers(count: int, kind: bytes = b"[]") -> bytes:
    """A valid body, shallow (3 levels), within the default max_body_bytes (1 MiB) for 340,000 containers: one
    tenant's request that the walk below took ~1 s of the event loop to check (and orjson ~0.2 s to build)."""
    return b'{"model": "m", "prompt": "hi", "stop": [' + b",".join([kind] * count) + b"]}"


@pytest.mark.parametrize("kind", [b"[]", b"{}"])
def test_a_body_of_more_arrays_and_objects_than_the_limit_is_refused_before_it_is_parsed(
    kind: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every container a body holds cost the event loop a parse and, past max_json_depth brackets, a walk in
    Python: 340,000 empty arrays (1 MB) held it ~1 s at load 7 (the parse 0.24 s, the walk 0.77 s), every other
    tenant's requests waiting behind it. A body of more than limits.max_json_containers (10,000) arrays and
    objects is refused, counted by its bytes (brackets inside strings do not count), before orjson parses it."""
    raw = many_containers(340_000, kind)
    assert len(raw) < LimitsConfig().max_body_bytes

    def no_parse(_: bytes) -> object:
        raise AssertionError("parsed")

    with monkeypatch.context() as patched:
        patched.setattr(orjson, "loads", no_parse)
        with pytest.raises(RefusedInput) as refused:
            parse_object(raw, max_depth=32)
    assert refused.value.reason == "containers" and "10000" in refused.value.message.replace(",", "")
    body = parse_object(many_containers(9_998, kind), max_depth=32)  # at the limit, with the body and its list
    assert len(body["stop"]) == 9_998
    text = b'{"prompt": "' + b"[{" * 100_000 + b'"}'  # brackets in a string are text
    assert parse_object(text, max_depth=32)["prompt"].startswith("[{")


@settings(max_examples=300, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(alphabet='[]{}"\\ax\n'),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(alphabet='[]{}"\\a'), inner, max_size=4),
        max_leaves=40,
    )
)
def test_the_depth_the_bytes_say_is_the_walks(value: object) -> None:
    """The nesting is read from the body's bytes (strings out, brackets alone), as ``depth`` walks the parsed body."""
    raw = orjson.dumps({"v": value})
    for max_depth in (2, 3, 5, 32):
        deep = depth(orjson.loads(raw)) > max_depth
        try:
            parse_object(raw, max_depth=max_depth)
        except RefusedInput as exc:
            assert exc.reason == "depth" and deep
        else:
            assert not deep
