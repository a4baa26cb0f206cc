"""loadtests/bench_decision.py: its --shared pool (README says it gives the pool's slot signal another gateway's
requests on every replica, as a gateway sharing Redis hears them, with the bench's adapter in flight on a tenth of
them), its sample counts and what --causes classes."""

from __future__ import annotations

import time

from loadtests.bench_decision import ADAPTER, CAUSES, _samples, _timed_causes, build_pool


def test_the_shared_pool_has_heard_another_gateways_requests_on_every_replica() -> None:
    pool = build_pool(20, "predicted_ttft", shared=True)
    signal = pool.residency.signal
    assert pool.shared_load_view
    assert signal.load_elsewhere(pool.name) == {f"r{i}": 1 for i in range(20)}
    assert sorted(signal.flying_on(pool.name, ADAPTER)) == ["r0", "r10"]
    assert not build_pool(20, "predicted_ttft").shared_load_view


def test_first_sights_do_not_shrink_with_the_fleet() -> None:
    """The docstring: above 100 replicas the seen-before and explain counts shrink, the first sights do not (their
    share of table-doubling first sights would grow as they shrink)."""
    small, large = _samples(16, 100_000, 5_000, 20_000, False), _samples(1_000, 100_000, 5_000, 20_000, False)
    assert small.first_sight == large.first_sight == 5_000
    assert (small.calls, large.calls) == (20_000, 2_000)
    assert _samples(1_000, 100_000, 5_000, 20_000, True).calls == 20_000
    assert _samples(1_000, 300, 5_000, 20_000, False).first_sight == 300  # never more than the keys


def test_a_new_pools_per_key_tables_grow_together_at_about_log2_of_the_first_sights() -> None:
    """The docstring's reason first sights do not shrink: of n first sights on a new pool, those that grow the pool's
    per-key tables (a key's entry and its reservation) are about log2(n), the two at once."""
    pool = build_pool(16, "predicted_ttft")
    tables = (pool.keys, pool.reservations.active)
    grew: list[tuple[bool, ...]] = []
    for index in range(500):
        before = [dict.__sizeof__(table) for table in tables]
        pool.release(pool.place(f"tenant-{index}", ADAPTER))
        changed = tuple(dict.__sizeof__(table) != size for table, size in zip(tables, before, strict=True))
        if any(changed):
            grew.append(changed)
    assert 7 <= len(grew) <= 9  # log2(500) is 9.0
    assert all(all(changed) for changed in grew)


def test_causes_class_a_call_that_grew_a_table() -> None:
    """--causes: a call whose table grew is classed "tables" (maybe with a fault), any other not."""
    table: dict[str, object] = {}
    grown: list[int] = []

    def insert(key: str) -> None:
        size = dict.__sizeof__(table)
        table[key] = None
        if dict.__sizeof__(table) != size:
            grown.append(len(table) - 1)

    times, causes = _timed_causes(insert, [f"k{i}" for i in range(100)], time.perf_counter_ns, [table])
    assert len(times) == len(causes) == 100 and grown
    assert [i for i, cause in enumerate(causes) if cause.startswith("tables")] == grown
    assert set(causes) <= set(CAUSES)
