"""The span when tracing is off (``_NoSpan``: enter and exit in C) behaves as ``contextlib.nullcontext`` did for the
request path: the block runs, every exception leaving it propagates (none is suppressed), it nests and is shared
by requests in flight at once."""

from __future__ import annotations

import asyncio

import pytest

from gateway.config import TelemetryConfig
from gateway.observe.metrics import GatewayMetrics
from gateway.observe.telemetry import _NO_SPAN, Telemetry


def test_the_block_runs_and_gives_no_span() -> None:
    ran = []
    with _NO_SPAN as span:
        ran.append(True)
    assert ran == [True] and not span


@pytest.mark.parametrize("exc", [ValueError("x"), KeyboardInterrupt(), asyncio.CancelledError(), GeneratorExit()])
def test_no_exception_is_suppressed(exc: BaseException) -> None:
    with pytest.raises(type(exc)), _NO_SPAN:
        raise exc


def test_it_nests() -> None:
    with _NO_SPAN, _NO_SPAN, pytest.raises(ValueError), _NO_SPAN:
        raise ValueError


async def test_requests_in_flight_share_it() -> None:
    telemetry = Telemetry(TelemetryConfig(), GatewayMetrics())
    assert telemetry.tracer is None
    order: list[str] = []

    async def request(name: str) -> None:
        with telemetry.span("admission"), telemetry.upstream_span("r0"):
            order.append(f"{name} in")
            await asyncio.sleep(0)
            order.append(f"{name} out")

    await asyncio.gather(request("a"), request("b"))
    assert sorted(order) == ["a in", "a out", "b in", "b out"]
    assert telemetry.span("route") is _NO_SPAN and telemetry.upstream_span("r0") is _NO_SPAN
