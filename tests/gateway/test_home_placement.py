"""Balanced homes in a running gateway: which keys each pool balances, pre-warm on the balanced home, and a tenant
added at run time placed like the rest (gateway/routing/ring.py has the placement's own properties)."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import httpx
import pytest
from aiohttp.test_utils import TestServer

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.fleet import Fleet, homed_keys
from gateway.routing.ring import Ring
from gateway.tenancy import hash_key
from loadtests.fleet import ADMIN_TOKEN

REPLICAS = [f"r{i}" for i in range(4)]
TENANTS = [f"tenant-{i:02d}" for i in range(32)]  # the ring alone homes them 9 + 9 + 9 + 5 on four replicas
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def config(**routing: Any) -> dict[str, Any]:
    def pool(name: str, base: str, port: int) -> dict[str, Any]:
        replicas = [{"id": r, "url": f"http://127.0.0.1:{port + i}"} for i, r in enumerate(REPLICAS)]
        return {"name": name, "backend": "vllm", "base_model": base, "replicas": replicas}

    return {
        "routing": routing,
        "pools": [pool("llama", "tiny-llama", 1), pool("mistral", "tiny-mistral", 11)],
        "adapters": [
            {"name": "support", "pool": "llama", "source": "/srv/support", "prewarm": True},
            {"name": "support@2", "pool": "llama", "source": "/srv/support-2"},
            {"name": "sql", "pool": "mistral", "source": "/srv/sql"},
        ],
        "splits": [
            {"name": "support-ab", "variants": [{"model": "support", "weight": 1}, {"model": "support@2", "weight": 1}]}
        ],
        "tenants": [{"id": t, "api_keys": [hash_key(t)], "adapters": ["support"]} for t in TENANTS]
        + [
            {"id": "ab-only", "api_keys": [hash_key("ab")], "adapters": ["support-ab"]},
            {"id": "base-only", "api_keys": [hash_key("base")], "base_models": ["tiny-llama"]},
            {"id": "sql-only", "api_keys": [hash_key("sql")], "adapters": ["sql"]},
        ],
    }


def test_a_pool_balances_the_tenants_that_reach_it_by_adapter_split_or_base_model() -> None:
    parsed = GatewayConfig.model_validate(config())
    assert homed_keys(parsed, "llama") == {*TENANTS, "ab-only", "base-only"}
    assert homed_keys(parsed, "mistral") == {"sql-only"}


def test_under_adapter_affinity_a_pool_balances_the_models_requests_run_on() -> None:
    parsed = GatewayConfig.model_validate(config(affinity="adapter"))
    assert homed_keys(parsed, "llama") == {"support", "support@2", "tiny-llama"}  # a split's variants, not its name
    assert homed_keys(parsed, "mistral") == {"sql"}


@pytest.mark.parametrize("placement", ["balanced", "ring"])
async def test_homes_and_prewarm_follow_the_placement(placement: str) -> None:
    fleet = Fleet(GatewayConfig.model_validate(config(home_placement=placement)))
    try:
        pool = fleet.pools["llama"]
        homes = {key: pool.ring.home(key) for key in homed_keys(fleet.config, "llama")}
        most = max(Counter(homes.values()).values())
        if placement == "balanced":
            assert most <= math.ceil(len(homes) / len(REPLICAS))
        else:
            assert all(home == pool.ring.ring_home(key) for key, home in homes.items())
            assert most > math.ceil(len(homes) / len(REPLICAS))
        # The pre-warmed adapter goes where its tenants' traffic starts: their (balanced) homes.
        prewarmed = {replica for replica, adapters in pool.prewarm.items() if adapters}
        assert prewarmed == {homes[t] for t in TENANTS}
    finally:
        await fleet.close()


async def test_a_tenant_added_at_run_time_gets_the_home_any_gateway_would_give_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    known = [*TENANTS, "ab-only", "base-only"]
    newcomer = next(name for name in (f"newcomer-{i}" for i in range(100)) if _moved_by_balance([*known, name], name))
    monkeypatch.setenv("TENANTGATE_ADMIN_TOKEN", ADMIN_TOKEN)
    app = create_app(GatewayConfig.model_validate({**config(), "admin": {"token_env": "TENANTGATE_ADMIN_TOKEN"}}))
    async with (
        TestServer(app, host="127.0.0.1") as server,
        httpx.AsyncClient(base_url=str(server.make_url(""))) as http,
    ):
        added = {"id": newcomer, "api_keys": [hash_key("new")], "adapters": ["support"]}
        assert (await http.post("/admin/tenants", json=added, headers=ADMIN)).status_code == 200
        homes = {}
        for tenant in [*known, newcomer]:
            answer = await http.get("/admin/route", params={"tenant": tenant}, headers=ADMIN)
            homes[tenant] = answer.json()["home"]
    # What a gateway started with the tenant already in its config computes: the same homes for everyone.
    fresh = Ring(REPLICAS, vnodes=160)
    fresh.balance(homes)
    assert homes == {tenant: fresh.home(tenant) for tenant in homes}
    assert max(Counter(homes.values()).values()) <= math.ceil(len(homes) / len(REPLICAS))


def _moved_by_balance(keys: list[str], key: str) -> bool:
    """Whether balancing ``keys`` homes ``key`` off its ring home (so a gateway that skipped it would differ)."""
    ring = Ring(REPLICAS, vnodes=160)
    ring.balance(keys)
    return ring.home(key) != ring.ring_home(key)
