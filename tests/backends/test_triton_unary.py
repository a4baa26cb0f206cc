"""A non-streaming Triton call is read as gRPC unary-unary (backends/triton.py ``_whole``): a model that ends the
call without any response is an engine that broke off its answer (StreamBroken, as the streaming path reads it),
not a crash in the gateway. The simulator always answers, so a minimal gRPC server stands in for such a model."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from backends.base import EngineRequest
from backends.errors import StreamBroken
from backends.triton import TritonDriver
from backends.triton_config import TritonEndpoint
from gateway.failures import classify


class SilentModel(service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """A Triton that declares a text model and ends every ModelStreamInfer call with no response."""

    async def ModelMetadata(
        self, request: service_pb2.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> service_pb2.ModelMetadataResponse:
        tensor = service_pb2.ModelMetadataResponse.TensorMetadata
        inputs = [tensor(name="text_input", datatype="BYTES"), tensor(name="max_tokens", datatype="INT32")]
        return service_pb2.ModelMetadataResponse(name=request.name, inputs=inputs)

    async def ModelStreamInfer(
        self, requests: AsyncIterator[service_pb2.ModelInferRequest], context: grpc.aio.ServicerContext
    ) -> None:
        async for _ in requests:
            pass  # half-closed, nothing answered: the stream ends OK with no message


async def test_a_model_that_sends_no_response_is_a_broken_stream_not_a_crash() -> None:
    server = grpc.aio.server()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(SilentModel(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    driver = TritonDriver(
        model="m", lora_dtype="float16", default_max_tokens=8, chat_template=None,
        request_timeout_s=10, adapter_load_timeout_s=10, probe_timeout_s=5,
    )  # fmt: skip
    replica = TritonEndpoint("r0", f"http://127.0.0.1:{port}", f"127.0.0.1:{port}", "")
    body = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 2}).encode()
    try:
        with pytest.raises(StreamBroken, match="without an answer") as broken:
            await driver.send(replica, EngineRequest("/v1/completions", body, False))
        assert classify(broken.value).retryable  # another replica may answer it
    finally:
        await driver.close()
        await server.stop(None)
