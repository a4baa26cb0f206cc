"""Triton's KServe v2 gRPC service (``inference.GRPCInferenceService``) over the simulated TensorRT-LLM model.

The model is decoupled, so unary ``ModelInfer`` is refused and inference goes over bidirectional
``ModelStreamInfer``, as on a real Triton server:
- the requests of one stream are served concurrently; each response's ``infer_response.id`` echoes its request's id;
- every response carries the bool parameter ``triton_final_response``. A non-streaming request's one response is
  final. A streaming request's token responses are not: the model ends it with a flags-only response, which Triton
  drops unless the request set ``triton_enable_empty_final_response`` (then it comes as a final with no outputs);
- an error is a response whose ``error_message`` is set (``infer_response`` holds only the id), and the stream
  goes on;
- the stream ends once the client has half-closed it and every request has answered; a client that cancels the
  call aborts its requests in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, NoReturn, TypeAlias

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from loadtests.sim.faults import Faults
from loadtests.sim.triton_contract import (
    EXTENSIONS,
    SERVER_NAME,
    SERVER_VERSION,
    VERSION,
    GenerateRequest,
    check_model,
    config_proto,
    metadata_proto,
    parse_request,
)
from loadtests.sim.triton_errors import TritonError, decoupled_refused
from loadtests.sim.triton_model import Reply, TrtLlmModel, refuse_by_faults
from loadtests.sim.triton_wire import add_output

_FINAL = "triton_final_response"


@dataclass(frozen=True)
class _Cut:
    """An injected fault: the stream goes away mid-answer."""


_Outgoing: TypeAlias = service_pb2.ModelStreamInferResponse | _Cut | None


class TritonGrpcService(service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    def __init__(self, model: TrtLlmModel, faults: Faults, model_name: str) -> None:
        self._model = model
        self._faults = faults
        self._name = model_name

    # --- health and metadata ----------------------------------------------------------------------------------
    async def ServerLive(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._faults.stall()
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._faults.stall()
        return service_pb2.ServerReadyResponse(ready=True)

    async def ModelReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._faults.stall()
        ready = request.name == self._name and request.version in ("", VERSION)
        return service_pb2.ModelReadyResponse(ready=ready)

    async def ServerMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._faults.stall()
        return service_pb2.ServerMetadataResponse(name=SERVER_NAME, version=SERVER_VERSION, extensions=EXTENSIONS)

    async def ModelMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._faults.stall()
        await self._check_model(context, request.name, request.version)
        return metadata_proto(self._name)

    async def ModelConfig(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._faults.stall()
        await self._check_model(context, request.name, request.version)
        return service_pb2.ModelConfigResponse(config=config_proto(self._name))

    # --- inference --------------------------------------------------------------------------------------------
    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._faults.stall()
        await self._check_model(context, request.model_name, request.model_version)
        await _abort(context, decoupled_refused("ModelInfer RPC"))

    async def ModelStreamInfer(self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> None:
        outgoing: asyncio.Queue[_Outgoing] = asyncio.Queue()
        answering: set[asyncio.Task[None]] = set()

        async def read() -> None:
            try:
                async for request in request_iterator:
                    task = asyncio.create_task(self._answer(request, outgoing.put_nowait))
                    answering.add(task)
                    task.add_done_callback(answering.discard)
                # Half-closed: as Triton, finish once every request has answered.
                await asyncio.gather(*answering)
            finally:
                outgoing.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (item := await outgoing.get()) is not None:
                if isinstance(item, _Cut):
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "Injected fault: stream cut")
                await context.write(item)
            await reader  # re-raises what broke the reading, if anything did
        finally:  # the client cancelled, or the stream is done: stop answering, which aborts engine requests
            reader.cancel()
            for task in list(answering):
                task.cancel()

    async def _answer(self, request: Any, send: Callable[[_Outgoing], None]) -> None:
        try:
            await self._faults.stall()
            parsed = parse_request(self._name, request)
            self._model.protocols["grpc"] += 1
            refuse_by_faults(self._faults, parsed)
            cut_after = self._faults.cut_stream_after
            sent = 0
            async with contextlib.aclosing(self._model.generate(parsed)) as replies:
                async for reply in replies:
                    if cut_after is not None and sent >= cut_after:
                        send(_Cut())
                        return
                    send(service_pb2.ModelStreamInferResponse(infer_response=self._response(parsed, reply)))
                    sent += 1
            if parsed.stream and parsed.empty_final_response:
                send(service_pb2.ModelStreamInferResponse(infer_response=self._empty_final(parsed.request_id)))
        except TritonError as exc:
            send(self._error(request.id, str(exc)))

    # --- responses --------------------------------------------------------------------------------------------
    def _head(self, request_id: str, final: bool) -> service_pb2.ModelInferResponse:
        response = service_pb2.ModelInferResponse(model_name=self._name, model_version=VERSION, id=request_id)
        response.parameters[_FINAL].bool_param = final
        return response

    def _response(self, request: GenerateRequest, reply: Reply) -> service_pb2.ModelInferResponse:
        # Non-streaming: the one response is final. Streaming: the end is a flags-only response (see above).
        response = self._head(request.request_id, final=not request.stream)
        wanted = request.outputs
        if not wanted or "text_output" in wanted:
            add_output(response, "text_output", "BYTES", reply.text.encode())
        if request.return_num_input_tokens and (not wanted or "num_input_tokens" in wanted):
            add_output(response, "num_input_tokens", "INT32", reply.num_input_tokens)
        if request.return_num_output_tokens and (not wanted or "num_output_tokens" in wanted):
            add_output(response, "num_output_tokens", "INT32", reply.num_output_tokens)
        return response

    def _empty_final(self, request_id: str) -> service_pb2.ModelInferResponse:
        return self._head(request_id, final=True)

    def _error(self, request_id: str, message: str) -> service_pb2.ModelStreamInferResponse:
        response = service_pb2.ModelStreamInferResponse(error_message=message)
        response.infer_response.id = request_id
        response.infer_response.parameters[_FINAL].bool_param = True
        return response

    async def _check_model(self, context: grpc.aio.ServicerContext, name: str, version: str) -> None:
        try:
            check_model(self._name, name, version)
        except TritonError as exc:
            await _abort(context, exc)


async def _abort(context: grpc.aio.ServicerContext, error: TritonError) -> NoReturn:
    await context.abort(error.kind.grpc_code, str(error))
    raise AssertionError("context.abort returned")  # it always raises


def create_server(service: TritonGrpcService, address: str) -> grpc.aio.Server:
    """An unstarted gRPC server serving ``service`` on ``address`` (host:port), with Triton's message limits."""
    limit = 2**31 - 1  # Triton accepts INT32_MAX-byte messages (server src/common.h)
    options = [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]
    server = grpc.aio.server(options=options)
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(service, server)
    server.add_insecure_port(address)
    return server
