"""The start-up warm-up of the decision path (gateway/fleet/warm_up.py): it decides on throw-away pools, in one
pass as a request's own decision does, and leaves nothing behind: no key, reservation, load or metric child in the
real pools and their metrics."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.base import Endpoint
from gateway.config import PoolConfig, ResidencyConfig, RoutingConfig
from gateway.fleet import warm_up
from gateway.fleet.pool import Pool
from gateway.observe.metrics import GatewayMetrics
from gateway.residency.lifecycle import PoolResidency
from gateway.residency.memory import MemoryStore
from tests.gateway.residency.fakes import FakeDriver, FakeEngine


def real_pool(name: str, policy: str, metrics: GatewayMetrics) -> Pool:
    entries = [{"id": f"r{i}", "url": f"http://127.0.0.1:{i + 1}"} for i in range(4)]
    config = PoolConfig.model_validate(
        {"name": name, "backend": "vllm", "base_model": "tiny-llama", "replicas": entries, "policy": policy}
    )
    endpoints = [Endpoint(entry["id"], entry["url"]) for entry in entries]
    driver = FakeDriver(FakeEngine())
    residency = PoolResidency(
        name, endpoints, driver, MemoryStore(), ResidencyConfig(), max_adapters=2, load_timeout_s=5, shared=False,
        metrics=metrics,
    )  # fmt: skip
    return Pool(config, RoutingConfig(), driver, residency)


def children(metrics: GatewayMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every series of the registry and its value, but the process's own (its CPU time moves)."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in metrics.registry.collect()
        if not family.name.startswith(("process_", "python_gc_"))
        for sample in family.samples
    }


def test_the_warm_up_leaves_no_key_reservation_load_or_metric_child_behind() -> None:
    metrics = GatewayMetrics()
    pools = [real_pool("llama", "predicted_ttft", metrics), real_pool("mistral", "bounded_consistent_hash", metrics)]
    before = children(metrics)
    assert warm_up.decisions(pools, RoutingConfig()) == 2 * warm_up.DECISIONS
    assert children(metrics) == before
    for pool in pools:
        assert not pool.keys and not pool.reservations.active and not any(pool.reservations.by_replica.values())
        assert pool.in_flight == 0 and all(replica.in_flight == 0 for replica in pool.replicas.values())
        assert all(not view.resident for view in pool.residency.views.values())


def test_a_policy_shared_by_pools_is_warmed_once() -> None:
    metrics = GatewayMetrics()
    pools = [real_pool(name, "predicted_ttft", metrics) for name in ("a", "b")]
    assert warm_up.decisions(pools, RoutingConfig()) == warm_up.DECISIONS


@pytest.mark.parametrize("policy", ["bounded_consistent_hash", "predicted_ttft"])
def test_the_throwaway_pool_decides_in_one_pass_as_a_request_does(policy: str) -> None:
    """Else it would warm the general pipeline, not the path a request's decision takes."""
    twin = warm_up.throwaway(real_pool("llama", policy, GatewayMetrics()), RoutingConfig())
    first = twin.place("acme", "warm-up-adapter")
    again = twin.place("acme", "warm-up-adapter")
    assert first.chosen is not None and first.kept == () and again.kept == ()


def test_the_gateway_and_the_decision_bench_warm_up_at_start() -> None:
    """gateway/server.py warms before its listener opens; make bench-decision does as the gateway does."""
    root = Path(__file__).resolve().parents[3]
    for source in ("gateway/server.py", "loadtests/bench_decision.py"):
        assert "warm_up.decisions(" in (root / source).read_text(), source
