"""A non-streaming Triton call (backends/triton.py ``_whole``): read response by response until the replica's model
has answered with one response and the stream's end, as gRPC unary-unary from then on. A model that ends the call
without any response is an engine that broke off its answer (StreamBroken, as the streaming path reads it), not a
crash in the gateway; one that sends a second response, or does not end the stream, answers with its first at once;
an answer larger than any text answer is refused, not taken into memory whole. The simulator always answers
sensibly, so a minimal gRPC server stands in for such a model."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from backends.base import AdapterRef, EngineRequest
from backends.errors import EngineRejected, EngineTimeout, StreamBroken
from backends.http1 import MAX_WHOLE_BODY
from backends.triton import TritonDriver
from backends.triton_config import TritonEndpoint
from gateway.failures import classify
from loadtests.peft_files import write_peft_adapter
from loadtests.sim.triton_wire import add_output


class ScriptedModel(service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """A Triton that declares a text model and answers every ModelStreamInfer call with ``answers``."""

    def __init__(self, answers: Sequence[service_pb2.ModelStreamInferResponse]) -> None:
        self._answers = answers

    async def ModelMetadata(
        self, request: service_pb2.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> service_pb2.ModelMetadataResponse:
        tensor = service_pb2.ModelMetadataResponse.TensorMetadata
        inputs = [tensor(name="text_input", datatype="BYTES"), tensor(name="max_tokens", datatype="INT32")]
        return service_pb2.ModelMetadataResponse(name=request.name, inputs=inputs)

    async def ModelStreamInfer(
        self, requests: AsyncIterator[service_pb2.ModelInferRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[service_pb2.ModelStreamInferResponse]:
        async for _ in requests:  # half-closed: then the answers, and the stream's end
            for answer in self._answers:
                yield answer


@contextlib.asynccontextmanager
async def serving(model: ScriptedModel) -> AsyncIterator[tuple[TritonDriver, TritonEndpoint]]:
    server = grpc.aio.server(options=[("grpc.max_send_message_length", 2**31 - 1)])
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(model, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    driver = TritonDriver(
        model="m", lora_dtype="float16", default_max_tokens=8, chat_template=None,
        request_timeout_s=10, adapter_load_timeout_s=10, probe_timeout_s=5,
    )  # fmt: skip
    try:
        yield driver, TritonEndpoint("r0", f"http://127.0.0.1:{port}", f"127.0.0.1:{port}", "")
    finally:
        await driver.close()
        await server.stop(None)


REQUEST = EngineRequest(
    "/v1/completions", json.dumps({"model": "m", "prompt": "hello", "max_tokens": 2}).encode(), False
)


async def test_a_model_that_sends_no_response_is_a_broken_stream_not_a_crash() -> None:
    async with serving(ScriptedModel([])) as (driver, replica):
        with pytest.raises(StreamBroken, match="without an answer") as broken:
            await driver.send(replica, REQUEST)
        assert classify(broken.value).retryable  # another replica may answer it


async def test_an_answer_larger_than_a_whole_answer_is_refused_not_held() -> None:
    """A response over the size a whole answer may have (http1.MAX_WHOLE_BODY, as for vLLM's answers): a broken
    engine, or something else on its port. The channel took up to 2 GiB (the limit tritonclient sets for the
    adapter weights the gateway sends), each such answer held in memory whole, then copied into the client's."""
    huge = service_pb2.ModelStreamInferResponse()
    add_output(huge.infer_response, "text_output", "BYTES", b"x" * (MAX_WHOLE_BODY + 1024))
    async with serving(ScriptedModel([huge])) as (driver, replica):
        with pytest.raises(EngineRejected, match="RESOURCE_EXHAUSTED"):
            await driver.send(replica, REQUEST)


class SlowlyMissingAdapter(ScriptedModel):
    """A Triton whose PEFT cache lost the adapter: each call takes ``SLOW_S``; one without the weights is answered
    with the cache miss, one with them with a text."""

    def __init__(self) -> None:
        super().__init__([])

    async def ModelMetadata(
        self, request: service_pb2.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> service_pb2.ModelMetadataResponse:
        answer = await super().ModelMetadata(request, context)
        tensor = service_pb2.ModelMetadataResponse.TensorMetadata
        answer.inputs.extend(
            [
                tensor(name="lora_task_id", datatype="UINT64"),
                tensor(name="lora_weights", datatype="FP16"),
                tensor(name="lora_config", datatype="INT32"),
            ]
        )
        return answer

    async def ModelStreamInfer(
        self, requests: AsyncIterator[service_pb2.ModelInferRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[service_pb2.ModelStreamInferResponse]:
        async for request in requests:
            await asyncio.sleep(SLOW_S)
            if any(tensor.name == "lora_weights" for tensor in request.inputs):
                answer = service_pb2.ModelStreamInferResponse()
                add_output(answer.infer_response, "text_output", "BYTES", b"hi")
                yield answer
            else:
                message = "LoRA task 7 not found in cache. Please send LoRA weights with request"
                yield service_pb2.ModelStreamInferResponse(error_message=message)


SLOW_S = 0.6


async def test_the_resend_after_a_cache_miss_keeps_to_the_requests_deadline(tmp_path: Path) -> None:
    """The resend with the weights gets what is left of the request's time, not all of it again: two calls of 0.6 s
    within a 1 s deadline are a timeout, where they were an answer 1.2 s in (a tenant's shorter deadline doubled)."""
    source = write_peft_adapter(tmp_path / "a", 4)
    body = json.dumps({"model": "a", "prompt": "hello", "max_tokens": 2}).encode()
    request = EngineRequest(
        "/v1/completions", body, False, timeout_s=2 * SLOW_S - 0.2, adapter=AdapterRef("a", str(source))
    )
    async with serving(SlowlyMissingAdapter()) as (driver, replica):
        with pytest.raises(EngineTimeout):
            await driver.send(replica, request)


def answer(text: bytes = b"hi") -> service_pb2.ModelStreamInferResponse:
    message = service_pb2.ModelStreamInferResponse()
    add_output(message.infer_response, "text_output", "BYTES", text)
    return message


class OpenEnded(ScriptedModel):
    """A model that sends its answers and then neither ends the stream nor answers more, until the call goes."""

    def __init__(self, answers: Sequence[service_pb2.ModelStreamInferResponse]) -> None:
        super().__init__(answers)
        self.cancelled = asyncio.Event()

    async def ModelStreamInfer(
        self, requests: AsyncIterator[service_pb2.ModelInferRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[service_pb2.ModelStreamInferResponse]:
        async for message in super().ModelStreamInfer(requests, context):
            yield message
        try:
            await asyncio.Event().wait()
        finally:
            self.cancelled.set()


async def text_of(driver: TritonDriver, replica: TritonEndpoint, request: EngineRequest) -> str:
    response = await driver.send(replica, request)
    body: dict[str, Any] = json.loads(await response.read())
    text: str = body["choices"][0]["text"]
    return text


@pytest.mark.parametrize(
    "model",
    [
        pytest.param(lambda: ScriptedModel([answer(b"first"), answer(b"second")]), id="two responses"),
        pytest.param(lambda: OpenEnded([answer(b"first")]), id="one, and no end of the stream"),
    ],
)
async def test_a_model_that_does_not_end_at_its_answer_answers_at_once_not_at_the_deadline(
    model: Callable[[], ScriptedModel], caplog: pytest.LogCaptureFixture
) -> None:
    """The first response is the answer, at most FINAL_GRACE_S later: where the call was read as unary-unary
    whatever the model did, gRPC held its status behind the unread second response (or the stream's end that never
    came) until the request's deadline, a 504 however fast the model answered. The engine's call is cancelled, and
    the replica logged once."""
    scripted = model()
    async with serving(scripted) as (driver, replica):
        for _ in range(2):  # and the next request alike: such a model is never read as unary-unary
            assert await text_of(driver, replica, REQUEST._replace(timeout_s=5)) == "first"
        if isinstance(scripted, OpenEnded):
            await asyncio.wait_for(scripted.cancelled.wait(), 5)
    assert len([r for r in caplog.records if "more than one response" in r.getMessage()]) == 1  # once per replica


class TurnsToTwo(ScriptedModel):
    """A model that answers with one response until ``turn`` is set, then with two (a model swapped under a replica
    that stayed ready)."""

    def __init__(self) -> None:
        super().__init__([answer()])
        self.turn = False

    async def ModelStreamInfer(
        self, requests: AsyncIterator[service_pb2.ModelInferRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[service_pb2.ModelStreamInferResponse]:
        async for _ in requests:
            for message in [answer(), answer()] if self.turn else [answer()]:
                yield message


async def test_a_model_that_answered_alone_and_then_sends_two_costs_one_deadline_then_answers_at_once() -> None:
    """Once the replica's model has answered with one response and the stream's end, its calls are read as
    unary-unary (one await); a model that then sends two leaves the call in flight waiting until its deadline (what
    docs/triton.md states), and the next is read response by response again."""
    model = TurnsToTwo()
    async with serving(model) as (driver, replica):
        assert await text_of(driver, replica, REQUEST) == "hi"
        model.turn = True
        with pytest.raises(EngineTimeout):
            await driver.send(replica, REQUEST._replace(timeout_s=0.5))
        assert await text_of(driver, replica, REQUEST._replace(timeout_s=5)) == "hi"
