"""An error the engine reports in the middle of a Triton stream is the engine's answer, not a broken connection:
an EngineRejected whose status says whose fault the message names, so outlier detection counts it only on evidence
(gateway/fleet/outlier.py), where a dropped stream (StreamBroken) always counts."""

from __future__ import annotations

import pytest
from tritonclient.grpc import service_pb2

from backends.errors import EngineRejected
from backends.triton import GrpcStream, TritonResponse, grpc_piece
from backends.triton_openai import TritonCall
from gateway.failures import classify
from loadtests.sim.triton_wire import add_output


class StreamThatFails:
    """The rest of a gRPC stream: one model response whose error_message is set."""

    def __init__(self, message: str) -> None:
        self._message = message

    async def read(self) -> service_pb2.ModelStreamInferResponse:
        return service_pb2.ModelStreamInferResponse(error_message=self._message)

    def cancel(self) -> None:
        return None


@pytest.mark.parametrize(
    ("message", "status", "blame"),
    [
        pytest.param("Encountered an error in forwardAsync function: CUDA error", 500, "suspect", id="engine"),
        pytest.param("Input length exceeds the maximum", 400, "none", id="the-clients"),
    ],
)
async def test_an_error_mid_stream_is_the_engines_answer(message: str, status: int, blame: str) -> None:
    first = service_pb2.ModelInferResponse()
    add_output(first, "text_output", "BYTES", b"hello")
    call = TritonCall(chat=False, model="m", prompt="p", max_tokens=8, stream=True)
    response = TritonResponse(call, GrpcStream(StreamThatFails(message), "r0"), grpc_piece(first))
    with pytest.raises(EngineRejected) as failed:
        async for _chunk in response.chunks():
            pass
    assert failed.value.status == status and classify(failed.value).blame == blame
