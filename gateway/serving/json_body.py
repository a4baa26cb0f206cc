"""JSON in and out, strictly: the one parser for every endpoint that takes a JSON body (tenant and admin), and the
serialiser for what the gateway sends on. What the gateway checks is what it forwards: the parsed body, serialised
again, never the client's bytes.

orjson parses RFC 8259 and nothing more (each behaviour is pinned in tests/gateway/serving/test_json_body.py):
``NaN``, ``Infinity`` and numbers that overflow a double are refused; invalid UTF-8 and lone surrogates, escaped
(``"\\ud800"``) or raw, are refused; a body nesting more than 1,024 levels is refused without recursing in Python;
of duplicated keys the last wins (and only that one is forwarded). Integers beyond 64 bits become floats, so what
is forwarded is always what was checked. orjson serialises at most 254 levels deep, which is why
``limits.max_json_depth`` stops there. A body of more arrays and objects than ``limits.max_json_containers`` is
refused before it is parsed, and the nesting is read from the body's bytes, not walked in Python (``_structure``):
each container cost the event loop its parse and its walk.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import orjson
from aiohttp import StreamReader, web

from gateway.errors import InvalidRequest

# Why a body was refused: the ``reason`` label of tenantgate_refused_inputs_total (a fixed set).
Reason = Literal[
    "encoding", "json", "non_finite", "unicode", "depth", "containers", "shape", "content_part", "template_kwargs"
]

# A NaN or Infinity token outside a string, to name it in the error (orjson only says "unexpected character").
_NON_FINITE = re.compile(rb"(?:^|[\s,:\[])-?(?:NaN|Infinity)(?:$|[\s,\]}])")

# Arrays and objects one body may hold (limits.max_json_containers' default). Each costs the event loop its share
# of the parse (and, counted in Python as ``depth`` walked, far more): 340,000 empty arrays, 1 MB, took ~1 s of it
# at load 7 (the parse 0.24 s, the walk 0.77 s), every tenant's requests waiting behind. A chat of 2,000 messages
# with a content part each, or tools with large schemas, hold a few thousand.
MAX_CONTAINERS = 10_000
# Every byte but quotes and brackets: what ``_structure`` keeps of a body (its escapes taken out first), leaving its
# nesting to be read by C code, not by a walk in Python.
_NOT_STRUCTURE = bytes(byte for byte in range(256) if byte not in b'"[]{}')
_INNERMOST = re.compile(rb"\[\]|\{\}")


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


def parse_object(raw: bytes, max_depth: int, max_containers: int = MAX_CONTAINERS) -> dict[str, Any]:
    """``raw`` as a JSON object nesting at most ``max_depth`` levels and holding at most ``max_containers`` arrays and
    objects (its own included), or ``RefusedInput``; the count is checked before the body is parsed."""
    # Cheap first: only a body with that many brackets can nest that deep or hold that many.
    brackets = raw.count(b"[") + raw.count(b"{")
    structure = _structure(raw) if brackets > max_depth or brackets > max_containers else None
    if structure is not None and len(structure) // 2 > max_containers:
        raise RefusedInput(f"The request body holds more than {max_containers:,} arrays and objects.", "containers")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _refusal(raw, str(exc)) from exc
    if not isinstance(body, dict):
        raise RefusedInput("The request body must be a JSON object.", "shape")
    if structure is not None and _deeper(structure, max_depth):
        raise RefusedInput(f"The request body nests deeper than {max_depth} levels.", "depth")
    return body


def _structure(raw: bytes) -> bytes:
    """The body's brackets alone, its strings left out: two per array or object, nested as in the body (exact for
    valid JSON, which is all that is parsed after it; a count for anything else)."""
    if b"\\" in raw:
        # Only strings hold backslashes. Escaped backslashes out first, left to right as a parser reads them, then
        # escaped quotes: every quote left bounds a string. (A pattern for escapes, or for whole strings, cost a
        # 9 KB chat request ~100 us, more than the walk this replaces; these are C loops over its bytes.)
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    # Quotes and brackets alone; between every other quote a string's own brackets, left out.
    return b"".join(raw.translate(None, _NOT_STRUCTURE).split(b'"')[::2])


def _deeper(structure: bytes, max_depth: int) -> bool:
    """Whether a valid body's brackets (``_structure``) nest deeper than ``max_depth``: each pass takes out the
    innermost pairs, one level everywhere at once, so a body of that depth is empty after that many passes."""
    for _ in range(max_depth):
        structure = _INNERMOST.sub(b"", structure)
        if not structure:
            return False
    return True


def dumps(value: Any) -> bytes:
    """Compact JSON, UTF-8. Only ever given what ``parse_object`` returned (or gateway-made values), which orjson
    can always write back: no NaN, no surrogate, no integer beyond 64 bits, no deeper than max_json_depth."""
    return orjson.dumps(value)


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
