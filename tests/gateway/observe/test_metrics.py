"""The request path's metric writers (metrics.adder, metrics.observer) record what prometheus_client's own inc and
observe record: they call into the client's private parts, so a client whose parts change fails here."""

from __future__ import annotations

import threading

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from gateway.observe.metrics import adder, observer

BUCKETS = (0.005, 0.01, 0.5, 60.0)
# Below, on and above each bound, and past the last (the +Inf bucket).
AMOUNTS = [0.0, 0.001, 0.005, 0.0050001, 0.01, 0.2, 0.5, 59.0, 60.0, 61.0, 1e9]


def _pair() -> tuple[CollectorRegistry, CollectorRegistry]:
    return CollectorRegistry(), CollectorRegistry()


def _samples(registry: CollectorRegistry) -> list[bytes]:
    """The exposition's lines but the ``_created`` ones (when each metric was made: not what was recorded)."""
    return [line for line in generate_latest(registry).splitlines() if b"_created" not in line]


def test_observer_fills_the_buckets_observe_fills() -> None:
    ours, theirs = _pair()
    by_us = Histogram("h", "h", ["tenant"], buckets=BUCKETS, registry=ours).labels("acme")
    by_them = Histogram("h", "h", ["tenant"], buckets=BUCKETS, registry=theirs).labels("acme")
    observe = observer(by_us)
    for amount in AMOUNTS:
        observe(amount)
        by_them.observe(amount)
    assert _samples(ours) == _samples(theirs)
    assert b'h_bucket{le="0.005",tenant="acme"} 3.0' in _samples(ours)  # 0, 0.001 and 0.005 itself


@pytest.mark.parametrize("amounts", [[1], [1, 2.5, 0], [6, 4]], ids=["one", "several", "tokens"])
def test_adder_counts_as_inc(amounts: list[float]) -> None:
    ours, theirs = _pair()
    by_us = Counter("c", "c", ["tenant", "status"], registry=ours).labels("acme", 200)
    by_them = Counter("c", "c", ["tenant", "status"], registry=theirs).labels("acme", 200)
    add = adder(by_us)
    for amount in amounts:
        add(amount)
        by_them.inc(amount)
    assert _samples(ours) == _samples(theirs)
    assert f'c_total{{status="200",tenant="acme"}} {float(sum(amounts))}'.encode() in _samples(ours)


class _Refused:
    """A lock that cannot be taken: a writer that takes it raises."""

    def __enter__(self) -> None:
        raise AssertionError("the value's lock was taken")

    def __exit__(self, *exc_info: object) -> None:
        return None


def test_the_writers_add_to_an_in_process_value_without_its_lock() -> None:
    """The request path's writes (on the event loop's thread, as the scrape that reads them) skip the value's lock,
    most of an inc's cost; the counts are still inc's."""
    ours, theirs = _pair()
    counter = Counter("c", "c", ["tenant"], registry=ours).labels("acme")
    histogram = Histogram("h", "h", ["tenant"], buckets=BUCKETS, registry=ours).labels("acme")
    by_them = Counter("c", "c", ["tenant"], registry=theirs).labels("acme")
    by_them_h = Histogram("h", "h", ["tenant"], buckets=BUCKETS, registry=theirs).labels("acme")
    add, observe = adder(counter), observer(histogram)
    for value in (counter._value, histogram._sum, *histogram._buckets):
        value._lock = _Refused()  # MutexValue's own
    for amount in AMOUNTS:
        add(amount)
        observe(amount)
        by_them.inc(amount)
        by_them_h.observe(amount)
    for value in (counter._value, histogram._sum, *histogram._buckets):
        value._lock = threading.Lock()  # a real one again, for the exposition's reads
    assert _samples(ours) == _samples(theirs)
