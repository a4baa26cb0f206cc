"""The gateway end to end against a Triton-protocol engine: `tenantgate serve` in front of one replica, the `openai`
SDK as the client. Every test runs against the simulator's Triton mode and a real Triton server with this repo's
Python-backend stand-in for TensorRT-LLM (docs/triton.md), in the same run.

What the gateway answers is checked against the engine itself, asked directly with raw tritonclient requests
(tests/triton_client.py): the same words, the same token counts, the adapter's task in the engine's PEFT cache.
The engines live for the session (a two-adapter PEFT cache each): the adapters here have names no other test uses.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import tritonclient.grpc.aio as grpcclient
from openai.types.chat import ChatCompletionMessageParam

from backends.lora_weights import task_id
from loadtests.fleet import api_key, gateway_config, gateway_process, triton_pool
from loadtests.processes import free_port
from tests.servers import TritonProcess
from tests.triton_client import Arrays, Result, infer_inputs, request_arrays
from tests.triton_client import counts as engine_counts
from tests.triton_client import error_message as engine_error
from tests.triton_client import text as engine_text

pytestmark = pytest.mark.timeout(180)

BASE = "trt-base"
ADAPTER, TOO_BIG = "gw-a1", "gw-big-rank"  # names (so task ids) of this module's own
PROMPT = "the gateway routes each tenant"


@dataclass
class Lane:
    engine: TritonProcess
    url: str
    log: Path

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key("acme"), max_retries=0, timeout=60)


@pytest.fixture(scope="module", params=["sim_triton", pytest.param("triton", marks=pytest.mark.engine)])
def lane(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lane]:
    """A gateway whose one Triton pool is the engine: tenant acme may call the base model and two adapters."""
    engine: TritonProcess = request.getfixturevalue(f"{request.param}_engine")
    root = tmp_path_factory.mktemp(f"gateway-{request.param}")
    adapters = {ADAPTER: engine.adapters["a1"], TOO_BIG: engine.adapters["big-rank"]}
    replica = {"id": "t0", "url": engine.http_url, "grpc": engine.grpc_address, "metrics_url": engine.metrics_url}
    config = gateway_config({}, {"acme": list(adapters)}, {}, port=free_port())
    config["pools"] = [triton_pool([replica], engine.model, BASE)]
    config["adapters"] = [{"name": name, "pool": "trt", "source": path} for name, path in adapters.items()]
    config["tenants"][0]["base_models"] = [BASE]
    with gateway_process(root, config) as (url, _):
        yield Lane(engine, url, root / "gateway.log")


@pytest.fixture
async def engine_client(lane: Lane) -> AsyncIterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(lane.engine.grpc_address)
    yield client
    await client.close()


async def _ask_engine(engine: TritonProcess, client: grpcclient.InferenceServerClient, arrays: Arrays) -> list[Result]:
    """One request straight to the engine, as the driver sends it (one request per ModelStreamInfer stream)."""

    async def one_request() -> AsyncIterator[dict[str, object]]:
        yield {"model_name": engine.model, "inputs": infer_inputs(arrays)}

    return [result async for result in client.stream_infer(one_request())]


def _one_answer(results: list[Result]) -> grpcclient.InferResult:
    assert len(results) == 1 and results[0][1] is None, results
    answer = results[0][0]
    assert answer is not None
    return answer


async def test_a_completion_is_the_engines_own_answer(
    lane: Lane, engine_client: grpcclient.InferenceServerClient
) -> None:
    completion = lane.client().completions.create(model=BASE, prompt=PROMPT, max_tokens=12)
    direct = _one_answer(await _ask_engine(lane.engine, engine_client, request_arrays(PROMPT, max_tokens=12)))
    assert completion.model == BASE and completion.object == "text_completion"
    assert completion.choices[0].text == engine_text(direct) != ""
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == engine_counts(direct)
    assert completion.choices[0].finish_reason == ("length" if engine_counts(direct)[1] == 12 else "stop")


async def test_an_adapter_streams_its_answer_and_stays_in_the_engines_cache(
    lane: Lane, engine_client: grpcclient.InferenceServerClient
) -> None:
    client = lane.client()
    whole = client.completions.create(model=ADAPTER, prompt=PROMPT, max_tokens=12)
    chunks = list(
        client.completions.create(
            model=ADAPTER, prompt=PROMPT, max_tokens=12, stream=True, stream_options={"include_usage": True}
        )
    )
    streamed = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert streamed == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and whole.usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # The gateway loaded the adapter's weights under its task id: the engine answers an id-only request for it
    # (no weights sent) with the same words, and the base model's words are other ones.
    task = task_id(ADAPTER, lane.engine.adapters["a1"])
    by_id = await _ask_engine(lane.engine, engine_client, request_arrays(PROMPT, max_tokens=12, lora_task_id=task))
    assert engine_text(_one_answer(by_id)) == streamed
    base = client.completions.create(model=BASE, prompt=PROMPT, max_tokens=12)
    assert base.choices[0].text != streamed


def test_a_chat_streams_openai_chunks(lane: Lane) -> None:
    chat: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello there"}]
    chunks = list(
        lane.client().chat.completions.create(
            model=ADAPTER, messages=chat, max_tokens=6, stream=True, stream_options={"include_usage": True}
        )
    )
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert len({chunk.id for chunk in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [chunk for chunk in chunks if chunk.choices]
    assert "".join(chunk.choices[0].delta.content or "" for chunk in with_choices)
    finishes = [chunk.choices[0].finish_reason for chunk in with_choices]
    assert finishes[-1] in ("stop", "length") and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


async def test_an_adapter_the_engine_refuses_is_a_502_and_the_replica_serves_on(
    lane: Lane, engine_client: grpcclient.InferenceServerClient
) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        lane.client().completions.create(model=TOO_BIG, prompt=PROMPT, max_tokens=4)
    assert caught.value.status_code == 502
    body = caught.value.response.json()["error"]
    assert body["message"] == "The model could not be loaded on its replica."
    # The refusal is the engine's (its rank limit is 8, the adapter's rank 16): the engine says so when asked
    # directly, and the gateway's log carries the engine's words for the operator.
    direct = request_arrays(PROMPT, max_tokens=4, lora_task_id=task_id(TOO_BIG, lane.engine.adapters["big-rank"]))
    assert "not found in cache" in engine_error(await _ask_engine(lane.engine, engine_client, direct))
    assert "Invalid low_rank (16)" in lane.log.read_text()
    assert lane.client().completions.create(model=ADAPTER, prompt=PROMPT, max_tokens=4).choices[0].text


def test_a_prompt_the_engine_refuses_is_a_400_in_its_words(lane: Lane) -> None:
    long_prompt = " ".join(["word"] * 600)  # over the engine's max_input_len of 511
    with pytest.raises(openai.BadRequestError) as caught:
        lane.client().completions.create(model=BASE, prompt=long_prompt, max_tokens=4)
    assert "Prompt length (600) exceeds maximum input length (511)" in caught.value.response.json()["error"]["message"]
