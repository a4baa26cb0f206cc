"""The fill's plan (gateway/fleet/fill.py): each replica gets the adapters of the keys homed there, pinned first,
then prewarm, then the busiest keys, then the config's order; once each; nothing with the fill off."""

from __future__ import annotations

from typing import Any

from gateway.config import GatewayConfig
from gateway.fleet.fill import fill_plan
from gateway.fleet.fleet import Fleet, InstalledHomes
from gateway.observe.traffic import PoolTraffic, Rate
from gateway.tenants.identity import hash_key

REPLICAS = [f"r{i}" for i in range(2)]


def config(**residency: Any) -> dict[str, Any]:
    def pool(name: str, base: str, port: int) -> dict[str, Any]:
        replicas = [{"id": r, "url": f"http://127.0.0.1:{port + i}"} for i, r in enumerate(REPLICAS)]
        return {"name": name, "backend": "vllm", "base_model": base, "replicas": replicas}

    adapters = [f"a{i}" for i in range(6)]
    return {
        "residency": residency,
        "pools": [pool("llama", "tiny-llama", 1), pool("mistral", "tiny-mistral", 11)],
        "adapters": [
            *({"name": a, "pool": "llama", "source": f"/srv/{a}"} for a in adapters),
            {"name": "hot", "pool": "llama", "source": "/srv/hot", "prewarm": True},
            {"name": "pin", "pool": "llama", "source": "/srv/pin", "pinned": True},
            {"name": "v2", "pool": "llama", "source": "/srv/v2"},
            {"name": "sql", "pool": "mistral", "source": "/srv/sql"},
        ],
        "splits": [{"name": "ab", "variants": [{"model": "a0", "weight": 1}, {"model": "v2", "weight": 1}]}],
        "tenants": [
            *({"id": f"t{i}", "api_keys": [hash_key(f"t{i}")], "adapters": [a]} for i, a in enumerate(adapters)),
            {"id": "t-hot", "api_keys": [hash_key("hot")], "adapters": ["hot", "a1"]},
            {"id": "t-pin", "api_keys": [hash_key("pin")], "adapters": ["pin"]},
            {"id": "t-ab", "api_keys": [hash_key("ab")], "adapters": ["ab"]},
            {"id": "t-sql", "api_keys": [hash_key("sql")], "adapters": ["sql"], "base_models": ["tiny-llama"]},
        ],
    }


def expected(fleet: Fleet, traffic: dict[str, float] | None = None) -> dict[str, list[str]]:
    """The plan by hand: (tier, -traffic, config position) over each tenant's adapters at its home, once each."""
    pool, order = fleet.pools["llama"], []
    tiers = {"pin": 0, "hot": 1}
    entries = [(f"t{i}", f"a{i}") for i in range(6)]
    entries += [("t-hot", "hot"), ("t-hot", "a1"), ("t-pin", "pin"), ("t-ab", "a0"), ("t-ab", "v2")]
    for position, (tenant, adapter) in enumerate(entries):
        rank = (tiers.get(adapter, 2), -(traffic or {}).get(tenant, 0.0), position)
        order.append((rank, pool.ring.home(tenant), adapter))
    plan: dict[str, list[str]] = {r: [] for r in REPLICAS}
    for _, replica, adapter in sorted(order):
        if adapter not in plan[replica]:
            plan[replica].append(adapter)
    return plan


def names(plan: dict[str, Any]) -> dict[str, list[str]]:
    return {replica: [ref.engine_name for ref in refs] for replica, refs in plan.items()}


async def test_each_replica_is_planned_the_adapters_of_its_homed_keys_most_important_first() -> None:
    fleet = Fleet(GatewayConfig.model_validate(config()))
    try:
        llama = fleet.pools["llama"]
        plan = names(llama.fill)
        assert plan == expected(fleet)
        # Every adapter a llama tenant runs on is planned (a split's variants too), at its tenant's home.
        assert {a for refs in plan.values() for a in refs} == {*(f"a{i}" for i in range(6)), "hot", "pin", "v2"}
        assert plan[llama.ring.home("t-pin")][0] == "pin"
        assert "v2" in plan[llama.ring.home("t-ab")]
        assert names(fleet.pools["mistral"].fill) == {r: ["sql"] if r == fleet.pools["mistral"].ring.home("t-sql")
                                                      else [] for r in REPLICAS}  # fmt: skip
        # What the timer keeps while no slot is wanted is that plan.
        assert llama.residency.plan == {r: frozenset(refs) for r, refs in plan.items()}
    finally:
        await fleet.close()


async def test_busier_keys_come_first_within_a_tier() -> None:
    fleet = Fleet(GatewayConfig.model_validate(config()))
    try:
        llama = fleet.pools["llama"]
        traffic = {"t5": 9.0, "t4": 3.0}
        plan = names(fill_plan(fleet.config, llama, traffic))
        assert plan == expected(fleet, traffic)
        home = llama.ring.home("t5")
        first = [a for a in plan[home] if a in ("pin", "hot")]  # the pinned and prewarm tiers come before it
        assert plan[home][len(first)] == "a5"
    finally:
        await fleet.close()


async def test_with_the_fill_off_nothing_is_planned() -> None:
    fleet = Fleet(GatewayConfig.model_validate(config(fill_free_slots=False)))
    try:
        assert all(not refs for pool in fleet.pools.values() for refs in pool.fill.values())
        assert all(not planned for planned in fleet.pools["llama"].residency.plan.values())
    finally:
        await fleet.close()


async def test_the_fleets_measured_traffic_reorders_the_fill_and_its_absence_restores_the_configs_order() -> None:
    fleet = Fleet(GatewayConfig.model_validate(config()))
    try:
        llama = fleet.pools["llama"]
        fleet.order_fill_by({"llama": PoolTraffic(Rate(12, 0), {"t5": Rate(9, 0), "t4": Rate(3, 0)})})
        assert names(llama.fill) == expected(fleet, {"t5": 9.0, "t4": 3.0})
        assert names(llama.fill) != expected(fleet)  # t5's adapter moved up at its home
        fleet.order_fill_by({})
        assert names(llama.fill) == expected(fleet)
    finally:
        await fleet.close()


async def test_with_homes_from_traffic_the_configs_pins_place_the_fill_before_any_table() -> None:
    """A pinned key's adapter is filled at its pinned replica at start-up, not at its balanced home (where the first
    table's move would load it again and push a planned neighbour out), and an empty table (version 0: none
    published yet, or none readable) keeps the pins; balanced homes leave pins to the placer, as before."""
    raw = config()
    balanced = Fleet(GatewayConfig.model_validate(raw))
    try:
        home = balanced.pools["llama"].ring.home("t5")
        assert "a5" in names(balanced.pools["llama"].fill)[home]
    finally:
        await balanced.close()
    pinned_to = next(r for r in REPLICAS if r != home)
    raw["placement"] = {"pins": {"t5": pinned_to}}
    for placement, filled_at in (("balanced", home), ("traffic", pinned_to)):
        raw["routing"] = {"home_placement": placement}
        fleet = Fleet(GatewayConfig.model_validate(raw))
        try:
            llama = fleet.pools["llama"]
            for _ in range(2):
                plan = names(llama.fill)
                assert llama.ring.replica_set("t5") == (filled_at,)
                assert "a5" in plan[filled_at] and all("a5" not in plan[r] for r in REPLICAS if r != filled_at)
                assert llama.plan_bound is None  # nothing confined by homes no traffic chose
                fleet.install_homes(InstalledHomes())
        finally:
            await fleet.close()
