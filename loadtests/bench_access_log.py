"""The access log's cost on the event loop: Telemetry.finish for one request, with the access log on and off,
called on a running event loop with the log's writer thread writing to /dev/null (gateway/observe/logs.py). The
difference is what one access line costs the loop (the issue's budget: 15 us).

    python -m loadtests.bench_access_log [--calls 50000]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import time

from gateway.config import TelemetryConfig
from gateway.observe import logs
from gateway.observe.metrics import GatewayMetrics
from gateway.observe.telemetry import RequestRecord, Telemetry


def _record() -> RequestRecord:
    record = RequestRecord("/v1/completions", tenant="t07", adapter="lora-t07", pool="llama", replica="r3")
    record.reasons, record.status, record.prompt_tokens, record.completion_tokens = ["home"], 200, 12, 4
    return record


async def _per_call_us(telemetry: Telemetry, calls: int) -> float:
    """Loop time per call, in batches of 64 while the writer thread writes the lines before them; between batches
    (not timed) the loop waits while more than 1,000 lines are queued, so none is dropped (a dropped line costs
    the loop less than a queued one)."""
    spent = 0.0
    for _ in range(calls // 64):
        records = [_record() for _ in range(64)]
        started = time.perf_counter()
        for record in records:
            telemetry.finish(record)
        spent += time.perf_counter() - started
        while logs.queued_lines() > 1000:  # noqa: ASYNC110  # the writer is a thread: nothing to await
            await asyncio.sleep(0.001)
    return 1e6 * spent / (64 * (calls // 64))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    with open("/dev/null", "w") as null:
        logs.configure(stream=null)
        figures: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.rounds):
            for access_log in (False, True):
                telemetry = Telemetry(TelemetryConfig(access_log=access_log), GatewayMetrics())
                figures[access_log].append(asyncio.run(_per_call_us(telemetry, args.calls)))
        logs.shutdown()
    off, on = statistics.median(figures[False]), statistics.median(figures[True])
    print(f"Telemetry.finish on the loop: access log off {off:.1f} us, on {on:.1f} us per request")
    print(f"the access line's share: {on - off:.1f} us (median of {args.rounds} rounds of {args.calls} calls)")
    print(f"lines dropped: {logs.dropped_lines()}")
    logging.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
