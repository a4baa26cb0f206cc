"""The request path's metric writers (metrics.adder, metrics.observer) record what prometheus_client's own inc and
observe record: they call into the client's private parts, so a client whose parts change fails here."""

from __future__ import annotations

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
