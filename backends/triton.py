"""The Triton / TensorRT-LLM driver: OpenAI requests as calls to a TensorRT-LLM model, LoRA per TensorRT-LLM's
contract, health and load from Triton's HTTP endpoints.

Streaming requests go over Triton's generate extension on the gateway's HTTP/1.1 client (``backends/triton_http.py``:
a third of gRPC's CPU per request; why only streaming ones is said there). The others, and every request carrying
LoRA weights, go over gRPC (grpc.aio with tritonclient's generated stub), each one request on its own
``ModelStreamInfer`` stream: decoupled models (the only ones that stream) refuse unary calls, and the end of the
stream is the end of the answer whether or not the model sends an empty final response. Several requests are never
carried on one stream: cancelling a gRPC stream cancels every request on it, and Triton has no message that cancels
one request of a stream, so a client that leaves could not stop its own generation without stopping the others'.
The call is made as gRPC unary-stream (``_STREAM_INFER``): on the wire that is the same stream (the request's
message, the half-close, then the responses), sent by grpc.aio as one batch of operations where a stream-stream
call awaits three (start, write, half-close; the write and the half-close were 13% of the gateway's profile in
make bench-gateway's Triton pool). The messages are tritonclient's generated protobufs, built and read by
``backends/triton_wire.py``. docs/triton.md has the model contract and how adapters are handled. The pool's
``triton:`` section, its replicas' ``grpc`` and ``metrics_url`` and the checks on its adapters are in
``backends/triton_config.py``; this module registers them with the driver as engine ``triton``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any, Protocol
from urllib.parse import quote

import aiohttp
import grpc
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import service_pb2, service_pb2_grpc
from yarl import URL

from backends import http1
from backends.base import AdapterEvent, AdapterRef, Endpoint, EngineLoad, EngineRequest
from backends.errors import (
    AdapterCacheFull,
    AdapterLoadFailed,
    AdapterNotLoaded,
    BackendError,
    EngineRejected,
    EngineTimeout,
    EngineUnavailable,
    StreamBroken,
)
from backends.lora_weights import AdapterFormatError, TrtLoraWeights, convert_peft, task_id
from backends.registry import EngineSpec, PoolSettings, register
from backends.side_reads import MAX_METRICS_PAGE, read_text
from backends.triton_config import TritonConfig, TritonEndpoint, TritonReplica, adapters_convert, task_id_collisions
from backends.triton_config import triton_endpoint as _endpoint
from backends.triton_http import Piece, SseStream, error_status, json_body
from backends.triton_http import start as start_http
from backends.triton_openai import AnswerWriter, ChatTemplate, TritonCall, parse_request, usage
from backends.triton_wire import Input, array, first_int32, first_text, output, scalar, texts
from backends.triton_wire import request as wire_request

log = logging.getLogger(__name__)

# TensorRT-LLM's texts (a substring: Triton and ensembles wrap them in their own words).
CACHE_MISS = "not found in cache"
CACHE_FULL = "Cache is full"
# The adapter events this driver reports (backends.base.AdapterEvent): "cache_miss" (the engine had dropped the
# adapter) and "cache_full" (it could not take one more).
_OLD_NAMES = {"seed": "random_seed", "min_tokens": "min_length"}
_OUTPUTS = ("text_output", "num_input_tokens", "num_output_tokens")
# As tritonclient's channel: messages sent up to 2 GiB (adapter weights are large), keepalive so a half-open
# connection is noticed. Answers are text: one over http1.MAX_WHOLE_BODY (as for vLLM's answers) is a broken engine
# or something else on the port, refused (RESOURCE_EXHAUSTED) rather than held in memory whole.
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 2**31 - 1),
    ("grpc.max_receive_message_length", http1.MAX_WHOLE_BODY),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
]
Call = Any  # grpc.aio.UnaryStreamCall[ModelInferRequest, ModelStreamInferResponse]
_STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"
# How long a non-streaming call waits for the stream's end after its first response (``TritonDriver._first_of``).
FINAL_GRACE_S = 0.5


class ResponseStream(Protocol):
    """The rest of one call's answer, model response by model response (gRPC or HTTP)."""

    async def next(self) -> Piece | None: ...

    def close(self) -> None: ...


class TritonResponse:
    """An answer whose first model response has arrived; the rest is read or streamed once, as OpenAI bytes."""

    status = 200

    def __init__(self, call: TritonCall, stream: ResponseStream, first: Piece) -> None:
        self._stream, self._first = stream, first
        self._writer = AnswerWriter(call)
        self._counts: tuple[int | None, int | None] = (None, None)
        self.content_type = "text/event-stream" if call.stream else "application/json"

    async def read(self) -> bytes:
        text = "".join([piece async for piece in self._pieces()])
        return self._writer.whole(text, usage(*self._counts))

    async def chunks(self) -> AsyncIterator[bytes]:
        opening = self._writer.opening()
        async for piece in self._pieces():
            if piece:
                yield opening + self._writer.chunk(piece)
                opening = b""
        yield opening + self._writer.ending(usage(*self._counts))

    async def _pieces(self) -> AsyncIterator[str]:
        piece: Piece | None = self._first
        while piece is not None:
            text, prompt_tokens, completion_tokens = piece
            if completion_tokens is not None:  # cumulative in streaming (docs/triton.md): the last one counts
                self._counts = (prompt_tokens, completion_tokens)
            yield text
            piece = await self._stream.next()

    def release(self) -> None:
        self._stream.close()  # before the end: the engine stops generating for a client that left


class GrpcStream:
    """The rest of one ``ModelStreamInfer`` call's answer."""

    def __init__(self, call: Call, replica_id: str) -> None:
        self._call, self._replica_id = call, replica_id
        self._done = False

    async def next(self) -> Piece | None:
        try:
            message = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise EngineTimeout(f"{self._replica_id} did not finish the answer in time") from exc
            raise StreamBroken(f"{self._replica_id} broke off the stream: {exc.code().name} {exc.details()}") from exc
        except asyncio.CancelledError:
            _reraise_if_cancelled()
            raise StreamBroken(f"{self._replica_id}: the call was cancelled (the pool is closing)") from None
        if message is grpc.aio.EOF:
            self._done = True
            return None
        if message.error_message:  # the engine's own error, not a broken connection: whose fault it names
            text = f"{self._replica_id} failed mid-answer: {message.error_message}"
            raise EngineRejected(error_status(message.error_message), text)
        return grpc_piece(message.infer_response)

    def close(self) -> None:
        if not self._done:
            self._call.cancel()


class _Answered:
    """The rest of an answer that came whole: nothing."""

    async def next(self) -> Piece | None:
        return None

    def close(self) -> None:
        return None


_ANSWERED = _Answered()


def grpc_piece(result: service_pb2.ModelInferResponse) -> Piece:
    text = first_text(output(result, "text_output"))
    return text, first_int32(output(result, "num_input_tokens")), first_int32(output(result, "num_output_tokens"))


class TritonDriver:
    def __init__(
        self,
        *,
        model: str,
        lora_dtype: str,
        default_max_tokens: int,
        chat_template: str | None,
        request_timeout_s: float,
        adapter_load_timeout_s: float,
        probe_timeout_s: float,
        weights_cache_bytes: int = 1 << 30,
        connect_timeout_s: float = 5.0,
        max_connections_per_replica: int = 1024,
        on_event: AdapterEvent | None = None,
    ) -> None:
        self._model = model
        self._lora_dtype = lora_dtype
        self._default_max_tokens = default_max_tokens
        self._template = ChatTemplate(chat_template)
        self._request_timeout_s = request_timeout_s
        self._load_timeout_s = adapter_load_timeout_s
        self._on_event = on_event or (lambda replica, adapter, event: None)
        self._channels: dict[str, _Channel] = {}
        self._inputs: dict[str, dict[str, str]] = {}  # replica id -> the model's inputs (name -> datatype)
        self._outputs: dict[str, tuple[str, ...]] = {}  # replica id -> the outputs asked for (those it has)
        # Converted adapters, least recently used first, within a byte budget (an 8B model's rank-16 adapter is
        # ~130 MB in this layout): (engine name, source) -> weights.
        self._weights: OrderedDict[tuple[str, str], TrtLoraWeights] = OrderedDict()
        self._weights_budget = weights_cache_bytes
        self._converting: dict[tuple[str, str], asyncio.Task[TrtLoraWeights]] = {}
        self._probe_timeout_s = probe_timeout_s
        self._unready: dict[str, str | None] = {}  # replica id -> why its last probe failed (None: ready)
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=probe_timeout_s))
        # Streaming requests: a keep-alive HTTP/1.1 pool per replica (backends/http1.py), and the answers still
        # open, which close() breaks off.
        self._connect_timeout_s, self._max_connections = connect_timeout_s, max_connections_per_replica
        self._origins: dict[str, tuple[http1.Origin, str]] = {}
        self._streams: weakref.WeakSet[SseStream] = weakref.WeakSet()
        # Replicas whose model answered a non-streaming call with one response and the stream's end (read as
        # unary-unary from then on), and those whose model did not (logged once).
        self._one_response: set[str] = set()
        self._warned_unended: set[str] = set()

    # --- adapters ------------------------------------------------------------------------------------------

    async def prepare_adapter(self, adapter: AdapterRef) -> None:
        """Read and convert the weights (they may take seconds for a large model) outside the replica's lock."""
        try:
            async with asyncio.timeout(self._load_timeout_s):
                await self._adapter_weights(adapter)
        except TimeoutError as exc:
            raise EngineTimeout(f"reading {adapter.engine_name}'s weights from {adapter.source} timed out") from exc

    async def load_adapter(self, replica: Endpoint, adapter: AdapterRef) -> None:
        """Put the adapter in the engine's PEFT cache: a one-token request carrying its weights."""
        try:
            async with asyncio.timeout(self._load_timeout_s):
                await self._load(replica, adapter)
        except TimeoutError as exc:
            raise EngineTimeout(f"loading {adapter.engine_name} on {replica.id} timed out") from exc

    async def _load(self, replica: Endpoint, adapter: AdapterRef) -> None:
        weights = await self._adapter_weights(adapter)
        call = TritonCall(chat=False, model=adapter.engine_name, prompt="warm-up", max_tokens=1, stream=False)
        try:
            stream, first, error = await self._start(replica, call, adapter, weights, {}, self._load_timeout_s)
        except AdapterCacheFull:
            raise
        except EngineRejected as exc:
            raise AdapterLoadFailed(adapter.engine_name, exc.status, exc.message) from exc
        if error is not None:
            stream.close()
            self._raise_engine_error(replica, adapter, error, weights_sent=True, loading=True)
        response = TritonResponse(call, stream, first)
        try:
            await response.read()
        finally:
            response.release()

    async def unload_adapter(self, replica: Endpoint, engine_name: str) -> None:
        """TensorRT-LLM has no unload: its PEFT cache drops least recently used adapters itself when full. The
        gateway's record stops routing by the adapter; nothing to tell the engine."""

    async def list_adapters(self, replica: Endpoint) -> set[str] | None:
        return None  # TensorRT-LLM does not say what its PEFT cache holds

    async def _adapter_weights(self, adapter: AdapterRef) -> TrtLoraWeights:
        """Converted once per adapter (off the event loop), kept for the most recently used ones within budget."""
        key = (adapter.engine_name, adapter.source)
        weights = self._weights.get(key)
        if weights is not None:
            self._weights.move_to_end(key)
            return weights
        task = self._converting.get(key)
        if task is None:
            task = asyncio.create_task(asyncio.to_thread(convert_peft, adapter.source, self._lora_dtype))
            self._converting[key] = task
            task.add_done_callback(lambda _: self._converting.pop(key, None))
        try:
            weights = await asyncio.shield(task)
        except AdapterFormatError as exc:
            raise AdapterLoadFailed(adapter.engine_name, 400, str(exc)) from exc
        self._weights[key] = weights
        kept = sum(w.nbytes for w in self._weights.values())
        while kept > self._weights_budget and len(self._weights) > 1:  # the one in use stays, even if over
            _, dropped = self._weights.popitem(last=False)
            kept -= dropped.nbytes
        return weights

    # --- requests ------------------------------------------------------------------------------------------

    async def send(self, replica: Endpoint, request: EngineRequest) -> TritonResponse:
        chat = request.path.endswith("/chat/completions")
        call = parse_request(chat, request.body, self._template, self._default_max_tokens)
        timeout = request.timeout_s if request.timeout_s is not None else self._request_timeout_s
        deadline = time.monotonic() + timeout  # a resend gets what is left of it, not all of it again
        adapter, headers = request.adapter, dict(request.headers)
        if call.stream:
            stream, first, error = await self._start_http(replica, call, adapter, headers, timeout)
        else:
            stream, first, error = await self._start(replica, call, adapter, None, headers, timeout)
        if error is not None:
            stream.close()  # an error ends the request; the call must not outlive it
        if error is not None and adapter is not None and CACHE_MISS in error:
            # The engine evicted it (or restarted): send this request again, once, with the weights.
            self._on_event(replica.id, adapter.engine_name, "cache_miss")
            weights = await self._adapter_weights(adapter)
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineTimeout(f"{replica.id} did not answer in time")
            stream, first, error = await self._start(replica, call, adapter, weights, headers, left)
            if error is not None:
                stream.close()
                self._raise_engine_error(replica, adapter, error, weights_sent=True)
        elif error is not None:
            self._raise_engine_error(replica, adapter, error, weights_sent=False)
        return TritonResponse(call, stream, first)

    async def _start_http(
        self, replica: Endpoint, call: TritonCall, adapter: AdapterRef | None, headers: dict[str, str], timeout_s: float
    ) -> tuple[ResponseStream, Piece, str | None]:
        """Send the call over the generate extension and wait for its first response (backends/triton_http.py)."""
        model_inputs = await self._model_inputs(replica)
        body = json_body([(name, value) for name, _, value in _fields(call, model_inputs, adapter)])
        origin, target = self._origin(replica)
        try:
            head = origin.request_head("POST", target, "application/json", headers, len(body))
        except ValueError as exc:  # a header value that would break the request's head
            raise EngineRejected(400, str(exc)) from exc
        stream, first, error = await start_http(origin, head, body, timeout_s, replica.id)
        self._streams.add(stream)
        return stream, first, error

    async def _start(
        self,
        replica: Endpoint,
        call: TritonCall,
        adapter: AdapterRef | None,
        weights: TrtLoraWeights | None,
        headers: dict[str, str],
        timeout_s: float,
    ) -> tuple[ResponseStream, Piece, str | None]:
        """Open the call's gRPC stream and wait for its first response: (stream, first response, in-stream error)."""
        model_inputs = await self._model_inputs(replica)
        outputs = self._outputs.get(replica.id, ())
        message = wire_request(self._model, _inputs(call, model_inputs, adapter, weights), outputs)
        channel, metadata = self._channel(replica), tuple(headers.items()) or None
        if not call.stream:
            return await self._whole(replica, channel, message, metadata, timeout_s)
        # One request per stream, sent with its half-close: the end of the stream is the end of the answer.
        stream = channel.stream_infer(message, metadata=metadata, timeout=timeout_s)
        try:
            first = await stream.read()
        except grpc.aio.AioRpcError as exc:
            raise _rpc_error(replica, exc) from exc
        except asyncio.CancelledError:
            stream.cancel()
            _reraise_if_cancelled()
            raise EngineUnavailable(f"{replica.id}: the call was cancelled (the pool is closing)") from None
        if first is grpc.aio.EOF:
            raise StreamBroken(f"{replica.id} ended the stream without an answer")
        return GrpcStream(stream, replica.id), grpc_piece(first.infer_response), (first.error_message or None)

    async def _whole(
        self,
        replica: Endpoint,
        channel: _Channel,
        message: service_pb2.ModelInferRequest,
        metadata: tuple[tuple[str, str], ...] | None,
        timeout_s: float,
    ) -> tuple[ResponseStream, Piece, str | None]:
        """A non-streaming call: the model answers with one response (its whole text, or its error), then the
        stream ends. Where the replica's model has done so, the call is read as gRPC unary-unary, the answer and the
        stream's end in one await (``_Channel``); until then (and after such a call ran out of time) response by
        response (``_first_of``), so a model that sends a second response, or does not end the stream, costs the
        client ``FINAL_GRACE_S`` at most, not the request's whole deadline."""
        learnt = replica.id in self._one_response
        call = None if learnt else channel.stream_infer(message, metadata=metadata, timeout=timeout_s)
        try:
            if call is not None:
                answer = await self._first_of(replica, call)
            # the call ended with no response at all: grpc.aio reads that as None, not an error
            elif (answer := await channel.infer_whole(message, metadata=metadata, timeout=timeout_s)) is None:
                raise StreamBroken(f"{replica.id} ended the stream without an answer")
        except grpc.aio.AioRpcError as exc:
            if learnt and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # perhaps a model that now sends two
                self._one_response.discard(replica.id)
            raise _rpc_error(replica, exc) from exc
        except asyncio.CancelledError:  # the request's handler was cancelled (the client left, or the pool closes)
            _reraise_if_cancelled()
            raise EngineUnavailable(f"{replica.id}: the call was cancelled (the pool is closing)") from None
        finally:
            if call is not None:
                call.cancel()  # a no-op once the stream has ended; else the engine drops whatever would follow
        return _ANSWERED, grpc_piece(answer.infer_response), (answer.error_message or None)

    async def _first_of(self, replica: Endpoint, call: Call) -> service_pb2.ModelStreamInferResponse:
        """A non-streaming call read response by response: the first is the answer, once the stream has ended or
        ``FINAL_GRACE_S`` after it (a second response, or none and no end, is logged once per replica; the caller
        then cancels the call). A stream that ended right after it teaches that the replica's model sends one."""
        answer = await call.read()
        if answer is grpc.aio.EOF:
            raise StreamBroken(f"{replica.id} ended the stream without an answer")
        try:
            following = await asyncio.wait_for(call.read(), FINAL_GRACE_S)
        except (TimeoutError, grpc.aio.AioRpcError):  # the answer is in: what broke after it loses nothing
            following = None
        if following is grpc.aio.EOF:
            self._one_response.add(replica.id)
        elif replica.id not in self._warned_unended:
            self._warned_unended.add(replica.id)
            log.warning(
                "triton replica %s: model %r answered a non-streaming request with more than one response, or did "
                "not end the stream within %.1f s of its first: the first is the answer (docs/triton.md)",
                replica.id, self._model, FINAL_GRACE_S,
            )  # fmt: skip
        return answer

    def _raise_engine_error(
        self, replica: Endpoint, adapter: AdapterRef | None, message: str, *, weights_sent: bool, loading: bool = False
    ) -> None:
        if adapter is not None and CACHE_FULL in message:
            self._on_event(replica.id, adapter.engine_name, "cache_full")
            raise AdapterCacheFull(503, f"{replica.id} has no room for another adapter now: {message}")
        if adapter is not None and CACHE_MISS in message:
            raise AdapterNotLoaded(404, message)
        if adapter is not None and (loading or (weights_sent and "lora" in message.lower())):
            raise AdapterLoadFailed(adapter.engine_name, 400, message)
        raise EngineRejected(error_status(message), message)

    # --- model metadata, clients ---------------------------------------------------------------------------

    async def _model_inputs(self, replica: Endpoint) -> dict[str, str]:
        """The model's declared inputs, read once per replica: only those are sent (older models lack some)."""
        known = self._inputs.get(replica.id)
        if known is not None:
            return known
        try:
            metadata = await self._channel(replica).stub.ModelMetadata(
                service_pb2.ModelMetadataRequest(name=self._model), timeout=self._probe_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise _rpc_error(replica, exc) from exc
            raise EngineRejected(502, f"{replica.id} does not serve model {self._model!r}: {exc.details()}") from exc
        inputs = {tensor.name: tensor.datatype for tensor in metadata.inputs}
        self._inputs[replica.id] = inputs
        declared = {tensor.name for tensor in metadata.outputs}
        self._outputs[replica.id] = tuple(name for name in _OUTPUTS if name in declared)
        return inputs

    def _origin(self, replica: Endpoint) -> tuple[http1.Origin, str]:
        known = self._origins.get(replica.id)
        if known is None:
            url = URL(f"{replica.url}/v2/models/{quote(self._model, safe='')}/generate_stream")
            origin = http1.Origin(url, limit=self._max_connections, connect_timeout_s=self._connect_timeout_s)
            known = self._origins[replica.id] = (origin, url.raw_path)
        return known

    def _channel(self, replica: Endpoint) -> _Channel:
        known = self._channels.get(replica.id)
        if known is None:
            known = self._channels[replica.id] = _Channel(_triton(replica).grpc_address)
        return known

    # --- health and load -----------------------------------------------------------------------------------

    async def healthy(self, replica: Endpoint) -> bool:
        """Ready means the server is up and has the pool's model (``triton.model``) ready: a server without it
        would fail every request with "the model could not be loaded"; why it is not ready is logged when it
        changes (from the first probe, at start-up)."""
        reason = await self._unready_reason(replica)
        if reason != self._unready.get(replica.id):
            if reason is not None:
                log.warning("triton replica %s is not ready: %s", replica.id, reason)
            self._unready[replica.id] = reason
        if reason is not None:
            self._inputs.pop(replica.id, None)  # it may come back with another model version: read it again
            self._one_response.discard(replica.id)
        return reason is None

    async def _unready_reason(self, replica: Endpoint) -> str | None:
        model = quote(self._model, safe="")
        try:
            # Not following a redirect: a front's page answering 200 is not the server ready.
            async with self._http.get(f"{replica.url}/v2/models/{model}/ready", allow_redirects=False) as response:
                if response.status == 200:
                    return None
            async with self._http.get(replica.url + "/v2/health/ready", allow_redirects=False) as response:
                if response.status != 200:
                    return f"the server is not ready (GET /v2/health/ready answered {response.status})"
        except (TimeoutError, aiohttp.ClientError) as exc:
            return f"unreachable ({type(exc).__name__})"
        return (
            f"the server is up but model {self._model!r} is not ready there (GET /v2/models/{model}/ready answered "
            f"{response.status}): check the pool's triton.model against the server's model repository"
        )

    async def load_signals(self, replica: Endpoint) -> EngineLoad | None:
        """TensorRT-LLM's request and KV-cache gauges where the model reports them, else Triton's queue depth."""
        if not isinstance(replica, TritonEndpoint):
            return None
        try:
            async with self._http.get(replica.metrics_url) as response:
                if response.status != 200:
                    return None
                text = await read_text(response, MAX_METRICS_PAGE)
        except (TimeoutError, aiohttp.ClientError):
            return None
        # Parsed on a worker thread, as vLLM's page is: the event loop goes on while it is read.
        return await asyncio.to_thread(self._read_load, text)

    def _read_load(self, text: str) -> EngineLoad | None:
        """The load gauges of a metrics page (``load_signals``); None if it does not parse."""
        families = ("nv_trt_llm_request_metrics", "nv_trt_llm_kv_cache_block_metrics", "nv_inference_pending")
        lines = [line for line in text.splitlines() if any(name in line for name in families)]
        gauges: dict[tuple[str, str], float] = {}
        try:
            for family in text_string_to_metric_families("\n".join(lines) + "\n"):
                for sample in family.samples:
                    if (
                        family.name == "nv_inference_pending_request_count"
                        and sample.labels.get("model") != self._model
                    ):
                        continue  # an ensemble's steps queue the same request again: count the entry model only
                    kind = sample.labels.get("request_type") or sample.labels.get("kv_cache_block_type") or ""
                    key = (family.name, kind)
                    gauges[key] = gauges.get(key, 0.0) + sample.value
        except ValueError:
            return None
        pending = gauges.get(("nv_inference_pending_request_count", ""), 0.0)
        return EngineLoad(
            running=gauges.get(("nv_trt_llm_request_metrics", "active"), 0.0),
            waiting=gauges.get(("nv_trt_llm_request_metrics", "waiting"), pending),
            kv_cache_usage=gauges.get(("nv_trt_llm_kv_cache_block_metrics", "fraction"), 0.0),
        )

    async def close(self) -> None:
        for stream in list(self._streams):
            stream.close()  # an answer still open breaks off (StreamBroken for its reader)
        for origin, _ in self._origins.values():
            origin.close()
        self._origins.clear()
        await asyncio.gather(*(known.channel.close() for known in self._channels.values()))
        self._channels.clear()
        await self._http.close()


class _Channel:
    """One replica's channel, made once, with tritonclient's stub (metadata calls) and the inference call."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self.stream_infer = self.channel.unary_stream(
            _STREAM_INFER,
            request_serializer=service_pb2.ModelInferRequest.SerializeToString,
            response_deserializer=service_pb2.ModelStreamInferResponse.FromString,
        )
        # The same method read as unary-unary, for non-streaming calls: one response, then the stream's end, in one
        # await. The driver's CPU per call fell from 417-448 to 277 us against the real Triton lane (the unary-stream
        # call's two reads each hand a completion from grpc's poller thread to the event loop). Used only for a
        # replica whose model has answered so (``TritonDriver._whole``): one that sent a second response would leave
        # the call waiting until the request's timeout, since gRPC holds the call's status behind the unread message.
        self.infer_whole = self.channel.unary_unary(
            _STREAM_INFER,
            request_serializer=service_pb2.ModelInferRequest.SerializeToString,
            response_deserializer=service_pb2.ModelStreamInferResponse.FromString,
        )


def _fields(call: TritonCall, model_inputs: dict[str, str], adapter: AdapterRef | None) -> list[tuple[str, str, Any]]:
    """The call's inputs as (name, datatype, value), sending only what the model declares; the value is a scalar,
    or a list for ``stop_words``."""
    fields: list[tuple[str, str, Any]] = [
        ("text_input", "BYTES", call.prompt),
        ("max_tokens", "INT32", call.max_tokens),
    ]
    if "stream" in model_inputs:
        fields.append(("stream", "BOOL", call.stream))
    elif call.stream:
        raise EngineRejected(400, "this model's engine does not stream")
    for name, value in call.sampling.items():
        wire = name if name in model_inputs else _OLD_NAMES.get(name, name)  # models before TensorRT-LLM's rename
        datatype = model_inputs.get(wire)
        if datatype not in ("INT32", "UINT64", "FP32"):
            raise EngineRejected(400, f"'{name}' is not supported by this model's engine")
        fields.append((wire, datatype, value))
    if call.stop:
        if "stop_words" not in model_inputs:
            raise EngineRejected(400, "'stop' is not supported by this model's engine")
        fields.append(("stop_words", "BYTES", list(call.stop)))
    if "exclude_input_in_output" in model_inputs:
        fields.append(("exclude_input_in_output", "BOOL", not call.echo))
    elif call.echo:
        raise EngineRejected(400, "'echo' is not supported by this model's engine")
    for flag in ("return_num_input_tokens", "return_num_output_tokens"):
        if flag in model_inputs:
            fields.append((flag, "BOOL", True))
    if adapter is not None:
        if "lora_task_id" not in model_inputs:
            raise EngineRejected(400, "this model's engine serves no adapters (it has no lora_task_id input)")
        fields.append(("lora_task_id", "UINT64", task_id(adapter.engine_name, adapter.source)))
    return fields


def _inputs(
    call: TritonCall, model_inputs: dict[str, str], adapter: AdapterRef | None, weights: TrtLoraWeights | None
) -> list[Input]:
    """The call as the model's input tensors (batch of one), with the adapter's weights when given."""
    tensors = [
        texts(name, [value.encode()] if isinstance(value, str) else [word.encode() for word in value])
        if datatype == "BYTES"
        else scalar(name, datatype, value)
        for name, datatype, value in _fields(call, model_inputs, adapter)
    ]
    if adapter is not None and weights is not None:
        tensors.append(array("lora_weights", weights.weights_datatype, weights.weights))
        tensors.append(array("lora_config", "INT32", weights.config))
    return tensors


def _triton(replica: Endpoint) -> TritonEndpoint:
    """The replica's Triton addresses: the pool's spec builds every replica's endpoint as a ``TritonEndpoint``."""
    if not isinstance(replica, TritonEndpoint):
        raise TypeError(f"{replica.id}: a Triton driver needs a TritonEndpoint (gRPC address), not {replica!r}")
    return replica


def _rpc_error(replica: Endpoint, exc: grpc.aio.AioRpcError) -> BackendError:
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.UNAVAILABLE:
        return EngineUnavailable(f"{replica.id} unreachable: {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return EngineTimeout(f"{replica.id} did not answer in time")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return EngineRejected(400, details)
    return EngineRejected(502 if code == grpc.StatusCode.NOT_FOUND else 500, f"{replica.id}: {code.name} {details}")


def _reraise_if_cancelled() -> None:
    """grpc raises CancelledError in every call on a channel that closes; only a cancelled task should see one."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def _driver(settings: TritonConfig, pool: PoolSettings) -> TritonDriver:
    return TritonDriver(
        model=settings.model,
        lora_dtype=settings.lora_dtype,
        default_max_tokens=settings.default_max_tokens,
        chat_template=settings.chat_template,
        request_timeout_s=pool.request_timeout_s,
        adapter_load_timeout_s=pool.adapter_load_timeout_s,
        probe_timeout_s=pool.probe_timeout_s,
        weights_cache_bytes=settings.weights_cache_mib << 20,
        connect_timeout_s=pool.connect_timeout_s,
        max_connections_per_replica=pool.max_connections_per_replica,
        on_event=pool.on_adapter_event,
    )


SPEC = register(
    EngineSpec(
        name="triton",
        settings=TritonConfig,
        driver=_driver,
        replica=TritonReplica,
        endpoint=_endpoint,
        checks=task_id_collisions,
        read_adapters=adapters_convert,
        queues_when_full=False,
        loads_between_steps=False,
    )
)
