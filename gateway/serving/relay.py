"""Relay an engine's answer to the client: whole, or chunk by chunk as the engine streams. I/O only: what a
failure means is dispatch's to decide (gateway/failures.py); once the first byte of a stream has gone to the
client, a failure can only end the stream with the OpenAI error event dispatch hands back."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from backends.base import EngineResponse
from backends.errors import BackendError
from gateway.errors import GatewayError
from gateway.observe.metrics import GatewayMetrics
from gateway.observe.telemetry import RequestRecord, Telemetry
from gateway.serving.context import RequestContext
from gateway.serving.incoming import Incoming
from gateway.serving.sse_events import StreamEvents
from gateway.serving.whole_answer import VARIANT_HEADER

_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
# An OpenAI stream's last event.
_LAST_EVENT = b"data: [DONE]\n\n"
_FAULT = GatewayError("The gateway failed to handle the request.")
log = logging.getLogger(__name__)
# How long past the request's deadline a stream may wait for a client that does not take its events.
STALLED_WRITE_GRACE_S = 1.0


def _cut_off(transport: asyncio.Transport, metrics: GatewayMetrics) -> None:
    """Close a stream's connection whose client stopped taking its events, counted as the connection caps' closes
    are (an operator sees clients that stall their streams)."""
    metrics.client_connections_closed.labels("stalled_write").inc()
    transport.abort()


async def respond(
    request: Incoming,
    telemetry: Telemetry,
    ctx: RequestContext,
    record: RequestRecord,
    upstream: EngineResponse,
    answer: bytes,
) -> int:
    """The engine's whole (non-streaming) answer, read by the caller, written to the client now: before the lease's
    release, the outcome's report, the admission's settlement and the request's telemetry, which the client need
    not wait for (aiohttp would write the response only once the handler had returned)."""
    telemetry.first_byte(record)
    record.read_usage(answer)
    status = upstream.status
    if await request.answer(status, answer, ctx.variant or None):  # else the client left: the answer still counts
        record.answered = status
    return status


async def stream(
    request: Incoming,
    telemetry: Telemetry,
    ctx: RequestContext,
    record: RequestRecord,
    upstream: EngineResponse,
    broken: Callable[[BackendError], GatewayError],
) -> int:
    """Stream the engine's SSE events to the client as they come (whole: gateway/serving/sse_events.py, which
    also leaves out the usage event the gateway asked for and the client did not). If the engine's stream breaks,
    ``broken`` says what it means and the stream ends with that error's event."""
    headers = {**_SSE_HEADERS, VARIANT_HEADER: ctx.variant} if ctx.variant else _SSE_HEADERS
    status = upstream.status
    response = await request.stream(status, headers)
    # A write waits for the client to take what came before (the engine's answer is not buffered without bound),
    # and the engine's deadline is kept only while its answer is read: a client that stops reading is cut off
    # STALLED_WRITE_GRACE_S past the request's deadline, which gives back its lease and its place in flight.
    transport = request.transport
    cut_off = (
        asyncio.get_running_loop().call_at(ctx.deadline + STALLED_WRITE_GRACE_S, _cut_off, transport, telemetry.metrics)
        if transport is not None
        else None
    )
    events = StreamEvents(ctx.strip_usage)
    try:  # one frame for the stream's chunks to resume through: the loop inline, not a coroutine of its own
        try:
            async for chunk in upstream.chunks():
                complete, onward = events.feed(chunk)
                if complete:
                    record.read_usage(complete)
                    record.events += complete.count(b"\n\n")
                if onward:
                    if record.first_byte is None:
                        telemetry.first_byte(record)
                    await response.write(onward)
                    if onward.endswith(_LAST_EVENT):
                        # The client has everything: one that leaves now (the OpenAI SDK closes on [DONE]) while
                        # the engine ends its body was answered, not a 499.
                        record.answered = status
            rest = events.rest()
            if rest:
                await response.write(rest)
        except BackendError as exc:  # an unfinished event is dropped: the client gets whole events, then the error
            await response.write(broken(exc).sse_event())
        except ConnectionResetError:  # the client left: nothing to tell it (ingress counts a 499)
            raise
        except Exception as exc:  # a fault of the gateway's own past the first byte: the stream's end, never a
            # second response (the middleware's answer would be written into this one's body)
            log.exception("stream failed after it started")
            record.error = type(exc).__name__
            await response.write(_FAULT.sse_event())
        record.answered = status
        await response.write_eof()
    finally:
        if cut_off is not None:
            cut_off.cancel()
    return status
