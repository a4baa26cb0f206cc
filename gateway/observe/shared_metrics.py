"""Under ``serve --workers``: each worker's metric values kept in the process and written to prometheus-client's
multiprocess files at intervals and before every scrape, rather than at every increment.

prometheus-client's multiprocess mode (gateway/workers.py) writes each counter increment and histogram
observation to the worker's memory-mapped file at once, under a lock and after a check of the process id: about
1.5 us per increment against 0.06 us for an in-process float (timeit), and about 40 us of CPU per request over
both workers at ``make bench-overhead``'s realistic load (interleaved runs of the two, docs/benchmarks.md). Here
an increment adds to the value in the process only, and ``flush`` writes every value that changed since the last
flush to the same file, in the same format: every ``FLUSH_S`` (a timer of the worker's), when the worker stops
(its app's cleanup, and at exit), and whenever any worker answers ``/metrics`` (the answering worker asks each
living sibling to flush first: gateway/admin/siblings.py), so a scrape sums every living worker's counts up to
that moment. What the files give stays as it was: counters and histograms summed across workers (those of a
worker that died included, so counters never go back), gauges per worker (a ``pid`` label).

The one thing given up: a worker killed outright (SIGKILL, the kernel's OOM killer) takes the increments of its last
``FLUSH_S`` with it (SIGTERM, a drain and an exception flush). Why not the other way the issue allowed (workers
keep in-process registries and the answering worker merges their expositions): a dead worker's counts would
vanish from the sum, so counters would go back, unless each worker also kept its counts somewhere that outlives
it; that is what these files are, and prometheus-client already merges them.

Increments and flushes happen on the event loop's thread only (requests, timers and the scrape run there), as for
the in-process values added to without their lock (gateway/observe/metrics.py's ``adder``).
"""

from __future__ import annotations

import atexit
import os
from typing import Any

from prometheus_client import values

FLUSH_S = 0.5
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # set by the supervisor (gateway/workers.py) for its workers

_buffered: list[Any] = []  # every value made since install(), in creation order


def shared() -> bool:
    """Whether this process is a worker whose metrics are shared through multiprocess files."""
    return bool(os.environ.get(MULTIPROC_ENV))


def _buffered_class() -> type:
    base = values.MultiProcessValue()  # type: ignore[no-untyped-call]  # untyped in prometheus_client

    class BufferedValue(base):  # type: ignore[valid-type,misc]  # a class prometheus-client makes at run time
        """prometheus-client's multiprocess value, added to in the process; ``flush`` writes it to the file."""

        buffered = True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)  # opens (or reopens) this process's file and reads the value there
            self._written: tuple[float, float] = (self._value, self._timestamp)  # what the file holds
            _buffered.append(self)

        def inc(self, amount: float) -> None:
            self._value += amount

        def set(self, value: float, timestamp: float | None = None) -> None:
            self._value = value
            self._timestamp = timestamp or 0.0

        def get(self) -> float:
            value: float = self._value
            return value

    return BufferedValue


_installed: type | None = None


def install() -> None:
    """Make every metric value created from now on a buffered one (before the first metric is made); once."""
    global _installed
    if _installed is None:
        _installed = values.ValueClass = _buffered_class()
        atexit.register(flush)


def is_buffered(value: object) -> bool:
    return getattr(value, "buffered", False) is True


def flush() -> None:
    """Write every value that changed since the last flush to this process's multiprocess files."""
    for value in _buffered:
        current = (value._value, value._timestamp)
        if current != value._written:
            value._file.write_value(value._key, *current)
            value._written = current


async def flush_now() -> None:
    """``flush`` as the worker's timer's work, and its close."""
    flush()
