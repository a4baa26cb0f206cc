"""Reading Triton's generate_stream answer (backends/triton_http.py) from the bytes as they come off the connection:
events split across reads or several in one, an engine error mid-answer, an answer that ends inside an event; and
the connections per replica, against the simulator. Answers against the simulator and the real server are in
tests/gateway/test_triton_e2e.py and tests/engines/."""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import AsyncIterator
from typing import cast

import aiohttp
import pytest

from backends import http1
from backends.base import EngineRequest
from backends.errors import EngineRejected, StreamBroken
from backends.triton import TritonDriver, TritonResponse
from backends.triton_config import TritonEndpoint
from backends.triton_http import EVENT_LIMIT, Piece, SseStream
from backends.triton_openai import TritonCall
from backends.triton_wire import first_int32
from gateway.failures import classify
from tests.metered import MeteredBuffer
from tests.servers import TritonProcess


class Arriving:
    """An answer's body as the connection hands it over, in these pieces."""

    def __init__(self, *pieces: bytes) -> None:
        self._pieces = pieces
        self.released = 0

    async def chunks(self) -> AsyncIterator[bytes]:
        for piece in self._pieces:
            yield piece

    def release(self) -> None:
        self.released += 1


def _stream(body: Arriving) -> SseStream:
    return SseStream(cast(http1.Response, body), "r0")


def _event(text: str, tokens: int) -> bytes:
    return b'data: {"model_name":"m","model_version":"1","text_output":"%s","num_input_tokens":3,' % text.encode() + (
        b'"num_output_tokens":%d}\n\n' % tokens
    )


async def _all(stream: SseStream) -> list[Piece]:
    pieces = []
    while (piece := await stream.next()) is not None:
        pieces.append(piece)
    return pieces


async def test_events_split_across_reads_or_several_in_one() -> None:
    one, two, three = _event(" a", 1), _event(" b", 2), _event(" c", 3)
    body = Arriving(one[:10], one[10:] + two + three[:-1], three[-1:])
    stream = _stream(body)
    assert await stream.first() == ((" a", 3, 1), None)
    assert await _all(stream) == [(" b", 3, 2), (" c", 3, 3)]
    assert body.released == 1  # read to its end: the connection goes back to the pool at once


async def test_a_first_error_is_the_engines_text_for_the_driver() -> None:
    stream = _stream(Arriving(b'data: {"error":"LoRA task 5 not found in cache. Please send LoRA weights"}\n\n'))
    assert await stream.first() == (("", None, None), "LoRA task 5 not found in cache. Please send LoRA weights")


@pytest.mark.parametrize(
    ("message", "status", "blame"),
    [
        pytest.param("Encountered an error in forwardAsync function: CUDA error", 500, "suspect", id="engine"),
        pytest.param("Input length exceeds the maximum", 400, "none", id="the-clients"),
    ],
)
async def test_an_error_mid_answer_is_the_engines_answer_as_over_grpc(message: str, status: int, blame: str) -> None:
    stream = _stream(Arriving(_event(" a", 1), b'data: {"error":"%s"}\n\n' % message.encode()))
    await stream.first()
    with pytest.raises(EngineRejected) as failed:
        await stream.next()
    assert failed.value.status == status and classify(failed.value).blame == blame


@pytest.mark.parametrize(
    "body", [_event(" a", 1)[:-1], b"data: not json\n\n", b"data: [1]\n\n"], ids=["cut", "not-json", "not-object"]
)
async def test_an_answer_that_cannot_be_read_is_a_broken_stream(body: bytes) -> None:
    with pytest.raises(StreamBroken):
        await _all(_stream(Arriving(body)))


async def test_text_that_is_not_utf8_is_read_as_over_grpc_not_a_broken_stream() -> None:
    """Triton's JSON writer copies a BYTES output's bytes as they are: a model whose token ends mid-character puts
    bytes that are not UTF-8 in the event. gRPC's reader decodes them with replacement characters
    (triton_wire.first_text); so does this one, rather than breaking the stream and blaming the replica."""
    body = Arriving(b'data: {"text_output":"caf\xc3","num_input_tokens":3,"num_output_tokens":1}\n\n', _event("e", 2))
    stream = _stream(body)
    assert await stream.first() == (("caf\ufffd", 3, 1), None)
    assert await _all(stream) == [("e", 3, 2)]


@pytest.mark.parametrize("count", [-1, 2**31, 2**64 - 1], ids=["negative", "over-int32", "u64-max"])
async def test_a_count_that_is_no_int32_is_not_reported(count: int) -> None:
    """The model's token counts are INT32 outputs (as gRPC's reader takes them): a JSON number outside that range is
    no count. Taken as one, the usage it made could not be written (its total over 64 bits: the stream ended
    without [DONE]), or was negative."""
    event = b'data: {"text_output":"a","num_input_tokens":%d,"num_output_tokens":1}\n\n' % count
    stream = _stream(Arriving(event))
    call = TritonCall(chat=False, model="m", prompt="p", max_tokens=8, stream=True, include_usage=True)
    first, _ = await stream.first()
    assert first == ("a", None, 1)
    answer = b"".join([chunk async for chunk in TritonResponse(call, stream, first).chunks()])
    assert answer.endswith(b"data: [DONE]\n\n") and b"usage" not in answer


@pytest.mark.parametrize(("count", "read"), [(-1, None), (-(2**31), None), (0, 0), (2**31 - 1, 2**31 - 1)])
def test_over_grpc_a_negative_count_is_not_reported_either(count: int, read: int | None) -> None:
    """The gRPC reader takes the same counts as the HTTP one: a negative INT32 (a broken model) is no count, or it
    would reach the client's usage and hand the tenant's token budget back."""
    assert first_int32(struct.pack("<i", count)) == read


async def test_an_event_that_never_ends_is_a_broken_stream_not_a_growing_buffer() -> None:
    """An engine (or something else on its port) that sends bytes without ever ending an event: read no further
    than the event limit, and the connection is dropped, not handed back."""
    endless = Arriving(b"data: {", *(b"x" * 65536 for _ in range(EVENT_LIMIT // 65536 + 2)), _event(" a", 1))
    with pytest.raises(StreamBroken, match="over"):
        await _all(_stream(endless))
    assert endless.released == 1


async def test_open_streams_hold_a_connection_each_up_to_the_pools_limit(sim_triton_engine: TritonProcess) -> None:
    """A Triton pool's streaming requests share ``max_connections_per_replica`` connections per replica (docs/
    triton.md): at the limit, the next one waits for an open stream to end."""
    driver = TritonDriver(
        model=sim_triton_engine.model, lora_dtype="float16", default_max_tokens=8, chat_template=None,
        request_timeout_s=30, adapter_load_timeout_s=30, probe_timeout_s=5, max_connections_per_replica=1,
    )  # fmt: skip
    replica = TritonEndpoint("r0", sim_triton_engine.http_url, sim_triton_engine.grpc_address, "")
    body = json.dumps({"model": "m", "prompt": "a long answer", "max_tokens": 50, "stream": True}).encode()
    request = EngineRequest("/v1/completions", body, True)
    async with aiohttp.ClientSession(sim_triton_engine.http_url) as http:
        await http.post("/sim/control", json={"run_steps": 1})  # one token, then the engine holds
        try:
            first = await driver.send(replica, request)
            second = asyncio.create_task(driver.send(replica, request))
            origin, _ = driver._origin(replica)
            for _ in range(3000):  # bounded: about 30 s
                if len(origin._waiters) == 1:
                    break
                await asyncio.sleep(0.01)
            assert len(origin._waiters) == 1 and not second.done()
            first.release()  # the client left: its connection goes, and the waiting stream takes the turn
        finally:
            await http.post("/sim/control", json={"paused": False})
        answer = b"".join([chunk async for chunk in (await second).chunks()])
    assert answer.endswith(b"data: [DONE]\n\n")
    await driver.close()


async def test_an_event_sent_in_small_pieces_costs_its_length_not_its_square() -> None:
    """A broken or hostile engine that sends an event a few bytes at a time: each read appended to the buffer in
    place. Joined anew for each read, the event loop (every tenant's requests) spent a copy of the whole buffer a
    read: here about 520,000 reads of up to 1 MiB each. Counted, not timed (tests/metered.py): the bytes the buffer's
    operations walk over stay within a few times the event's length."""
    text = "x" * (EVENT_LIMIT - 200)
    event = _event(text, 1)
    body = Arriving(*(event[start : start + 2] for start in range(0, len(event), 2)))
    stream = _stream(body)
    held = stream._buffer = MeteredBuffer()
    assert await stream.first() == ((text, 3, 1), None)
    assert await _all(stream) == []
    assert stream._buffer is held  # appended to in place, never replaced by a joined copy
    assert held.touched <= 8 * len(event), held.touched / len(event)
