"""The load generator's own garbage collector, held off while requests are timed: a client's pauses are not the
router's.

A benchmark client is a Python process too. Its cyclic garbage collector stops everything it does, every stream it
reads included, for as long as a collection takes, and each request in flight at that moment reads the pause as the
router's latency. Measured: no_empty_slot's second run in one process, a full collection of 108 ms inside its timed
traffic (TTFT p99 4.7x the p50 instead of 1.6-2.0x); bench_routing's hot trace, full collections of 60 and 19 ms (seed
17) and 165 and 57 ms (seed 18) inside vllm-router sticky_least_loaded's 30 s replays, one of 8 ms inside
tenantgate predicted_ttft's (gc.callbacks around ``replay``). A
timed run's garbage stays until the block ends and is collected at the next block's start: no_empty_slot's runs
last seconds, bench_routing's a trace's ``--seconds`` (30 by default; a longer trace holds more memory meanwhile),
locust's (loadtests/locustfile.py) its test, from start to stop (``LOADTEST_SECONDS``).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_held() -> Iterator[None]:
    """This process's cyclic garbage collector run once, then held off until the block ends (left as it was found:
    off stays off)."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
