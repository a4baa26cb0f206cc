"""Streaming requests to Triton over its generate extension (``POST /v2/models/{model}/generate_stream``, answered
as server-sent events) on the gateway's keep-alive HTTP/1.1 client (backends/http1.py).

Why not gRPC for these: grpc.aio's per-call machinery (the batch of send operations, a read per response and the
call's end, each completion handed from grpc's poller thread to the event loop) was most of a Triton pool's CPU per
request; this client costs a third of it for the same request (figures in docs/benchmarks.md).

Why only streaming requests (backends/triton.py sends the others, and every request carrying LoRA weights, over
gRPC ``ModelStreamInfer``):
- Triton's HTTP server notices a closed connection only when it next writes to it (it stops reading a request's
  connection while the request runs). A streaming request's answer is written token by token, so a client that
  leaves stops the engine at its next token; a non-streaming answer is written once, at its end, so a client that
  left would not stop it (checked against Triton 2.51). gRPC cancels either at once.
- The generate extension takes inputs as JSON: FP16 (the LoRA weights) cannot come that way.

The events: one ``data: {...}`` per model response, its outputs by name (one-element outputs as scalars); an error
is ``data: {"error": "..."}``, with the error's HTTP status when it is the first response. The error texts are the
engine's, the same as gRPC's in-stream ``error_message``, so the driver reads both alike.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import orjson

from backends import http1
from backends.errors import EngineRejected, EngineTimeout, EngineUnavailable, StreamBroken

# One model response: (its text, the prompt's tokens, the answer's tokens so far); counts None when not reported.
Piece = tuple[str, int | None, int | None]
_ERROR_BODY_LIMIT = 1 << 20
# One event is one model response (a token's text and two counts): an event this long is no answer but a broken
# engine or something else on the port, read no further rather than held in memory without bound.
EVENT_LIMIT = 1 << 20
_INT32_MAX = 2**31 - 1  # the token counts' type (INT32 outputs)
# An engine error whose text names the request's fault (TensorRT-LLM's "exceeds", "invalid", "must be").
_CLIENT_FAULT = re.compile(r"\b(exceeds|invalid|must be)\b", re.IGNORECASE)


def error_status(message: str) -> int:
    """The status of an engine's error text, over either protocol: 400 when it names the request's fault, else 500
    (outlier detection then counts it against the replica: gateway/fleet/outlier.py)."""
    return 400 if _CLIENT_FAULT.search(message) else 500


class SseStream:
    """The rest of one ``generate_stream`` answer, response by response; ``close`` hands the connection back (or
    drops it, when the answer was not read to its end: Triton then cancels the request)."""

    def __init__(self, response: http1.Response, replica_id: str) -> None:
        self._response, self._replica_id = response, replica_id
        self._chunks: AsyncIterator[bytes] = response.chunks()
        # Appended to in place: joined anew for each read (bytes), an event sent in small pieces cost the event
        # loop time growing with the square of its length.
        self._buffer = bytearray()

    async def next(self) -> Piece | None:
        """The next model response, None at the answer's end; an engine error mid-answer is EngineRejected."""
        data = await self._event()
        if data is None:
            return None
        error = data.get("error")
        if error is not None:
            message = f"{self._replica_id} failed mid-answer: {error}"
            raise EngineRejected(error_status(str(error)), message)
        return _piece(data)

    async def first(self) -> tuple[Piece, str | None]:
        """The first model response, or the engine's error in its place (as the text, for the driver to read)."""
        data = await self._event()
        if data is None:
            raise StreamBroken(f"{self._replica_id} ended the stream without an answer")
        error = data.get("error")
        return ("", None, None) if error is not None else _piece(data), None if error is None else str(error)

    def close(self) -> None:
        self._response.release()

    async def _event(self) -> dict[str, Any] | None:
        searched = 0  # the buffer's bytes already searched for the event's end (no rescan per read)
        while (end := self._buffer.find(b"\n\n", searched)) < 0:
            if len(self._buffer) > EVENT_LIMIT:
                self.close()
                raise StreamBroken(f"{self._replica_id} sent an event over {EVENT_LIMIT} bytes")
            searched = max(0, len(self._buffer) - 1)
            try:
                chunk = await anext(self._chunks, None)
            except TimeoutError as exc:  # before OSError: TimeoutError is one
                raise EngineTimeout(f"{self._replica_id} did not finish the answer in time") from exc
            except OSError as exc:
                raise StreamBroken(f"{self._replica_id} broke off the stream: {exc}") from exc
            if chunk is None:
                self.close()  # read to its end: the connection goes back to the pool
                if self._buffer.strip():
                    raise StreamBroken(f"{self._replica_id} ended the stream inside an event")
                return None
            self._buffer += chunk
        event = bytes(self._buffer[:end])
        del self._buffer[: end + 2]
        return _decode(event, self._replica_id)


async def start(
    origin: http1.Origin, head: bytes, body: bytes, timeout_s: float, replica_id: str
) -> tuple[SseStream, Piece, str | None]:
    """Send the request and wait for its first model response: (stream, first response, the engine's error)."""
    try:
        response = await origin.request(head, body, timeout_s)
    except OSError as exc:  # TimeoutError and ConnectionWaitTimeout are ones
        raise http1.request_failure(exc, replica_id) from exc
    stream = SseStream(response, replica_id)
    if response.status == 200:
        try:
            first, error = await stream.first()
        except BaseException:
            stream.close()
            raise
        return stream, first, error
    try:
        text = (await response.read(_ERROR_BODY_LIMIT)).decode("utf-8", "replace")
    except OSError as exc:
        raise EngineUnavailable(f"{replica_id} broke off its error answer: {exc!r}") from exc
    finally:
        response.release()
    return stream, ("", None, None), _error_text(text, response.status)


def json_body(inputs: list[tuple[str, Any]]) -> bytes:
    """The request's inputs as the generate extension takes them: each input's value (a scalar or a flat list)
    under its name; Triton adds the batch dimension."""
    return orjson.dumps(dict(inputs))


def _decode(event: bytes, replica_id: str) -> dict[str, Any]:
    payload = event.removeprefix(b"data:")
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError:
        # Triton's JSON writer copies a text output's bytes as they are: a token that ends mid-character is not
        # UTF-8, which orjson refuses. Read it as gRPC's reader does (replacement characters), not as a broken stream.
        try:
            data = orjson.loads(payload.decode("utf-8", "replace"))
        except orjson.JSONDecodeError as exc:
            raise StreamBroken(f"{replica_id} sent an event that is not JSON: {event[:80]!r}") from exc
    if not isinstance(data, dict):
        raise StreamBroken(f"{replica_id} sent an event that is not an object: {event[:80]!r}")
    return data


def _piece(data: dict[str, Any]) -> Piece:
    text = _first(data.get("text_output"))
    return (
        text if isinstance(text, str) else "",
        _count(data.get("num_input_tokens")),
        _count(data.get("num_output_tokens")),
    )


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, list) and value else value


def _count(value: Any) -> int | None:
    """A token count: the model's INT32 output (as gRPC's reader takes it), so a number outside 0..2**31-1 is none
    (a total over 64 bits could not be written into the answer's usage)."""
    value = _first(value)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _INT32_MAX:
        return value
    return None


def _error_text(text: str, status: int) -> str:
    """Triton's ``{"error": "..."}``, plain or as one event; any other body (a proxy's page) as itself."""
    stripped = text.strip().removeprefix("data:").strip()
    try:
        data = orjson.loads(stripped)
    except orjson.JSONDecodeError:
        data = None
    if isinstance(data, dict) and isinstance(data.get("error"), str):
        return str(data["error"])
    return f"HTTP {status}: {stripped[:200]}" if stripped else f"HTTP {status}"
