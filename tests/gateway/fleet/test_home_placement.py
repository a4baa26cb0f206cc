"""Balanced homes in a running gateway: which keys each pool balances, pre-warm on the balanced home, and a tenant
added at run time, which takes its ring home and moves no one (gateway/routing/ring.py has the placement's own
properties)."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import httpx
import pytest
from aiohttp.test_utils import TestServer

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.fleet.fleet import Fleet, homed_keys, prewarm_homes
from gateway.routing.ring import Ring
from gateway.tenants.identity import hash_key
from loadtests.fleet import ADMIN_TOKEN

REPLICAS = [f"r{i}" for i in range(4)]
TENANTS = [f"tenant-{i:02d}" for i in range(32)]  # the ring alone homes them 9 + 9 + 9 + 5 on four replicas
MOVED = "tenant-04"  # one that balancing homes off its ring home (asserted below)
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
            {"name": "solo", "pool": "llama", "source": "/srv/solo", "pinned": True},
        ],
        "splits": [
            {"name": "support-ab", "variants": [{"model": "support", "weight": 1}, {"model": "support@2", "weight": 1}]}
        ],
        "tenants": [
            {"id": t, "api_keys": [hash_key(t)], "adapters": ["support", "solo"] if t == MOVED else ["support"]}
            for t in TENANTS
        ]
        + [
            {"id": "ab-only", "api_keys": [hash_key("ab")], "adapters": ["support-ab"]},
            {"id": "base-only", "api_keys": [hash_key("base")], "base_models": ["tiny-llama"]},
            {"id": "sql-only", "api_keys": [hash_key("sql")], "adapters": ["sql"]},
        ],
    }


def test_a_pool_balances_the_tenants_that_reach_it_by_adapter_split_or_base_model() -> None:
    parsed = GatewayConfig.model_validate(config())
    assert homed_keys(parsed) == {"llama": {*TENANTS, "ab-only", "base-only"}, "mistral": {"sql-only"}}


def test_under_adapter_affinity_a_pool_balances_the_models_requests_run_on() -> None:
    parsed = GatewayConfig.model_validate(config(affinity="adapter"))
    llama = {"support", "support@2", "solo", "tiny-llama"}  # a split's variants, not its name
    assert homed_keys(parsed) == {"llama": llama, "mistral": {"sql"}}


@pytest.mark.parametrize("placement", ["balanced", "ring", "traffic"])
async def test_homes_and_prewarm_follow_the_placement(placement: str) -> None:
    """Homes from traffic start from balanced homes, as the config says (the plan moves keys from there): started
    from the ring's, a replica held 6 of 16 tenants for 4 adapter slots on the collide trace (docs/benchmarks.md)."""
    fleet = Fleet(GatewayConfig.model_validate(config(home_placement=placement)))
    try:
        pool = fleet.pools["llama"]
        homes = {key: pool.ring.home(key) for key in homed_keys(fleet.config)["llama"]}
        most = max(Counter(homes.values()).values())
        balanced = placement != "ring"
        if balanced:
            assert most <= math.ceil(len(homes) / len(REPLICAS))
        else:
            assert all(home == pool.ring.ring_home(key) for key, home in homes.items())
            assert most > math.ceil(len(homes) / len(REPLICAS))
        # A pre-warmed (here pinned) adapter goes where its tenant's traffic starts: its home as placed.
        solo = {
            replica for replica, adapters in pool.prewarm.items() if any(a.engine_name == "solo" for a, _ in adapters)
        }
        assert solo == {homes[MOVED]}
        assert (homes[MOVED] != pool.ring.ring_home(MOVED)) == balanced
    finally:
        await fleet.close()


@pytest.mark.parametrize("affinity", ["tenant", "adapter"])
async def test_a_version_is_prewarmed_where_the_traffic_that_runs_on_it_starts(affinity: str) -> None:
    """A split's variant (an A/B arm, or a version a rollout is about to add) is warmed at the homes of the tenants
    calling the split, or, under adapter affinity, at the variant's own home: requests are keyed by what they run
    on, never by the split's name."""
    fleet = Fleet(GatewayConfig.model_validate(config(affinity=affinity)))
    try:
        pool, parsed = fleet.pools["llama"], fleet.config
        if affinity == "tenant":
            expected = {"support@2": {pool.ring.home("ab-only")}, "support@3": {pool.ring.home("ab-only")}}
        else:
            expected = {"support@2": {pool.ring.home("support@2")}, "support@3": {pool.ring.home("support@3")}}
        assert prewarm_homes(parsed, pool, "support@2") == expected["support@2"]
        assert prewarm_homes(parsed, pool, "support@3", split="support-ab") == expected["support@3"]
    finally:
        await fleet.close()


async def test_a_tenant_added_at_run_time_takes_its_ring_home_and_moves_no_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run-time tenants are not balanced: which of them a gateway knows depends on when it started, and gateways
    sharing a registry must agree on every home. So the homes of the file's tenants stay as they were."""
    known = [*TENANTS, "ab-only", "base-only"]
    newcomer = next(name for name in (f"newcomer-{i}" for i in range(100)) if _moved_by_balance([*known, name], name))
    monkeypatch.setenv("TENANTGATE_ADMIN_TOKEN", ADMIN_TOKEN)
    app = create_app(GatewayConfig.model_validate({**config(), "admin": {"token_env": "TENANTGATE_ADMIN_TOKEN"}}))
    async with (
        TestServer(app, host="127.0.0.1") as server,
        httpx.AsyncClient(base_url=str(server.make_url(""))) as http,
    ):

        async def homes() -> dict[str, str]:
            routes = [await http.get("/admin/route", params={"tenant": t}, headers=ADMIN) for t in known]
            return {tenant: route.json()["home"] for tenant, route in zip(known, routes, strict=True)}

        before = await homes()
        added = {"id": newcomer, "api_keys": [hash_key("new")], "adapters": ["support"]}
        assert (await http.post("/admin/tenants", json=added, headers=ADMIN)).status_code == 200
        assert await homes() == before
        route = (await http.get("/admin/route", params={"tenant": newcomer}, headers=ADMIN)).json()
        assert route["home"] == route["ring_home"] == Ring(REPLICAS, vnodes=160).ring_home(newcomer)
        moved = (await http.get("/admin/route", params={"tenant": MOVED}, headers=ADMIN)).json()
        assert moved["home"] != moved["ring_home"]  # the operator sees that balancing placed it


def _moved_by_balance(keys: list[str], key: str) -> bool:
    """Whether balancing ``keys`` homes ``key`` off its ring home (so a gateway that balanced it would differ)."""
    ring = Ring(REPLICAS, vnodes=160)
    ring.balance(keys)
    return ring.home(key) != ring.ring_home(key)
