"""The load generator's own garbage collector, held off while requests are timed: a client's pauses are not the
router's.

A benchmark client is a Python process too. Its cyclic garbage collector stops everything it does, every stream it
reads included, for as long as a collection takes, and each request in flight at that moment reads the pause as the
router's latency. Measured: no_empty_slot's second run in one process, a full collection of 108 ms inside its timed
traffic (TTFT p99 4.7x the p50 instead of 1.6-2.0x); bench_routing's hot trace, full collections of 57 and 165 ms
inside a peer's 30 s replay and 8-19 ms inside tenantgate's (gc.callbacks around ``replay``, seeds 17 and 18). A
timed run lasts seconds to a minute; what it leaves is collected at the next block's start.
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
