"""loadtests/bench_decision.py's --shared pool: README says it gives the pool's slot signal another gateway's requests
on every replica, as a gateway sharing Redis hears them, with the bench's adapter in flight on a tenth of them."""

from __future__ import annotations

from loadtests.bench_decision import ADAPTER, build_pool


def test_the_shared_pool_has_heard_another_gateways_requests_on_every_replica() -> None:
    pool = build_pool(20, "predicted_ttft", shared=True)
    signal = pool.residency.signal
    assert pool.shared_load_view
    assert signal.load_elsewhere(pool.name) == {f"r{i}": 1 for i in range(20)}
    assert sorted(signal.flying_on(pool.name, ADAPTER)) == ["r0", "r10"]
    assert not build_pool(20, "predicted_ttft").shared_load_view
