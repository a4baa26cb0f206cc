"""The Triton driver against a Triton-protocol engine: every test runs against the simulator's Triton mode and a
real Triton server with this repo's TensorRT-LLM stand-in model (docs/triton.md), parametrized by ``triton_lane``,
and one test compares the two engines' answers to the same requests in the same run.

Every case here reaches the engine. What the driver decides alone is tested without one: fields TensorRT-LLM
cannot honour (tests/backends/test_triton_openai.py), and a missing adapter directory and an unreachable replica
(tests/backends/test_triton_no_engine.py).

Each test uses adapter names of its own: the engines live for the session and their PEFT caches (two adapters
each) carry state from test to test. Texts are compared within one engine, never across the two.
"""

from __future__ import annotations

import json
import pprint
import re
import uuid
from collections.abc import AsyncIterator

import pytest

from backends.base import AdapterRef, Endpoint, EngineRequest
from backends.errors import AdapterLoadFailed, BackendError, EngineRejected, StreamBroken
from backends.triton import TritonDriver
from backends.triton_config import TritonEndpoint
from loadtests.processes import free_port
from tests.servers import TritonProcess
from tests.shapes import shape

pytestmark = pytest.mark.timeout(180)
LONG_PROMPT = " ".join(["word"] * 600)  # 600 tokens in both engines' counts, over their input limit of 511
# Fewer tokens than either engine's shortest natural answer (4 words, 8 in the simulator): both finish on length.
SHORT = 3
TOO_LONG = "Prompt length (600) exceeds maximum input length (511)."


class Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str]] = []

    def __call__(self, replica: str, adapter: str, event: str) -> None:
        self.seen.append((replica, adapter, event))


@pytest.fixture
def events() -> Events:
    return Events()


@pytest.fixture
async def driver(triton_lane: TritonProcess, events: Events) -> AsyncIterator[TritonDriver]:
    driver = TritonDriver(
        model=triton_lane.model,
        lora_dtype="float16",
        default_max_tokens=8,
        chat_template=None,
        request_timeout_s=60,
        adapter_load_timeout_s=60,
        probe_timeout_s=5,
        on_event=events,
    )
    yield driver
    await driver.close()


@pytest.fixture
def replica(triton_lane: TritonProcess) -> Endpoint:
    return TritonEndpoint("r0", triton_lane.http_url, triton_lane.grpc_address, triton_lane.metrics_url)


def _adapter(lane: TritonProcess, source: str) -> AdapterRef:
    """The lane's adapter ``source`` under a name (so a task id) no other test uses."""
    return AdapterRef(f"{source}-{uuid.uuid4().hex[:8]}", lane.adapters[source])


def _completion(prompt: str = "hello world", /, **fields: object) -> EngineRequest:
    body = {"model": "m", "prompt": prompt, "max_tokens": 6, **fields}
    return EngineRequest("/v1/completions", json.dumps(body).encode(), bool(fields.get("stream")))


async def _text(driver: TritonDriver, replica: Endpoint, request: EngineRequest) -> str:
    response = await driver.send(replica, request)
    try:
        answer = json.loads(await response.read())
    finally:
        response.release()
    return str(answer["choices"][0]["text"])


async def test_health_and_load_signals(driver: TritonDriver, replica: Endpoint) -> None:
    assert await driver.healthy(replica)
    assert await driver.healthy(Endpoint("gone", f"http://127.0.0.1:{free_port()}")) is False
    assert await driver.load_signals(replica) is not None


async def test_completion_has_openai_shape_and_usage(driver: TritonDriver, replica: Endpoint) -> None:
    response = await driver.send(replica, _completion())
    assert response.content_type == "application/json"
    answer = json.loads(await response.read())
    response.release()
    assert answer["object"] == "text_completion" and answer["id"].startswith("cmpl-")
    assert answer["model"] == "m"
    choice = answer["choices"][0]
    assert isinstance(choice["text"], str) and choice["text"]
    assert choice["finish_reason"] in ("stop", "length")
    usage = answer["usage"]
    assert usage["prompt_tokens"] >= 1 and 1 <= usage["completion_tokens"] <= 6
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def test_chat_streams_openai_chunks_ending_in_done(driver: TritonDriver, replica: Endpoint) -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = await driver.send(replica, EngineRequest("/v1/chat/completions", json.dumps(body).encode(), True))
    assert response.content_type == "text/event-stream"
    raw = b"".join([chunk async for chunk in response.chunks()])
    response.release()
    events = [line.removeprefix(b"data: ") for line in raw.split(b"\n\n") if line]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert content
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] in ("stop", "length") and not any(finishes[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1


async def test_loaded_adapter_is_sent_by_id_only_and_changes_the_answer(
    driver: TritonDriver, replica: Endpoint, triton_lane: TritonProcess, events: Events
) -> None:
    first, second = _adapter(triton_lane, "a1"), _adapter(triton_lane, "a2")
    await driver.load_adapter(replica, first)
    request = _completion(temperature=0)
    with_first = await _text(driver, replica, EngineRequest(request.path, request.body, False, adapter=first))
    assert events.seen == []  # found in the engine's cache by its id: no miss, no resend
    await driver.load_adapter(replica, second)
    with_second = await _text(driver, replica, EngineRequest(request.path, request.body, False, adapter=second))
    base = await _text(driver, replica, request)
    assert len({with_first, with_second, base}) == 3


async def test_an_evicted_adapter_is_resent_once_with_its_weights(
    driver: TritonDriver, replica: Endpoint, triton_lane: TritonProcess, events: Events
) -> None:
    evicted = _adapter(triton_lane, "a1")
    await driver.load_adapter(replica, evicted)
    request = EngineRequest("/v1/completions", _completion(temperature=0).body, False, adapter=evicted)
    before = await _text(driver, replica, request)
    for source in ("a2", "a3"):  # a two-adapter cache: these push the first out
        await driver.load_adapter(replica, _adapter(triton_lane, source))
    assert await _text(driver, replica, request) == before
    assert events.seen == [("r0", evicted.engine_name, "cache_miss")]


async def test_an_adapter_never_loaded_here_is_sent_with_weights_on_the_miss(
    driver: TritonDriver, replica: Endpoint, triton_lane: TritonProcess, events: Events
) -> None:
    adapter = _adapter(triton_lane, "a4")  # as if another gateway's record said it was resident
    request = EngineRequest("/v1/completions", _completion(stream=True).body, True, adapter=adapter)
    response = await driver.send(replica, request)
    raw = b"".join([chunk async for chunk in response.chunks()])
    response.release()
    assert raw.endswith(b"data: [DONE]\n\n")
    assert events.seen == [("r0", adapter.engine_name, "cache_miss")]


async def test_an_adapter_over_the_engines_rank_limit_fails_to_load(
    driver: TritonDriver, replica: Endpoint, triton_lane: TritonProcess
) -> None:
    with pytest.raises(AdapterLoadFailed, match="low_rank"):
        await driver.load_adapter(replica, _adapter(triton_lane, "big-rank"))


async def test_a_prompt_over_the_engines_input_limit_is_a_400_in_its_words(
    driver: TritonDriver, replica: Endpoint
) -> None:
    with pytest.raises(EngineRejected, match=re.escape(TOO_LONG)) as caught:
        await driver.send(replica, _completion(LONG_PROMPT))
    assert caught.value.status == 400


async def test_a_request_past_the_engines_sequence_limit_is_shortened(driver: TritonDriver, replica: Endpoint) -> None:
    # 500 prompt tokens on an engine built for 512: TensorRT-LLM generates at most 12, where vLLM would refuse.
    response = await driver.send(replica, _completion(" ".join(["word"] * 500), max_tokens=100))
    answer = json.loads(await response.read())
    response.release()
    assert answer["usage"]["prompt_tokens"] == 500 and 1 <= answer["usage"]["completion_tokens"] <= 12


async def test_a_client_that_leaves_mid_stream_frees_the_engine(driver: TritonDriver, replica: Endpoint) -> None:
    response = await driver.send(replica, _completion(stream=True, max_tokens=200))
    async for _chunk in response.chunks():
        break
    response.release()
    # The engine serves the next request normally (the cancelled one no longer holds it).
    assert await _text(driver, replica, _completion())


async def test_closing_the_driver_breaks_open_streams_without_cancelling_their_readers(
    triton_lane: TritonProcess, replica: Endpoint
) -> None:
    closing = TritonDriver(
        model=triton_lane.model, lora_dtype="float16", default_max_tokens=8, chat_template=None,
        request_timeout_s=60, adapter_load_timeout_s=60, probe_timeout_s=5,
    )  # fmt: skip
    response = await closing.send(replica, _completion(stream=True, max_tokens=400))
    chunks = response.chunks()
    await anext(chunks)
    await closing.close()  # as a retired fleet closes after its drain
    with pytest.raises(StreamBroken):
        async for _chunk in chunks:
            pass


# --- the simulator against the real server, in the same run ---------------------------------------------------
async def _outcomes(lane: TritonProcess, names: dict[str, str]) -> dict[str, object]:
    """What one engine answers to the cases the driver sends, without the texts (each engine has its own words):
    answer shapes, finish reasons, token arithmetic, the driver's adapter events, and errors by class, status
    and message. ``names``: each source's adapter name, the same on both engines."""
    events = Events()
    driver = TritonDriver(
        model=lane.model, lora_dtype="float16", default_max_tokens=8, chat_template=None, request_timeout_s=60,
        adapter_load_timeout_s=60, probe_timeout_s=5, on_event=events,
    )  # fmt: skip
    replica = TritonEndpoint("r0", lane.http_url, lane.grpc_address, lane.metrics_url)
    adapters = {source: AdapterRef(name, lane.adapters[source]) for source, name in names.items()}

    async def answer(request: EngineRequest) -> object:
        try:
            response = await driver.send(replica, request)
            body = b"".join([c async for c in response.chunks()]) if request.stream else await response.read()
            response.release()
        except BackendError as exc:
            return type(exc).__name__, getattr(exc, "status", None), str(exc)
        if not request.stream:
            whole = json.loads(body)
            usage = whole["usage"]
            return (
                shape(whole),
                whole["choices"][0]["finish_reason"],
                usage["total_tokens"] == sum(usage[key] for key in ("prompt_tokens", "completion_tokens")),
            )
        kinds: list[object] = []
        for event in (line.removeprefix(b"data: ") for line in body.split(b"\n\n") if line):
            kind = event.decode() if event == b"[DONE]" else shape(json.loads(event))
            if not kinds or kinds[-1] != kind:  # runs of token chunks are one kind: lengths differ by engine
                kinds.append(kind)
        return kinds

    def with_adapter(request: EngineRequest, source: str) -> EngineRequest:
        return EngineRequest(request.path, request.body, request.stream, adapter=adapters[source])

    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": SHORT, "stream": True}
    chat_usage = {**chat, "stream_options": {"include_usage": True}}
    outcomes: dict[str, object] = {}
    try:
        outcomes["completion"] = await answer(_completion(temperature=0, max_tokens=SHORT))
        outcomes["completion, streamed"] = await answer(_completion(stream=True, max_tokens=SHORT))
        outcomes["chat, streamed with usage"] = await answer(
            EngineRequest("/v1/chat/completions", json.dumps(chat_usage).encode(), True)
        )
        outcomes["stop word"] = await answer(_completion(stop=["the"], max_tokens=24))
        await driver.load_adapter(replica, adapters["a1"])
        outcomes["a loaded adapter"] = await answer(with_adapter(_completion(max_tokens=SHORT), "a1"))
        for source in ("a2", "a3"):  # a two-adapter cache: a1 is evicted
            await driver.load_adapter(replica, adapters[source])
        outcomes["an evicted adapter"] = await answer(with_adapter(_completion(max_tokens=SHORT), "a1"))
        never_loaded = with_adapter(_completion(stream=True, max_tokens=SHORT), "a4")
        outcomes["an adapter never loaded, streamed"] = await answer(never_loaded)
        try:
            await driver.load_adapter(replica, adapters["big-rank"])
        except AdapterLoadFailed as exc:
            outcomes["rank over the limit"] = exc.status, str(exc)
        outcomes["prompt over the input limit"] = await answer(_completion(LONG_PROMPT))
        outcomes["past the sequence limit"] = await answer(_completion(" ".join(["word"] * 500), max_tokens=100))
        outcomes["adapter events"] = events.seen
        load = await driver.load_signals(replica)
        outcomes["load signals, idle"] = None if load is None else (load.running, load.waiting)
    finally:
        await driver.close()
    return outcomes


@pytest.mark.engine
async def test_the_simulator_answers_as_the_real_server(
    sim_triton_engine: TritonProcess, triton_engine: TritonProcess
) -> None:
    names = {source: f"{source}-{uuid.uuid4().hex[:8]}" for source in ("a1", "a2", "a3", "a4", "big-rank")}
    simulated, real = await _outcomes(sim_triton_engine, names), await _outcomes(triton_engine, names)
    assert set(simulated) == set(real)
    differing = {case: (simulated[case], real[case]) for case in real if simulated[case] != real[case]}
    assert not differing, pprint.pformat(differing, width=120)
