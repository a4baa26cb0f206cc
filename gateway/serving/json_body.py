"""JSON in and out, strictly: the one parser for every endpoint that takes a JSON body (tenant and admin), and the
serialiser for what the gateway sends on. What the gateway checks is what it forwards: the parsed body, serialised
again, never the client's bytes.

orjson parses RFC 8259 and nothing more (each behaviour is pinned in tests/gateway/serving/test_json_body.py):
``NaN``, ``Infinity`` and numbers that overflow a double are refused; invalid UTF-8 and lone surrogates, escaped
(``"\\ud800"``) or raw, are refused; a body nesting more than 1,024 levels is refused without recursing in Python;
of duplicated keys the last wins (and only that one is forwarded). Integers beyond 64 bits become floats, so what
is forwarded is always what was checked. orjson serialises at most 254 levels deep, which is why
``limits.max_json_depth`` stops there.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import orjson
from aiohttp import StreamReader, web

from gateway.errors import InvalidRequest

# Why a body was refused: the ``reason`` label of tenantgate_refused_inputs_total (a fixed set).
Reason = Literal["encoding", "json", "non_finite", "unicode", "depth", "shape", "content_part", "template_kwargs"]

# A NaN or Infinity token outside a string, to name it in the error (orjson only says "unexpected character").
_NON_FINITE = re.compile(rb"(?:^|[\s,:\[])-?(?:NaN|Infinity)(?:$|[\s,\]}])")


class RefusedInput(InvalidRequest):
    """A 400 for a body the gateway will not take, with the fixed reason the middleware counts and logs."""

    def __init__(
        self, message: str, reason: Reason, *, param: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message, param=param, headers=headers)
        self.reason = reason


async def read_body(request: web.Request) -> bytes:
    """The request's body, decoded as its Content-Encoding says; a body that does not decode (aiohttp raises a
    payload error) is a 400."""
    try:
        return await request.read()
    except web.RequestPayloadError as exc:
        raise undecodable(request, exc) from exc


def whole_body(request: web.Request) -> bytes | None:
    """The request's body without a wait, when it has all arrived as it was sent (no Content-Encoding to decode,
    no error), within the app's body limit: what ``request.read()`` returns then, taken from the payload's buffer
    at once. ``request.read()`` makes a coroutine, awaits the payload's ``readany`` coroutine twice and copies the
    bytes through a bytearray: about 15 k instructions a request at make bench-overhead's load shape
    (loadtests/bench_instructions.py --realistic). None where ``read_body`` must do it (the caller then awaits it):
    a body still coming, compressed or broken, one over the limit (``read`` raises the 413), one already read. A
    later ``request.read()`` returns the same bytes."""
    content = request.content
    if (
        type(content) is not StreamReader  # EmptyStreamReader (no body), or a test's stand-in: read() knows them
        or not content.is_eof()
        or content.total_compressed_bytes is not None  # decoded as it is read (a decompression limit applies)
        or content.exception() is not None
        or request._read_bytes is not None
    ):
        return None
    max_size = request._client_max_size
    if max_size and content.total_bytes > max_size:
        return None
    body = content.read_nowait()
    if type(body) is not bytes:  # the buffer holds the parser's bytes: this is for whatever else it could hold
        body = bytes(body)
    request._read_bytes = body
    return body


def undecodable(request: web.Request, exc: web.RequestPayloadError) -> RefusedInput:
    """The refusal of a body that did not decode. aiohttp is told the body is over, or after the answer it would
    drain the rest through the failed decoder and log a traceback; the app's middleware then closes the
    connection, whose parser stopped mid-body."""
    request.content.feed_eof()
    return RefusedInput(f"The request body could not be decoded: {_first_line(exc)}", "encoding")


def parse_object(raw: bytes, max_depth: int) -> dict[str, Any]:
    """``raw`` as a JSON object nesting at most ``max_depth`` levels, or ``RefusedInput``."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _refusal(raw, str(exc)) from exc
    if not isinstance(body, dict):
        raise RefusedInput("The request body must be a JSON object.", "shape")
    # Cheap first: only a body with that many brackets can nest that deep.
    if raw.count(b"[") + raw.count(b"{") > max_depth and depth(body) > max_depth:
        raise RefusedInput(f"The request body nests deeper than {max_depth} levels.", "depth")
    return body


def dumps(value: Any) -> bytes:
    """Compact JSON, UTF-8. Only ever given what ``parse_object`` returned (or gateway-made values), which orjson
    can always write back: no NaN, no surrogate, no integer beyond 64 bits, no deeper than max_json_depth."""
    return orjson.dumps(value)


def depth(value: Any) -> int:
    """How deeply ``value`` nests, walked with an explicit stack (a recursive walk overflows Python's stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children if isinstance(child, dict | list))
    return deepest


def _refusal(raw: bytes, detail: str) -> RefusedInput:
    if "surrogate" in detail or "UTF-8" in detail:
        return RefusedInput(f"The request body is not valid Unicode: {detail}", "unicode")
    if "infinity" in detail or _NON_FINITE.search(raw):
        return RefusedInput(f"The request body has a number JSON cannot carry (NaN, Infinity): {detail}", "non_finite")
    if "depth limit" in detail:
        return RefusedInput("The request body nests too deeply.", "depth")
    return RefusedInput(f"The request body is not valid JSON: {detail}", "json")


def _first_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
