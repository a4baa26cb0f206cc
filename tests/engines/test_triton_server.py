"""Smoke test of the real Triton lane: tritonserver with the repo's TensorRT-LLM stand-in, over tritonclient grpc.aio
the way the gateway's driver talks to it (one request per ModelStreamInfer stream, docs/triton.md)."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc.aio as grpcclient

from backends.base import EngineRequest
from backends.triton import TritonDriver
from backends.triton_config import TritonEndpoint
from tests.engines.triton_real import running_triton
from tests.servers import TritonProcess
from tests.triton_client import Arrays, Result, answer, request_arrays, text
from tests.triton_client import counts as _tokens
from tests.triton_client import error_message as _error
from tests.triton_client import infer_inputs as _inputs
from tests.triton_client import lora_arrays as _lora
from tests.triton_client import text as _text

pytestmark = [pytest.mark.engine, pytest.mark.timeout(180)]

_CANCELLED = "tensorrt_llm_bls: request cancelled after"  # what the stand-in logs (triton_model/.../model.py)
_task_ids = itertools.count(1000)  # the engine is shared by the session: each test loads fresh task ids


def _request(**fields: Any) -> Arrays:
    return request_arrays(**{"prompt": "hello big world", "max_tokens": 24, **fields})


def _answer(results: list[Result]) -> str:
    return text(answer(results))


def _stream(client: grpcclient.InferenceServerClient, model: str, arrays: dict[str, np.ndarray]) -> Any:
    async def one_request() -> AsyncIterator[dict[str, Any]]:
        yield {"model_name": model, "inputs": _inputs(arrays)}

    return client.stream_infer(one_request())


async def _infer(engine: TritonProcess, client: grpcclient.InferenceServerClient, **request: Any) -> list[Result]:
    return [result async for result in _stream(client, engine.model, _request(**request))]


@pytest.fixture
async def client(triton_engine: TritonProcess) -> AsyncIterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(triton_engine.grpc_address)
    yield client
    await client.close()


async def test_server_and_model_ready(triton_engine: TritonProcess, client: grpcclient.InferenceServerClient) -> None:
    assert await client.is_server_ready()
    assert await client.is_model_ready(triton_engine.model)
    config = (await client.get_model_config(triton_engine.model, as_json=True))["config"]
    assert config["model_transaction_policy"]["decoupled"] is True
    assert {tensor["name"] for tensor in config["input"]} >= {"lora_task_id", "lora_weights", "lora_config", "seed"}


async def test_non_streaming_answer_and_token_counts(
    triton_engine: TritonProcess, client: grpcclient.InferenceServerClient
) -> None:
    results = await _infer(triton_engine, client, prompt="hello big world", max_tokens=24)
    text = _answer(results)
    assert text.startswith(" ") and len(text.split()) >= 4
    assert results[0][0] is not None
    assert _tokens(results[0][0]) == (3, len(text.split()))
    # Deterministic, bounded by max_tokens, and (as TensorRT-LLM) echoing the prompt unless told not to.
    assert _answer(await _infer(triton_engine, client, prompt="hello big world", max_tokens=24)) == text
    shorter = _answer(await _infer(triton_engine, client, prompt="hello big world", max_tokens=2))
    assert shorter.split() == text.split()[:2]
    echoed = _stream(
        client, triton_engine.model, {name: a for name, a in _request().items() if name != "exclude_input_in_output"}
    )
    assert _answer([result async for result in echoed]) == "hello big world" + text


async def test_streaming_sends_one_response_per_token(
    triton_engine: TritonProcess, client: grpcclient.InferenceServerClient
) -> None:
    whole = _answer(await _infer(triton_engine, client, prompt="stream me please", max_tokens=24))
    results = await _infer(triton_engine, client, prompt="stream me please", max_tokens=24, stream=True)
    assert all(error is None for _, error in results), results
    chunks = [result for result, _ in results if result is not None]
    assert len(chunks) == len(whole.split()) >= 4  # the flags-only final is not delivered to grpc.aio
    assert "".join(_text(chunk) for chunk in chunks) == whole
    assert [_tokens(chunk) for chunk in chunks] == [(3, n) for n in range(1, len(chunks) + 1)]


async def test_invalid_max_tokens_is_an_in_stream_error(
    triton_engine: TritonProcess, client: grpcclient.InferenceServerClient
) -> None:
    assert "max_tokens must be > 0" in _error(await _infer(triton_engine, client, max_tokens=0))


async def test_lora_task_needs_weights_first(
    triton_engine: TritonProcess, client: grpcclient.InferenceServerClient
) -> None:
    task = next(_task_ids)
    message = _error(await _infer(triton_engine, client, lora_task_id=task))
    assert f"LoRA task {task} not found in cache. Please send LoRA weights with request" in message

    with_weights = _answer(await _infer(triton_engine, client, lora_task_id=task, **_lora()))
    assert _answer(await _infer(triton_engine, client, lora_task_id=task)) == with_weights
    assert _answer(await _infer(triton_engine, client)) != with_weights  # the weights change the words


async def test_lora_weights_need_a_task_id(
    triton_engine: TritonProcess, client: grpcclient.InferenceServerClient
) -> None:
    message = _error(await _infer(triton_engine, client, **_lora()))
    assert "lora_task_id must be set for LoRA inference" in message


async def test_lru_eviction_beyond_the_cache_size(
    triton_engine: TritonProcess, client: grpcclient.InferenceServerClient
) -> None:
    first, second, third = (next(_task_ids) for _ in range(3))
    for task in (first, second, third):  # a 2-slot cache: the third load evicts the least recently used
        _answer(await _infer(triton_engine, client, lora_task_id=task, **_lora(seed=task)))
    assert "not found in cache" in _error(await _infer(triton_engine, client, lora_task_id=first))
    for task in (second, third):
        _answer(await _infer(triton_engine, client, lora_task_id=task))


async def test_rank_above_the_engine_maximum_is_refused(
    triton_engine: TritonProcess, client: grpcclient.InferenceServerClient
) -> None:
    message = _error(await _infer(triton_engine, client, lora_task_id=next(_task_ids), **_lora(rank=16)))
    assert "Invalid low_rank (16)" in message


# --- a slow engine, so that requests stay in flight while the test acts ---------------------------------------
@pytest.fixture(scope="module")
def slow_triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonProcess]:
    with running_triton(tmp_path_factory.mktemp("triton-slow"), {"token_delay_ms": "1000"}) as engine:
        yield engine


async def test_full_cache_of_busy_tasks_refuses_and_cancel_frees_it(slow_triton: TritonProcess) -> None:
    client = grpcclient.InferenceServerClient(slow_triton.grpc_address)
    try:
        busy = []
        for task in (1, 2):  # each stream has sent its first token of at least four: both tasks are in flight
            stream = _stream(client, slow_triton.model, _request(stream=True, lora_task_id=task, **_lora(seed=task)))
            first, error = await stream.__anext__()
            assert error is None and first is not None
            busy.append(stream)
        refused = [r async for r in _stream(client, slow_triton.model, _request(lora_task_id=3, **_lora(seed=3)))]
        assert "PEFT Cache is full. There are no done tasks to evict" in _error(refused)
        for stream in busy:
            stream.cancel()
        # The model notices the cancellation before its next token and releases the task; poll until it has.
        retry = _request(max_tokens=1, lora_task_id=3, **_lora(seed=3))
        for _ in range(100):
            results = [result async for result in _stream(client, slow_triton.model, retry)]
            if results[0][1] is None:
                break
            await asyncio.sleep(0.1)
        assert _tokens(results[0][0]) == (3, 1)
    finally:
        await client.close()


async def test_a_client_that_closes_a_generate_stream_cancels_its_request(slow_triton: TritonProcess) -> None:
    """Why the driver sends streaming requests over HTTP (backends/triton_http.py): Triton cancels a
    ``generate_stream`` request whose client closed the connection, at the model's next response."""
    driver = TritonDriver(
        model=slow_triton.model, lora_dtype="float16", default_max_tokens=8, chat_template=None,
        request_timeout_s=60, adapter_load_timeout_s=60, probe_timeout_s=5,
    )  # fmt: skip
    replica = TritonEndpoint("r0", slow_triton.http_url, slow_triton.grpc_address, slow_triton.metrics_url)
    body = json.dumps({"model": "m", "prompt": "a long answer", "max_tokens": 20, "stream": True}).encode()
    log = slow_triton.log_path
    assert log is not None
    cancelled = log.read_text().count(_CANCELLED)
    try:
        response = await driver.send(replica, EngineRequest("/v1/completions", body, True))
        await anext(response.chunks())  # the first token: the answer is open, the model sleeps before the next
        response.release()
    finally:
        await driver.close()
    for _ in range(100):  # bounded: the model checks for cancellation before each token (one a second here)
        if log.read_text().count(_CANCELLED) == cancelled + 1:
            return
        await asyncio.sleep(0.1)
    pytest.fail("the engine did not cancel the request whose client left")
