"""``whole_body`` (the request body taken from the payload's buffer without a wait) gives what ``request.read()``
gives, or None where only ``read()`` may decide (a body still coming, compressed, broken, over the app's limit, or
read already); and a ``read()`` after it returns the same bytes."""

from __future__ import annotations

import asyncio
from unittest import mock

from aiohttp import StreamReader, web
from aiohttp.test_utils import make_mocked_request
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gateway.serving.json_body import whole_body

LIMIT = 64


def _request(chunks: list[bytes], eof: bool, max_size: int) -> web.Request:
    payload = StreamReader(mock.Mock(), 2**16, loop=asyncio.get_running_loop())
    for chunk in chunks:
        payload.feed_data(chunk)
    if eof:
        payload.feed_eof()
    headers = {"Content-Type": "application/json"}
    return make_mocked_request("POST", "/v1/completions", headers, payload=payload, client_max_size=max_size)


async def _plain(chunks: list[bytes], max_size: int) -> bytes | int:
    try:
        return await _request(chunks, True, max_size).read()
    except web.HTTPRequestEntityTooLarge as exc:
        return exc.status


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.binary(max_size=40), max_size=5),
    st.booleans(),
    st.sampled_from([0, LIMIT]),
)
@example([b'{"model": "a"}'], True, LIMIT)
@example([b"x" * 40, b"y" * 40], True, LIMIT)  # over the limit: read() answers it (413)
@example([], True, LIMIT)
@example([b"{", b"}"], False, LIMIT)  # still coming
def test_whole_body_is_what_read_gives(chunks: list[bytes], eof: bool, max_size: int) -> None:
    async def check() -> None:
        request = _request(chunks, eof, max_size)
        fast = whole_body(request)
        total = sum(len(chunk) for chunk in chunks)
        if not eof or (max_size and total > max_size):
            assert fast is None
            return
        assert fast is not None and type(fast) is bytes
        assert fast == await _plain(chunks, max_size)
        assert await request.read() == fast  # read once: a later read() gives the same bytes
        assert whole_body(request) is None  # already read: read() returns it

    asyncio.run(check())


async def test_a_compressed_or_broken_body_is_left_to_read() -> None:
    compressed = _request([b"\x1f\x8b"], True, LIMIT)
    compressed.content.total_compressed_bytes = 2  # as aiohttp's decompressing buffer marks its output
    assert whole_body(compressed) is None
    broken = _request([b"{}"], True, LIMIT)
    broken.content.set_exception(ValueError("the parser failed"))
    assert whole_body(broken) is None


async def test_no_body_is_left_to_read() -> None:
    request = make_mocked_request("POST", "/v1/completions", {"Content-Type": "application/json"})
    assert whole_body(request) is None
    assert await request.read() == b""
