"""The simulator's Triton mode (``tenantgate sim --backend triton``) over its real protocols: tritonclient
``grpc.aio`` for inference, HTTP for health, metadata and metrics, ``/sim/stats`` for what the engine did.

The replica lives for the session (``sim_triton_engine``: a two-task PEFT cache, rank 8 at most), so each test
uses LoRA task ids of its own and asserts on its own tasks' counters. Nothing here is timed: tests that need
requests in flight pause the engine's step loop and poll its queue.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import grpc
import numpy as np
import pytest
import tritonclient.grpc.aio as grpcclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException, np_to_triton_dtype, serialize_byte_tensor

from loadtests.sim.tokenizer import tokenize
from tests.servers import TritonProcess
from tests.triton_client import Arrays, Result
from tests.triton_client import answer as _answer
from tests.triton_client import counts as _counts
from tests.triton_client import error_message as _error
from tests.triton_client import infer_inputs as _inputs
from tests.triton_client import lora_arrays as _lora
from tests.triton_client import request_arrays as _request
from tests.triton_client import text as _text

pytestmark = pytest.mark.timeout(120)

_task_ids = itertools.count(7_000_001)  # other test modules use ids derived from adapter names: far from these
_FINAL = "triton_final_response"


# --- requests ---------------------------------------------------------------------------------------------------
def _stream(client: grpcclient.InferenceServerClient, *requests: dict[str, Any]) -> Any:
    """One ModelStreamInfer call carrying ``requests`` (dicts of stream_infer's keys), then half-closed."""

    async def send() -> AsyncIterator[dict[str, Any]]:
        for request in requests:
            yield request

    return client.stream_infer(send())


async def _infer(engine: TritonProcess, client: grpcclient.InferenceServerClient, **fields: Any) -> list[Result]:
    model = fields.pop("model", engine.model)
    return [r async for r in _stream(client, {"model_name": model, "inputs": _inputs(_request(**fields))})]


def _final(result: grpcclient.InferResult) -> bool:
    return bool(result.get_response().parameters[_FINAL].bool_param)


# --- fixtures and the simulator's own routes --------------------------------------------------------------------
@pytest.fixture
async def client(sim_triton_engine: TritonProcess) -> AsyncIterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(sim_triton_engine.grpc_address)
    yield client
    await client.close()


@pytest.fixture
async def http(sim_triton_engine: TritonProcess) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(sim_triton_engine.http_url) as session:
        yield session


async def _stats(http: aiohttp.ClientSession) -> dict[str, Any]:
    async with http.get("/sim/stats") as response:
        assert response.status == 200
        body: dict[str, Any] = await response.json()
        return body


async def _pause(http: aiohttp.ClientSession, paused: bool) -> None:
    async with http.post("/sim/control", json={"paused": paused}) as response:
        assert response.status == 200, await response.text()


async def _until(http: aiohttp.ClientSession, condition: Callable[[dict[str, Any]], bool], what: str) -> None:
    for _ in range(3000):  # bounded: about 30 s
        if condition(await _stats(http)):
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"the engine never reached: {what}")


# --- health, metadata, config -----------------------------------------------------------------------------------
async def test_health_and_metadata(sim_triton_engine: TritonProcess, client: grpcclient.InferenceServerClient) -> None:
    model = sim_triton_engine.model
    assert await client.is_server_live() and await client.is_server_ready()
    assert await client.is_model_ready(model)
    assert not await client.is_model_ready("nope")
    assert (await client.get_server_metadata(as_json=True))["name"] == "triton"

    metadata = await client.get_model_metadata(model)
    assert (metadata.name, list(metadata.versions), metadata.platform) == (model, ["1"], "python")
    inputs = {t.name: (t.datatype, list(t.shape)) for t in metadata.inputs}
    assert inputs == {
        "text_input": ("BYTES", [-1, 1]),
        "max_tokens": ("INT32", [-1, 1]),
        "stream": ("BOOL", [-1, 1]),
        "temperature": ("FP32", [-1, 1]),
        "top_p": ("FP32", [-1, 1]),
        "presence_penalty": ("FP32", [-1, 1]),
        "frequency_penalty": ("FP32", [-1, 1]),
        "top_k": ("INT32", [-1, 1]),
        "seed": ("UINT64", [-1, 1]),
        "stop_words": ("BYTES", [-1, -1]),
        "exclude_input_in_output": ("BOOL", [-1, 1]),
        "return_num_input_tokens": ("BOOL", [-1, 1]),
        "return_num_output_tokens": ("BOOL", [-1, 1]),
        "lora_task_id": ("UINT64", [-1, 1]),
        "lora_weights": ("FP16", [-1, -1, -1]),
        "lora_config": ("INT32", [-1, -1, 3]),
    }
    outputs = {t.name: (t.datatype, list(t.shape)) for t in metadata.outputs}
    assert outputs == {
        "text_output": ("BYTES", [-1, -1]),
        "num_input_tokens": ("INT32", [-1, 1]),
        "num_output_tokens": ("INT32", [-1, 1]),
    }

    config = (await client.get_model_config(model, as_json=True))["config"]
    assert config["name"] == model and config["max_batch_size"] == 8
    assert config["model_transaction_policy"]["decoupled"] is True
    assert {t["name"] for t in config["input"] if not t.get("optional")} == {"text_input", "max_tokens"}

    with pytest.raises(InferenceServerException, match="Request for unknown model: 'nope' is not found") as caught:
        await client.get_model_metadata("nope")
    assert caught.value.status() == "StatusCode.NOT_FOUND"


async def test_unary_infer_is_refused_for_the_decoupled_model(
    sim_triton_engine: TritonProcess, client: grpcclient.InferenceServerClient
) -> None:
    with pytest.raises(InferenceServerException) as caught:
        await client.infer(sim_triton_engine.model, _inputs(_request()))
    assert caught.value.status() == "StatusCode.UNIMPLEMENTED"
    assert "ModelInfer RPC doesn't support models with decoupled transaction policy" in caught.value.message()


# --- inference --------------------------------------------------------------------------------------------------
async def test_non_streaming_is_one_final_response_with_counts(
    sim_triton_engine: TritonProcess, client: grpcclient.InferenceServerClient
) -> None:
    prompt = "the gateway routes each tenant"
    result = _answer(await _infer(sim_triton_engine, client, prompt=prompt, max_tokens=6))
    text = _text(result)
    assert _final(result)
    assert result.get_response().id == ""  # echoes the request's id, which was not set
    assert 1 <= len(text.split()) <= 6
    assert _counts(result) == (len(tokenize(prompt)), len(text.split()))
    again = _answer(await _infer(sim_triton_engine, client, prompt=prompt, max_tokens=6))
    assert _text(again) == text  # deterministic
    echoed = _answer(await _infer(sim_triton_engine, client, prompt=prompt, max_tokens=6, exclude_input=False))
    assert _text(echoed) == f"{prompt} {text}"
    bare = _answer(await _infer(sim_triton_engine, client, prompt=prompt, max_tokens=6, counts=False))
    assert bare.as_numpy("num_input_tokens") is None and bare.as_numpy("num_output_tokens") is None


async def test_streaming_is_one_response_per_token_and_no_final(
    sim_triton_engine: TritonProcess, client: grpcclient.InferenceServerClient
) -> None:
    whole = _text(_answer(await _infer(sim_triton_engine, client, max_tokens=8)))
    results = await _infer(sim_triton_engine, client, max_tokens=8, stream=True)
    assert all(error is None for _, error in results), results
    chunks = [result for result, _ in results if result is not None]
    assert len(chunks) == len(whole.split())
    assert "".join(_text(chunk) for chunk in chunks) == whole
    assert [_counts(chunk)[1] for chunk in chunks] == list(range(1, len(chunks) + 1))
    # The model ends a stream with a flags-only response, which Triton drops: no response is final.
    assert not any(_final(chunk) for chunk in chunks)


async def test_the_wire_with_and_without_an_empty_final_response(sim_triton_engine: TritonProcess) -> None:
    """grpc.aio cannot ask for the empty final (tritonclient reserves triton_* parameters): the raw stub can."""

    def request(stream: bool, empty_final: bool) -> service_pb2.ModelInferRequest:
        message = service_pb2.ModelInferRequest(model_name=sim_triton_engine.model, id=f"w-{stream}-{empty_final}")
        for name, array in _request(max_tokens=3, stream=stream).items():
            datatype = np_to_triton_dtype(array.dtype)
            message.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
            raw = serialize_byte_tensor(array).item() if datatype == "BYTES" else array.tobytes()
            message.raw_input_contents.append(raw)
        if empty_final:
            message.parameters["triton_enable_empty_final_response"].bool_param = True
        return message

    async with grpc.aio.insecure_channel(sim_triton_engine.grpc_address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

        async def wire(message: service_pb2.ModelInferRequest) -> list[tuple[str, int, bool]]:
            call = stub.ModelStreamInfer(iter([message]))
            return [
                (r.infer_response.id, len(r.infer_response.outputs), r.infer_response.parameters[_FINAL].bool_param)
                async for r in call
            ]

        assert await wire(request(stream=False, empty_final=False)) == [("w-False-False", 3, True)]
        streamed = await wire(request(stream=True, empty_final=False))
        assert streamed == [("w-True-False", 3, False)] * len(streamed) and streamed
        with_final = await wire(request(stream=True, empty_final=True))
        assert with_final == [*[("w-True-True", 3, False)] * len(streamed), ("w-True-True", 0, True)]


async def test_one_stream_serves_several_requests_concurrently(
    sim_triton_engine: TritonProcess, client: grpcclient.InferenceServerClient
) -> None:
    def request(request_id: str, prompt: str) -> dict[str, Any]:
        inputs = _inputs(_request(prompt=prompt, max_tokens=5, stream=True))
        return {"model_name": sim_triton_engine.model, "inputs": inputs, "request_id": request_id}

    texts: dict[str, str] = {"one": "", "two": ""}
    async for result, error in _stream(client, request("one", "first prompt"), request("two", "second prompt")):
        assert error is None and result is not None
        texts[result.get_response().id] += _text(result)
    for request_id, prompt in (("one", "first prompt"), ("two", "second prompt")):
        alone = _text(_answer(await _infer(sim_triton_engine, client, prompt=prompt, max_tokens=5)))
        assert texts[request_id] == alone


async def test_stop_words_end_the_answer_after_the_word(
    sim_triton_engine: TritonProcess, client: grpcclient.InferenceServerClient
) -> None:
    words = _text(_answer(await _infer(sim_triton_engine, client, max_tokens=12))).split()
    stop = words[2]
    stop_words = np.array([[stop.encode(), b"zzzz"]], dtype=object)
    cut = _text(_answer(await _infer(sim_triton_engine, client, max_tokens=12, stop_words=stop_words)))
    assert cut.split() == words[: words.index(stop) + 1]


def _without(name: str) -> Arrays:
    return {key: array for key, array in _request().items() if key != name}


@pytest.mark.parametrize(
    ("arrays", "model", "message"),
    [
        pytest.param(_request(max_tokens=0), None, "max_tokens must be > 0 (got 0)", id="max-tokens-0"),
        pytest.param(
            {**_request(), "max_tokens": np.array([[4]], dtype=np.int64)}, None,
            "inference input 'max_tokens' data-type is 'INT64', but model 'tensorrt_llm_bls' expects 'INT32'",
            id="wrong-datatype",
        ),
        pytest.param(
            {**_request(), "max_tokens": np.array([[4, 4]], dtype=np.int32)}, None,
            "unexpected shape for input 'max_tokens' for model 'tensorrt_llm_bls'. Expected [-1,1], got [1,2]",
            id="wrong-shape",
        ),
        pytest.param(
            {**_request(), "beam_width": np.array([[1]], dtype=np.int32)}, None,
            "unexpected inference input 'beam_width' for model 'tensorrt_llm_bls'", id="unknown-input",
        ),
        pytest.param(_request(), "nope", "Request for unknown model: 'nope' is not found", id="unknown-model"),
        pytest.param(_without("max_tokens"), None, "missing required input(s) ['max_tokens']", id="missing-input"),
    ],
)  # fmt: skip
async def test_invalid_requests_are_in_stream_errors(
    sim_triton_engine: TritonProcess,
    client: grpcclient.InferenceServerClient,
    arrays: Arrays,
    model: str | None,
    message: str,
) -> None:
    request = {"model_name": model or sim_triton_engine.model, "inputs": _inputs(arrays)}
    assert message in _error([result async for result in _stream(client, request)])


# --- LoRA and the PEFT cache ------------------------------------------------------------------------------------
async def test_a_task_needs_its_weights_first_and_then_only_its_id(
    sim_triton_engine: TritonProcess, client: grpcclient.InferenceServerClient, http: aiohttp.ClientSession
) -> None:
    task, other = next(_task_ids), next(_task_ids)
    miss = _error(await _infer(sim_triton_engine, client, lora_task_id=task))
    assert miss == f"LoRA task {task} not found in cache. Please send LoRA weights with request"

    with_weights = _text(_answer(await _infer(sim_triton_engine, client, lora_task_id=task, **_lora(seed=1))))
    by_id = _text(_answer(await _infer(sim_triton_engine, client, lora_task_id=task)))
    other_weights = _text(_answer(await _infer(sim_triton_engine, client, lora_task_id=other, **_lora(seed=2))))
    base = _text(_answer(await _infer(sim_triton_engine, client)))
    assert by_id == with_weights
    assert len({with_weights, other_weights, base}) == 3  # the answer depends on the weights

    stats = await _stats(http)
    assert stats["weights_received"][str(task)] == 1 and stats["weights_received"][str(other)] == 1
    assert stats["cache_misses"][str(task)] == 1
    assert stats["requests_by_model"][f"task-{task}"] == 2


async def test_weights_need_a_task_id(
    sim_triton_engine: TritonProcess, client: grpcclient.InferenceServerClient
) -> None:
    message = _error(await _infer(sim_triton_engine, client, **_lora()))
    assert message == "lora_task_id must be set for LoRA inference"


async def test_a_rank_above_the_maximum_is_refused(
    sim_triton_engine: TritonProcess, client: grpcclient.InferenceServerClient
) -> None:
    message = _error(await _infer(sim_triton_engine, client, lora_task_id=next(_task_ids), **_lora(rank=16)))
    assert message == "Invalid low_rank (16). low_rank must be greater than 0 and less than max_low_rank (8)"


async def test_a_new_task_evicts_the_least_recently_used_one(
    sim_triton_engine: TritonProcess, client: grpcclient.InferenceServerClient, http: aiohttp.ClientSession
) -> None:
    first, second, third = (next(_task_ids) for _ in range(3))
    for task in (first, second, third):  # a two-task cache: the third evicts the least recently used
        _answer(await _infer(sim_triton_engine, client, lora_task_id=task, **_lora(seed=task % 100)))
    assert "not found in cache" in _error(await _infer(sim_triton_engine, client, lora_task_id=first))
    for task in (second, third):
        _answer(await _infer(sim_triton_engine, client, lora_task_id=task))
    stats = await _stats(http)
    assert stats["evictions"][str(first)] == 1
    assert stats["peft_cache"]["cached"] == [str(second), str(third)]
    assert f"task-{first}" not in stats["registered"]  # evicted means forgotten, in every layer


async def test_a_cache_full_of_busy_tasks_refuses_a_new_one(
    sim_triton_engine: TritonProcess, client: grpcclient.InferenceServerClient, http: aiohttp.ClientSession
) -> None:
    busy, newcomer = [next(_task_ids), next(_task_ids)], next(_task_ids)
    await _pause(http, True)
    try:
        holders = [
            asyncio.create_task(_infer(sim_triton_engine, client, lora_task_id=task, stream=True, **_lora(seed=5)))
            for task in busy
        ]
        await _until(http, lambda s: all(s["peft_cache"]["in_flight"].get(str(t)) == 1 for t in busy), "both busy")
        refused = _error(await _infer(sim_triton_engine, client, lora_task_id=newcomer, **_lora(seed=6)))
        assert refused == "PEFT Cache is full. There are no done tasks to evict"
    finally:
        await _pause(http, False)
    for holder in holders:
        assert all(error is None for _, error in await holder)
    _answer(await _infer(sim_triton_engine, client, lora_task_id=newcomer, **_lora(seed=6)))  # now one is done
    stats = await _stats(http)
    assert stats["cache_full_errors"] == {str(newcomer): 1}
    assert stats["weights_received"][str(newcomer)] == 2
    # The engine's clock of slots freeing and loads arriving (wall time): the newcomer's weights came again after
    # a busy task's last request ended.
    cache = stats["peft_cache"]
    assert set(cache["released_at"]) >= {str(task) for task in busy} | {str(newcomer)}
    assert max(cache["released_at"][str(task)] for task in busy) <= cache["weights_at"][str(newcomer)]


async def test_a_cancelled_stream_aborts_its_engine_request(
    sim_triton_engine: TritonProcess, client: grpcclient.InferenceServerClient, http: aiohttp.ClientSession
) -> None:
    aborted = (await _stats(http))["aborted"]
    task = next(_task_ids)
    await _pause(http, True)
    try:
        arrays = {**_request(stream=True, lora_task_id=task), **_lora(seed=7)}
        stream = _stream(client, {"model_name": sim_triton_engine.model, "inputs": _inputs(arrays)})
        pending = asyncio.create_task(stream.__anext__())
        await _until(http, lambda s: s["peft_cache"]["in_flight"].get(str(task)) == 1, "the request is queued")
        stream.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        await _until(http, lambda s: s["aborted"] == aborted + 1 and s["waiting"] == 0, "the request is aborted")
        assert str(task) not in (await _stats(http))["peft_cache"]["in_flight"]
    finally:
        await _pause(http, False)


async def test_faults_act_on_the_grpc_stream(
    sim_triton_engine: TritonProcess, client: grpcclient.InferenceServerClient, http: aiohttp.ClientSession
) -> None:
    task = next(_task_ids)
    faults = {"failing_adapters": [f"task-{task}"], "cut_stream_after": 2}
    async with http.post("/sim/control", json={"faults": faults}) as response:
        assert response.status == 200, await response.text()
    try:
        failed = _error(await _infer(sim_triton_engine, client, lora_task_id=task, **_lora()))
        assert failed == f"Injected failure of adapter task-{task}"
        received = []
        # An RPC-level failure: grpc.aio lets it through unwrapped (not an InferenceServerException).
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for result, error in _stream(
                client, {"model_name": sim_triton_engine.model, "inputs": _inputs(_request(stream=True))}
            ):
                received.append((result, error))
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert caught.value.details() == "Injected fault: stream cut"
        assert len(received) == 2 and all(error is None for _, error in received)
    finally:
        async with http.post("/sim/control", json={"faults": {"failing_adapters": [], "cut_stream_after": None}}):
            pass


# --- HTTP -------------------------------------------------------------------------------------------------------
async def test_http_health_metadata_config_and_refused_infer(
    sim_triton_engine: TritonProcess, http: aiohttp.ClientSession
) -> None:
    model = sim_triton_engine.model
    for path, status in [
        ("/v2/health/live", 200),
        ("/v2/health/ready", 200),
        (f"/v2/models/{model}/ready", 200),
        (f"/v2/models/{model}/versions/1/ready", 200),
        ("/v2/models/nope/ready", 400),
    ]:
        async with http.get(path) as response:
            assert response.status == status, path
    async with http.get(f"/v2/models/{model}") as response:
        metadata = await response.json()
    assert metadata["platform"] == "python" and metadata["inputs"][0] == {
        "name": "text_input",
        "datatype": "BYTES",
        "shape": [-1, 1],
    }
    async with http.get(f"/v2/models/{model}/config") as response:
        assert (await response.json())["model_transaction_policy"] == {"decoupled": True}
    async with http.get("/v2/models/nope") as response:
        assert response.status == 404
        assert await response.json() == {"error": "Request for unknown model: 'nope' is not found"}
    async with http.post(f"/v2/models/{model}/infer", json={"inputs": []}) as response:
        assert response.status == 501
        assert await response.json() == {
            "error": "HTTP end point doesn't support models with decoupled transaction policy"
        }


async def _generate_stream(http: aiohttp.ClientSession, model: str, body: object) -> tuple[int, str, list[Any]]:
    """POST generate_stream: (status, content type, each event's data, or the plain error body as one item)."""
    async with http.post(f"/v2/models/{model}/generate_stream", json=body) as response:
        text = await response.text()
        kind = response.headers.get("Content-Type", "")
    if not kind.startswith("text/event-stream"):
        return response.status, kind, [json.loads(text)]
    events = [event for event in text.split("\n\n") if event]
    assert all(event.startswith("data: ") for event in events), text
    return response.status, kind, [json.loads(event.removeprefix("data: ")) for event in events]


async def test_generate_stream_sends_one_event_per_token_as_triton(
    sim_triton_engine: TritonProcess, client: grpcclient.InferenceServerClient, http: aiohttp.ClientSession
) -> None:
    model = sim_triton_engine.model
    fields = {"text_input": "how fast is it", "max_tokens": 5, "exclude_input_in_output": True}
    flags = {"return_num_input_tokens": True, "return_num_output_tokens": True, "temperature": 0.5, "seed": 3}
    before = (await _stats(http))["requests_by_protocol"].get("http", 0)
    status, kind, events = await _generate_stream(http, model, {**fields, **flags, "stream": True, "id": "x"})
    assert (status, kind) == (200, "text/event-stream; charset=utf-8")
    assert [event["num_output_tokens"] for event in events] == [1, 2, 3, 4, 5]
    assert all(event["num_input_tokens"] == 4 and event["model_name"] == model for event in events)
    # The same answer as over gRPC, in the same pieces.
    streamed = await _infer(sim_triton_engine, client, prompt="how fast is it", max_tokens=5, stream=True)
    assert [event["text_output"] for event in events] == [_text(result) for result, _ in streamed]
    # Not streaming: one event with the whole text; counts only when asked for.
    status, _, events = await _generate_stream(http, model, {**fields, "stream": False})
    assert status == 200 and len(events) == 1 and set(events[0]) == {"model_name", "model_version", "text_output"}
    assert (await _stats(http))["requests_by_protocol"]["http"] == before + 2


async def test_generate_stream_errors_as_triton_words_them(
    sim_triton_engine: TritonProcess, http: aiohttp.ClientSession
) -> None:
    model = sim_triton_engine.model
    # The engine's refusal is the first response: its status, as one event.
    status, kind, events = await _generate_stream(http, model, {"text_input": "hi", "max_tokens": 2, "lora_task_id": 5})
    assert (status, kind) == (500, "text/event-stream; charset=utf-8")
    assert events == [{"error": "LoRA task 5 not found in cache. Please send LoRA weights with request"}]
    # What Triton cannot read is a plain JSON error.
    status, _, [body] = await _generate_stream(http, model, {"text_input": "hi", "max_tokens": "two"})
    assert status == 500 and body["error"].startswith("Unable to parse 'data'")
    status, _, [body] = await _generate_stream(
        http, model, {"text_input": "hi", "max_tokens": 2, "lora_task_id": 5, "lora_weights": [0.5]}
    )
    assert status == 400 and body["error"].startswith("receiving FP16 data via JSON is not supported")
    status, _, [body] = await _generate_stream(http, model, {"max_tokens": 2})
    assert status == 400 and "missing required input(s) ['text_input']" in body["error"]
    status, _, [body] = await _generate_stream(http, "nope", {"text_input": "hi", "max_tokens": 2})
    assert status == 404 and body == {"error": "Request for unknown model: 'nope' is not found"}


async def test_a_closed_generate_stream_aborts_its_engine_request(
    sim_triton_engine: TritonProcess, http: aiohttp.ClientSession
) -> None:
    aborted = (await _stats(http))["aborted"]
    await _control(http, {"run_steps": 1})  # one token, then the engine holds: the answer is open mid-way
    try:
        body = {"text_input": "a long answer", "max_tokens": 50, "stream": True}
        async with http.post(f"/v2/models/{sim_triton_engine.model}/generate_stream", json=body) as response:
            assert (await response.content.readline()).startswith(b"data: ")
            response.close()  # the connection goes, mid-answer
        await _until(http, lambda s: s["aborted"] == aborted + 1, "the request is aborted")
    finally:
        await _pause(http, False)


async def test_faults_act_on_generate_stream(sim_triton_engine: TritonProcess, http: aiohttp.ClientSession) -> None:
    await _control(http, {"faults": {"cut_stream_after": 2}})
    try:
        body = {"text_input": "a long answer", "max_tokens": 8, "stream": True}
        with pytest.raises(aiohttp.ClientPayloadError):
            await _generate_stream(http, sim_triton_engine.model, body)
        await _control(http, {"faults": {"cut_stream_after": None, "error_status": 503}})
        status, _, events = await _generate_stream(http, sim_triton_engine.model, body)
        assert status == 503 and events == [{"error": "Injected fault (HTTP status 503)"}]
    finally:
        await _control(http, {"faults": {"cut_stream_after": None, "error_status": None}})


async def _control(http: aiohttp.ClientSession, body: dict[str, Any]) -> None:
    async with http.post("/sim/control", json=body) as response:
        assert response.status == 200, await response.text()


async def test_metrics_report_queue_and_kv_cache(
    sim_triton_engine: TritonProcess, client: grpcclient.InferenceServerClient, http: aiohttp.ClientSession
) -> None:
    async def scrape() -> dict[tuple[str, str], float]:
        async with http.get("/metrics") as response:
            assert response.status == 200
            text = await response.text()
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                assert sample.labels["model"] == sim_triton_engine.model and sample.labels["version"] == "1"
                kind = sample.labels.get("request_type") or sample.labels.get("kv_cache_block_type") or ""
                samples[(sample.name, kind)] = sample.value
        return samples

    idle = await scrape()
    assert idle[("nv_trt_llm_kv_cache_block_metrics", "max")] > 0
    assert idle[("nv_trt_llm_kv_cache_block_metrics", "tokens_per")] == 16
    assert idle[("nv_trt_llm_request_metrics", "max")] > 0
    await _pause(http, True)
    try:
        queued = asyncio.create_task(_infer(sim_triton_engine, client))
        await _until(http, lambda s: s["waiting"] == 1, "the request is queued")
        busy = await scrape()
    finally:
        await _pause(http, False)
    _answer(await queued)
    assert busy[("nv_trt_llm_request_metrics", "waiting")] == 1
    assert busy[("nv_trt_llm_request_metrics", "active")] == 1
    assert busy[("nv_inference_pending_request_count", "")] == 1
    blocks = {kind: value for (name, kind), value in busy.items() if name == "nv_trt_llm_kv_cache_block_metrics"}
    assert blocks["used"] + blocks["free"] == blocks["max"]  # a waiting request holds no blocks yet


# --- the command line -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        pytest.param(["--backend", "triton"], "--grpc-port is required with --backend triton", id="no-grpc-port"),
        pytest.param(
            ["--backend", "triton", "--grpc-port", "1", "--lora-modules", "a=/x"],
            "--lora-modules is vLLM-only",
            id="lora-modules",
        ),
        pytest.param(["--grpc-port", "1"], "--grpc-port is for --backend triton", id="grpc-port-with-vllm"),
    ],
)
def test_flags_that_do_not_fit_the_backend_are_refused(flags: list[str], message: str) -> None:
    command = [sys.executable, "-m", "gateway.cli", "sim", "--port", "1", *flags]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and message in result.stderr, result.stderr
