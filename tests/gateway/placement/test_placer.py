"""Homes from traffic, run (gateway/placement/placer.py): the leader's lease and the versioned table in a real
redis-server, make before break on simulated replicas.

- two gateways started apart (two placers, each with its own fleet, sharing one Redis) route every key by the same
  homes after one interval of the second, and the second never leads while the first holds the lease; when the
  first stops renewing, the second takes over and keeps the table;
- a moving key's requests keep going to its old home until its adapter is resident at the new one, unless the
  old home is down or no longer holds the adapter (then at once);
- the freeze and the pins (config and admin store) hold the plan."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio

from gateway.admin.placement import key_placement
from gateway.config import GatewayConfig
from gateway.fleet.fleet import Fleet
from gateway.observe.traffic import PoolTraffic, Rate, Traffic
from gateway.placement.placer import Placer
from gateway.placement.store import LocalHomesStore, RedisHomesStore
from gateway.placement.table import HomesTable, PoolTable
from gateway.placement.table import decode as decode_table
from gateway.placement.table import encode as encode_table
from gateway.redis_client import make_client
from loadtests.fleet import gateway_config, simulated_replicas, write_adapters
from loadtests.processes import free_port
from tests.clock import Clock
from tests.redis_server import RedisServer

pytestmark = pytest.mark.timeout(120)

TENANTS = {f"t{i}": [f"a{i}"] for i in range(8)}
REPLICAS = {f"r{i}": f"http://127.0.0.1:{9 + i}" for i in range(4)}  # never contacted: the fleet is not started


def config(urls: dict[str, str], adapters: dict[str, str], **placement: Any) -> GatewayConfig:
    extra = {"placement": {"max_moves": 4, "shrink_after_s": 0, **placement}}
    raw = gateway_config(urls, TENANTS, adapters, port=free_port(), max_adapters=4, extra=extra)
    raw["routing"]["home_placement"] = "traffic"
    return GatewayConfig.model_validate(raw)


def colliding(fleet: Fleet) -> Traffic:
    """Heavy traffic for two tenants that count-balanced homes put on the same replica; light for the rest."""
    ring = fleet.pools["llama"].ring
    by_home: dict[str, list[str]] = {}
    for tenant in sorted(TENANTS):
        by_home.setdefault(ring.home(tenant), []).append(tenant)
    heavy = next(tenants for tenants in by_home.values() if len(tenants) >= 2)[:2]
    keys = {t: Rate(10.0 if t in heavy else 0.5, 0.0) for t in TENANTS}
    return {"llama": PoolTraffic(Rate(sum(r.requests_per_s for r in keys.values()), 0.0), keys)}


def homes(fleet: Fleet) -> dict[str, tuple[str, ...]]:
    ring = fleet.pools["llama"].ring
    return {tenant: ring.replica_set(tenant) for tenant in TENANTS}


@pytest.fixture
def adapters(tmp_path: Path) -> dict[str, str]:
    return write_adapters(tmp_path, [name for names in TENANTS.values() for name in names])


async def test_two_gateways_started_apart_agree_on_every_home_after_one_interval(
    redis_server: RedisServer, adapters: dict[str, str]
) -> None:
    prefix = f"test-{uuid.uuid4().hex}"
    settings = config(REPLICAS, adapters, grow_above=100.0, shrink_below=50.0)  # moves only: no replication

    def placer(name: str) -> Placer:
        client = make_client(redis_server.url, 2.0)
        store = RedisHomesStore(client, operation_timeout_s=2.0, lease_s=30.0, prefix=prefix)
        return Placer(store, name, clock=Clock(1000.0))

    fleet_a, fleet_b = Fleet(settings), Fleet(settings)
    a, b = placer("gw-a"), placer("gw-b")
    try:
        traffic = colliding(fleet_a)
        before = homes(fleet_a)
        await a.tick(settings, fleet_a, traffic)
        assert a.leads and a.table.version == 1 and a.table.moves > 0
        assert a.table.pools["llama"].warming  # the moves wait for their adapters: make before break
        planned = {k: v for k, v in a.table.pools["llama"].homes.items()}
        assert homes(fleet_a) == before  # routed by the old sets until warm
        await b.tick(settings, fleet_b, {})  # the second gateway, started later, with no traffic of its own
        assert not b.leads and b.table.version == 1
        assert homes(fleet_b) == homes(fleet_a)
        # The warm-up done (the leader's fleet records the adapters resident), the switch is the next version.
        llama = fleet_a.pools["llama"]
        for key, old in a.table.pools["llama"].warming.items():
            for replica_id in planned[key]:
                if replica_id not in old:
                    llama.residency.views[replica_id].resident[TENANTS[key][0]] = 0.0
        await a.tick(settings, fleet_a, traffic)
        assert a.table.version == 2 and not a.table.pools["llama"].warming
        await b.tick(settings, fleet_b, {})
        assert homes(fleet_b) == homes(fleet_a) != before
        assert all(homes(fleet_a)[key] == members for key, members in planned.items())
        # The heavy tenants now live apart.
        heavy = [t for t, rate in traffic["llama"].keys.items() if rate.requests_per_s > 1]
        assert homes(fleet_a)[heavy[0]][0] != homes(fleet_a)[heavy[1]][0]
        # The leader stops renewing (dies): the lease lapses and the second takes over with the same table.
        await a.close()
        await b.store.publish("gw-b", b.table)  # refused: gw-a's lease still stands
        assert (await b.store.poll("gw-b", 0)).leads is False
        client = redis.asyncio.Redis.from_url(redis_server.url)
        await client.delete(f"{prefix}:{{placement}}:leader")  # as its lease running out would
        await client.aclose()
        await b.tick(settings, fleet_b, traffic)
        assert b.leads and b.table.version >= 2 and homes(fleet_b) == homes(fleet_a)
    finally:
        await b.close()
        await fleet_a.close()
        await fleet_b.close()


@pytest.fixture
def sims(tmp_path: Path) -> Iterator[dict[str, str]]:
    # A cold load of about half a second: the warm-up takes a few polls.
    with simulated_replicas(tmp_path, 4, "--time-scale", "0.5") as urls:
        yield urls


async def test_a_moving_key_goes_to_its_new_home_only_once_its_adapter_is_warm_there(
    sims: dict[str, str], adapters: dict[str, str]
) -> None:
    settings = config(sims, adapters)
    fleet = Fleet(settings)
    await fleet.start()
    await fleet.started_up()
    placer = Placer(LocalHomesStore(), "gw", clock=Clock(1000.0))
    llama = fleet.pools["llama"]
    try:
        traffic = colliding(fleet)
        await placer.tick(settings, fleet, traffic)
        warming = dict(placer.table.pools["llama"].warming)
        assert warming
        targets = placer.table.pools["llama"].homes
        key = next(iter(warming))
        adapter = TENANTS[key][0]
        new = next(r for r in targets[key] if r not in warming[key])
        assert not llama.residency.is_resident(new, adapter)
        for _ in range(200):  # bounded: the warm-up is a cold load and a one-token request
            routed = llama.ring.replica_set(key)
            if new in routed or llama.explain(key, adapter).chosen == new:
                assert llama.residency.is_resident(new, adapter)  # never before the adapter is there
            else:
                assert routed == warming[key]
            if routed == targets[key]:
                break
            await asyncio.sleep(0.05)  # no tick: the switch follows the warm-up, not the next interval
        assert homes(fleet)[key] == targets[key]
        assert placer.table.moves == 0  # the switch's version moved nothing new
    finally:
        await placer.close()
        await fleet.close()


async def test_a_moving_key_pushed_out_of_its_old_set_is_routed_to_its_new_one_at_once(
    adapters: dict[str, str],
) -> None:
    """A swap: the heavy key's warm-up at its new home takes its partner's slot there. Routed by its old set, the
    partner's every request reloaded it there and pushed out a neighbour, who reloaded in turn (collide: 12 cold
    loads at the heavy key's new home): with its adapter in no member of its old set there is no break to avoid,
    and it goes to its new set at once. A key still resident at its old home waits for its warm-up, as before."""
    settings = config(REPLICAS, adapters)
    fleet = Fleet(settings)
    placer = Placer(LocalHomesStore(), "gw", clock=Clock(1000.0))
    llama = fleet.pools["llama"]
    try:
        for tenant, (adapter,) in TENANTS.items():  # every adapter resident at its (count-balanced) home
            llama.residency.views[llama.ring.home(tenant)].resident[adapter] = 0.0
        traffic = colliding(fleet)
        await placer.tick(settings, fleet, traffic)
        warming = dict(placer.table.pools["llama"].warming)
        assert len(warming) >= 2
        targets = dict(placer.table.pools["llama"].homes)
        pushed, kept = sorted(warming)[:2]
        for replica_id in warming[pushed]:
            llama.residency.views[replica_id].resident.pop(TENANTS[pushed][0], None)
        await placer.tick(settings, fleet, traffic)
        assert pushed not in placer.table.pools["llama"].warming
        assert homes(fleet)[pushed] == targets[pushed]  # although not warm there yet: its warm-up is under way
        assert kept in placer.table.pools["llama"].warming and homes(fleet)[kept] == warming[kept]
    finally:
        await placer.close()
        await fleet.close()


async def test_a_move_from_a_home_that_is_down_switches_at_once(sims: dict[str, str], adapters: dict[str, str]) -> None:
    settings = config(sims, adapters)
    fleet = Fleet(settings)
    placer = Placer(LocalHomesStore(), "gw", clock=Clock(1000.0))
    llama = fleet.pools["llama"]
    try:
        traffic = colliding(fleet)
        await placer.tick(settings, fleet, traffic)
        warming = dict(placer.table.pools["llama"].warming)
        key = next(iter(warming))
        target = placer.table.pools["llama"].homes[key]
        for replica_id in warming[key]:
            llama.replicas[replica_id].health.up = False
        await placer.tick(settings, fleet, traffic)
        assert key not in placer.table.pools["llama"].warming
        assert homes(fleet)[key] == target
    finally:
        await placer.close()
        await fleet.close()


async def test_frozen_or_pinned_keys_stay_put(adapters: dict[str, str]) -> None:
    frozen = config(REPLICAS, adapters, freeze=True)
    fleet = Fleet(frozen)
    store = LocalHomesStore()
    placer = Placer(store, "gw", clock=Clock(1000.0))
    try:
        traffic = colliding(fleet)
        before = homes(fleet)
        await placer.tick(frozen, fleet, traffic)
        assert placer.table.moves == 0 and homes(fleet) == before
        # The run-time freeze (the admin API's) holds it as well; lifting both lets the plan run.
        await store.set_frozen(True)
        plain = config(REPLICAS, adapters)
        await placer.tick(plain, fleet, traffic)
        assert homes(fleet) == before
        # Pins still apply while frozen (placement.freeze says so): a light tenant pinned elsewhere moves there,
        # warmed there first, and nothing else moves.
        light = next(t for t, rate in sorted(traffic["llama"].keys.items()) if rate.requests_per_s <= 1)
        target = next(r for r in sorted(REPLICAS) if r not in before[light])
        await store.set_pin("llama", light, target)
        await placer.tick(plain, fleet, traffic)
        table = placer.table.pools["llama"]
        assert table.homes == {light: (target,)} and table.warming == {light: before[light]}
        assert table.why[light] == f"pinned to {target}" and homes(fleet) == before
        await store.set_frozen(False)
        heavy = sorted(t for t, rate in traffic["llama"].keys.items() if rate.requests_per_s > 1)
        for tenant in heavy:  # pinned where they collide: they never move
            await store.set_pin("llama", tenant, before[tenant][0])
        await placer.tick(plain, fleet, traffic)
        planned = placer.table.pools["llama"].homes
        assert all(planned.get(t, before[t]) == before[t] for t in heavy)
    finally:
        await placer.close()
        await fleet.close()


async def test_no_key_is_confined_until_a_table_planned_from_a_whole_window_of_traffic_is_in_force(
    adapters: dict[str, str],
) -> None:
    """collide (docs/benchmarks.md, 2026-12-02 morning): the first table was published at start-up, before any
    traffic, so every key was confined to its count-balanced home, and the two heavy tenants that share one queued
    39 deep there until the plan, measuring a few seconds of a moving average, split them at 6.8 s. Now a leader
    plans nothing until its traffic covers a window, and the fleet routes as balanced homes do (spills unconfined)
    until a table is in force."""
    settings = config(REPLICAS, adapters)
    fleet = Fleet(settings)
    placer = Placer(LocalHomesStore(), "gw", clock=Clock(1000.0))
    try:
        pool = fleet.pools["llama"]
        assert pool.plan_bound is None  # no table yet: spills go where predicted faster, as with balanced homes
        traffic = colliding(fleet)
        before = homes(fleet)
        await placer.tick(settings, fleet, traffic, measured=False)
        assert placer.leads and not placer.table.measured and not placer.table.pools["llama"].homes
        assert homes(fleet) == before and pool.plan_bound is None
        await placer.tick(settings, fleet, traffic)  # a whole window measured: the first plan splits the pair
        assert placer.table.measured and placer.table.pools["llama"].homes and pool.plan_bound is not None
        await placer.tick(settings, fleet, traffic, measured=False)  # a leader's young meter keeps the table
        assert placer.table.measured and pool.plan_bound is not None
        # On the wire: a table of the version before the flag was planned by traffic (it confined then).
        assert not decode_table(encode_table(replace(placer.table, measured=False))).measured
        older = json.loads(encode_table(placer.table))
        del older["measured"]
        assert decode_table(json.dumps(older)).measured
    finally:
        await placer.close()
        await fleet.close()


def test_a_key_s_cool_down_passes_to_the_next_leader_with_the_table() -> None:
    """plan.py's repay_after_s: when a key last gave a copy back travels in the table, so a new leader does not let
    a bursting key make a neighbour pay at once; a table of the version before it has none (every key may pay)."""
    table = HomesTable(3, "gw-a", {"llama": PoolTable(cooled_at={"t5": 1234.5})})
    assert decode_table(encode_table(table)).pools["llama"].cooled_at == {"t5": 1234.5}
    older = json.loads(encode_table(table))
    del older["pools"]["llama"]["cooled_at"]
    assert decode_table(json.dumps(older)).pools["llama"].cooled_at == {}
    older["pools"]["llama"]["cooled_at"] = {"t5": "nan"}
    with pytest.raises(ValueError):
        decode_table(json.dumps(older))


async def test_a_move_not_warm_in_time_is_given_up(adapters: dict[str, str]) -> None:
    settings = config(REPLICAS, adapters)  # replicas that never answer: no warm-up succeeds
    fleet = Fleet(settings)
    clock = Clock(1000.0)
    placer = Placer(LocalHomesStore(), "gw", clock=clock)
    try:
        traffic = colliding(fleet)
        before = homes(fleet)
        await placer.tick(settings, fleet, traffic)
        warming = dict(placer.table.pools["llama"].warming)
        assert warming
        clock.advance(settings.placement.warm_timeout_s + 1)
        await placer.tick(settings, fleet, traffic)
        table = placer.table.pools["llama"]
        assert not set(warming) & set(table.warming)
        assert all(table.homes.get(key, before[key]) == old for key, old in warming.items())
        assert placer.given_up == len(warming) and "given up" in table.why[next(iter(warming))]
        assert homes(fleet) == before
    finally:
        await placer.close()
        await fleet.close()


async def test_a_drained_replica_leaves_the_plan_and_its_keys_move_within_the_bound(adapters: dict[str, str]) -> None:
    settings = config(REPLICAS, adapters, max_moves=2, grow_above=100.0, shrink_below=50.0)
    fleet = Fleet(settings)
    placer = Placer(LocalHomesStore(), "gw", clock=Clock(1000.0))
    llama = fleet.pools["llama"]
    try:
        drained = "r1"
        homed = sorted(t for t, members in homes(fleet).items() if drained in members)
        assert 1 <= len(homed) <= 2  # 8 tenants balanced over 4 replicas: at most 2 each
        llama.replicas[drained].health.up = False  # only down: its keys stay (their requests spill meanwhile)
        await placer.tick(settings, fleet, {})
        assert not placer.table.pools.get("llama", PoolTable()).homes
        llama.replicas[drained].health.up = True
        llama.replicas[drained].health.drained = True
        await placer.tick(settings, fleet, {})  # no traffic: only the evacuation moves anything
        table = placer.table.pools["llama"]
        assert sorted(table.homes) == homed and not table.warming  # the old home takes no traffic: no warm-up
        assert all(drained not in homes(fleet)[t] for t in homed)
        assert all(table.why[t] == f"left {drained}" for t in homed)
    finally:
        await placer.close()
        await fleet.close()


async def test_a_tenant_added_at_run_time_is_placed_like_one_of_the_file(adapters: dict[str, str]) -> None:
    """The file names t0-t6; t7 joins at run time (the served config has it; balanced homes do not: its home is the
    ring's). When t7 and a tenant of the file are the heavy pair on one replica and the file's is pinned there, t7
    moves, its adapter (known from the served config) warmed at its new home first."""
    base = config(REPLICAS, adapters, grow_above=100.0, shrink_below=50.0)
    file = base.model_copy(update={"tenants": [t for t in base.tenants if t.id != "t7"]})
    probe = Fleet(base, homes_from=file)
    ring = probe.pools["llama"].ring
    home = ring.home("t7")
    assert home == ring.ring_home("t7")  # not balanced: it is not in the file
    partner = next(t for t in sorted(TENANTS) if t != "t7" and ring.home(t) == home)
    await probe.close()
    served = base.model_copy(update={"placement": base.placement.model_copy(update={"pins": {partner: home}})})
    fleet = Fleet(served, homes_from=file)
    placer = Placer(LocalHomesStore(), "gw", clock=Clock(1000.0))
    try:
        keys = {t: Rate(10.0 if t in ("t7", partner) else 0.5, 0.0) for t in TENANTS}
        traffic = {"llama": PoolTraffic(Rate(sum(r.requests_per_s for r in keys.values()), 0.0), keys)}
        await placer.tick(served, fleet, traffic)
        table = placer.table.pools["llama"]
        assert table.homes["t7"][0] != home and table.warming["t7"] == (home,)
        assert [slot for slot in placer._warming if slot[2] == "a7"] == [("llama", table.homes["t7"][0], "a7")]
    finally:
        await placer.close()
        await fleet.close()


@pytest.mark.parametrize(
    ("stored", "published"),
    [
        pytest.param("7 {not json", 8, id="malformed"),
        pytest.param('7 {"version":7,"leader":"gw-next","format":2,"tables":{}}', 8, id="another format"),
        pytest.param('7 {"version":Infinity,"leader":"gw-next","moves":0,"pools":{}}', 8, id="version Infinity"),
        pytest.param('7 {"version":7,"leader":"gw-next","moves":1e400,"pools":{}}', 8, id="moves past a double"),
        # Past Lua's doubles: read as 2^63 and more it refused every publish; unreadable, the leader starts over.
        pytest.param(
            '99999999999999999999999 {"version":7,"leader":"gw-next","moves":0,"pools":{}}', 1, id="version past 2^63"
        ),
        pytest.param(
            '9007199254740993 {"version":7,"leader":"gw-next","moves":0,"pools":{}}', 1, id="version past 2^53"
        ),
    ],
)
async def test_a_stored_table_this_gateway_cannot_read_is_replaced_by_its_leader(
    redis_server: RedisServer, adapters: dict[str, str], stored: str, published: int
) -> None:
    """A homes table in Redis that does not decode (written by hand, or by a gateway of another format, with a
    higher version) must not stop placement: the gateway that takes the lease leads, and publishes its own table
    above the stored version (which every gateway can read again). A whole number that JSON writes as infinite
    (Python's json writes a float's ``Infinity``, and reads 1e400 as one) raised OverflowError, past the store's
    handling: out of every tick (placement stuck: the leader could not publish over it), and out of the first look
    before a gateway serves, so no gateway with traffic placement could start."""
    prefix = f"test-{uuid.uuid4().hex}"
    settings = config(REPLICAS, adapters)
    client = redis.asyncio.Redis.from_url(redis_server.url, decode_responses=True)
    await client.set(f"{prefix}:{{placement}}:homes", stored)
    store = RedisHomesStore(make_client(redis_server.url, 2.0), operation_timeout_s=2.0, lease_s=30.0, prefix=prefix)
    fleet = Fleet(settings)
    placer = Placer(store, "gw-a", clock=Clock(1000.0))
    try:
        await placer.first_look(fleet)  # before the gateway serves: unreadable, not installed
        assert placer.table.version == 0
        await placer.tick(settings, fleet, {})  # no traffic: nothing to move, but the table must be readable again
        assert placer.leads and placer.table.version == published
        polled = await store.poll("gw-b", 0)
        assert polled.version == published and polled.table is not None and polled.table.leader == "gw-a"
    finally:
        await client.aclose()
        await placer.close()
        await fleet.close()


async def test_a_replica_discovery_removes_leaves_the_table_at_the_next_interval(adapters: dict[str, str]) -> None:
    """A rebuild's fleet without r3 (DNS no longer lists it), installed before it serves: a key whose set was r3
    routes by its ring order meanwhile, and the next interval moves it off r3 within the bound; a move to r3 still
    warming is given up."""
    settings = config(REPLICAS, adapters, grow_above=100.0, shrink_below=50.0)
    old = Fleet(settings)
    placer = Placer(LocalHomesStore(), "gw", clock=Clock(1000.0))
    fewer = config({r: url for r, url in REPLICAS.items() if r != "r3"}, adapters, grow_above=100.0, shrink_below=50.0)
    new = Fleet(fewer)
    try:
        settled, warming = [t for t in sorted(TENANTS) if homes(old)[t] != ("r3",)][:2]
        # An operator pins one key to r3 while its home is down (the move switches at once), then another while
        # every replica is up (its move waits for its adapter, which these replicas never load).
        await placer.store.set_pin("llama", settled, "r3")
        down = homes(old)[settled][0]
        old.pools["llama"].replicas[down].health.up = False
        await placer.tick(settings, old, {})
        old.pools["llama"].replicas[down].health.up = True
        await placer.store.set_pin("llama", warming, "r3")
        await placer.tick(settings, old, {})
        assert homes(old)[settled] == ("r3",) and placer.table.pools["llama"].warming.keys() == {warming}
        for key in (settled, warming):
            await placer.store.set_pin("llama", key, None)
        placer.install(new)  # as a rebuild does before the new fleet serves
        assert all("r3" not in members for members in homes(new).values())
        await placer.tick(fewer, new, {})
        table = placer.table.pools["llama"]
        assert all("r3" not in members for members in table.homes.values())
        assert table.why[settled] == "left r3" and table.why[warming] == "move to r3 given up: left the pool"
    finally:
        await placer.close()
        await old.close()
        await new.close()


@pytest.mark.parametrize("kind", ["local", "redis"])
async def test_a_pin_reads_back_under_its_own_pool_and_key_whatever_slashes_they_hold(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """Pool names may hold '/' (config.Name: 'meta/llama'), and so may keys: a pin is read back for the pool and
    the key it was set for (it was split at the first '/': pool 'meta', key 'llama/t0', a pin that never applied)."""
    store: LocalHomesStore | RedisHomesStore
    if kind == "local":
        store = LocalHomesStore()
    else:
        server: RedisServer = request.getfixturevalue("redis_server")
        client = make_client(server.url, 2.0)
        store = RedisHomesStore(client, operation_timeout_s=2.0, lease_s=30.0, prefix=f"test-{uuid.uuid4().hex}")
    try:
        await store.set_pin("meta/llama", "t0", "r1")
        await store.set_pin("llama", "org/adapter", "r2")
        assert (await store.poll("gw", 0)).operator.pins == {"meta/llama": {"t0": "r1"}, "llama": {"org/adapter": "r2"}}
        await store.set_pin("meta/llama", "t0", None)
        assert (await store.poll("gw", 0)).operator.pins == {"llama": {"org/adapter": "r2"}}
    finally:
        await store.close()


async def test_a_key_pinned_to_a_drained_replica_is_evacuated_and_says_why(adapters: dict[str, str]) -> None:
    """Drained replicas leave the plan with all their keys: one pinned there too (its pin applies again once the
    replica is back), and its why says it left, not that it is pinned there."""
    settings = config(REPLICAS, adapters, max_moves=4, grow_above=100.0, shrink_below=50.0)
    fleet = Fleet(settings)
    store = LocalHomesStore()
    placer = Placer(store, "gw", clock=Clock(1000.0))
    llama = fleet.pools["llama"]
    try:
        drained = "r1"
        pinned = next(t for t, members in sorted(homes(fleet).items()) if members == (drained,))
        await store.set_pin("llama", pinned, drained)  # where it is already: nothing moves
        llama.replicas[drained].health.drained = True
        await placer.tick(settings, fleet, {})
        table = placer.table.pools["llama"]
        assert drained not in table.homes[pinned] and table.why[pinned] == f"left {drained}"
        assert drained not in homes(fleet)[pinned]  # its old home takes no traffic: no warm-up
    finally:
        await placer.close()
        await fleet.close()


async def test_every_gateway_reports_the_freeze_and_pins_not_only_the_leader(
    redis_server: RedisServer, adapters: dict[str, str]
) -> None:
    """Behind a Service an operator's GET /admin/placement lands on any gateway: one that does not lead must not
    say 'frozen: false' and no pins while the leader holds the fleet frozen and pinned."""
    prefix = f"test-{uuid.uuid4().hex}"
    settings = config(REPLICAS, adapters)

    def placer(name: str) -> Placer:
        store = RedisHomesStore(
            make_client(redis_server.url, 2.0), operation_timeout_s=2.0, lease_s=30.0, prefix=prefix
        )
        return Placer(store, name, clock=Clock(1000.0))

    fleet_a, fleet_b = Fleet(settings), Fleet(settings)
    a, b = placer("gw-a"), placer("gw-b")
    try:
        await a.tick(settings, fleet_a, {})
        await b.store.set_frozen(True)  # through the gateway that does not lead
        await b.store.set_pin("llama", "t0", "r2")
        await a.tick(settings, fleet_a, {})
        await b.tick(settings, fleet_b, {})
        assert a.leads and not b.leads
        for gateway in (a, b):
            assert gateway.frozen(settings.placement) and gateway.pins(settings.placement, "llama") == {"t0": "r2"}
    finally:
        await a.close()
        await b.close()
        await fleet_a.close()
        await fleet_b.close()


@pytest.mark.parametrize(
    "pool",
    [
        pytest.param({"homes": {"t0": ["r1"]}, "warming": {"t0": ["r0"]}, "warming_since": {}}, id="warming, no since"),
        pytest.param(
            {"homes": {"t0": ["r1"]}, "warming": {"t0": ["r0"]}, "warming_since": {"t0": "NaN"}}, id="since NaN"
        ),
    ],
)
async def test_a_stored_table_whose_warming_has_no_start_does_not_stop_its_leader(
    redis_server: RedisServer, adapters: dict[str, str], pool: dict[str, Any]
) -> None:
    """A table that decodes but is inconsistent (another version's, or edited by hand): a warming key without the
    time it started, or with NaN for it, never timed out (its move stayed half made for good, the table unchanged;
    and once its warm-up ended, the missing start raised KeyError in every tick of the leader). Now it counts as
    started at 0 (a NaN makes the table unreadable: replaced), and the leader gives the move up and publishes."""
    prefix = f"test-{uuid.uuid4().hex}"
    settings = config(REPLICAS, adapters)
    body = {"version": 7, "leader": "gw-old", "moves": 1, "pools": {"llama": {"why": {}, "below_since": {}, **pool}}}
    client = redis.asyncio.Redis.from_url(redis_server.url, decode_responses=True)
    await client.set(f"{prefix}:{{placement}}:homes", "7 " + json.dumps(body).replace('"NaN"', "NaN"))
    store = RedisHomesStore(make_client(redis_server.url, 2.0), operation_timeout_s=2.0, lease_s=30.0, prefix=prefix)
    fleet = Fleet(settings)
    placer = Placer(store, "gw-a", clock=Clock(1000.0))
    try:
        await placer.tick(settings, fleet, {})
        assert placer.leads and placer.table.version == 8 and not placer.table.pools["llama"].warming
    finally:
        await client.aclose()
        await placer.close()
        await fleet.close()


def test_a_table_nested_past_the_parsers_depth_is_unreadable() -> None:
    """Nested deeper than the JSON parser recurses (anyone with Redis access): unreadable, not installed, as any
    other table that does not decode (a RecursionError went past the store's handling, and failed the poll)."""
    with pytest.raises(ValueError):
        decode_table('{"sets": ' + "[" * 100_000)


async def test_a_key_sized_by_seats_unplans_the_lightest_key_in_the_table_the_fill_and_routing(
    adapters: dict[str, str],
) -> None:
    """8 tenants fill 4 replicas of 2 slots; the pool states 4 seats a replica and one tenant holds 3 requests in
    flight: its set grows, the lightest tenant planned alone elsewhere is unplanned in the published table (which
    carries it through its wire form), the fill plans nothing for its adapter, and the pool knows it (plan_bound.py
    routes it where a load pushes out no planned adapter in use)."""
    raw = gateway_config(REPLICAS, TENANTS, adapters, port=free_port(), max_adapters=2,
                         extra={"placement": {"max_moves": 4}})  # fmt: skip
    raw["routing"]["home_placement"] = "traffic"
    raw["pools"][0]["seats"] = 4
    settings = GatewayConfig.model_validate(raw)
    fleet = Fleet(settings)
    placer = Placer(LocalHomesStore(), "gw", clock=Clock(1000.0))
    llama = fleet.pools["llama"]
    heavy = "t3"
    light = {t: Rate(0.5, 0.0, 0.0, 0.1) for t in TENANTS} | {"t6": Rate(0.1, 0.0, 0.0, 0.05)}
    keys = light | {heavy: Rate(5.0, 0.0, 0.0, 3.0)}
    traffic = {"llama": PoolTraffic(Rate(sum(r.requests_per_s for r in keys.values()), 0.0), keys)}
    try:
        await placer.tick(settings, fleet, traffic)
        table = placer.table.pools["llama"]
        assert len(table.homes[heavy]) == 2 and table.why[heavy].startswith("seats")
        assert table.unplanned == frozenset({"t6"}) and table.why["t6"].startswith("unplanned")
        assert decode_table(encode_table(placer.table)).pools["llama"].unplanned == frozenset({"t6"})
        assert llama.unplanned == frozenset({"t6"})
        shown = key_placement(fleet, llama, "t6")
        assert shown["unplanned"] and shown["planned"] == [] and shown["why"].startswith("unplanned")
        assert all("a6" not in {a.engine_name for a in refs} for refs in llama.fill.values())
        assert all("a6" not in planned for planned in llama.residency.plan.values())
    finally:
        await placer.close()
        await fleet.close()


@pytest.mark.parametrize(
    ("key", "write"),
    [
        pytest.param("homes", lambda c, k: c.hset(k, "version", "7"), id="table a hash"),
        pytest.param("leader", lambda c, k: c.sadd(k, "gw-x"), id="lease a set"),
        pytest.param("operator", lambda c, k: c.set(k, "frozen"), id="operator settings a string"),
    ],
)
async def test_a_placement_key_of_another_type_is_repaired_not_the_store_down(
    redis_server: RedisServer, adapters: dict[str, str], key: str, write: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Someone writes another Redis type where the table, the leader's lease or the operator's settings live: the
    poll's GET or HGETALL raised WRONGTYPE, which is StoreUnavailable, at every gateway and every interval, so
    placement stopped for good (no leader, no table read, the first look before serving failed) until an operator
    deleted the key. The gateway owns these keys: the poll deletes one of another type (its content was unreadable
    anyway), says so once, and placement goes on: a leader publishes, every gateway reads its table."""
    prefix = f"test-{uuid.uuid4().hex}"
    settings = config(REPLICAS, adapters)
    client = redis.asyncio.Redis.from_url(redis_server.url, decode_responses=True)
    await write(client, f"{prefix}:{{placement}}:{key}")
    store = RedisHomesStore(make_client(redis_server.url, 2.0), operation_timeout_s=2.0, lease_s=30.0, prefix=prefix)
    fleet = Fleet(settings)
    placer = Placer(store, "gw-a", clock=Clock(1000.0))
    try:
        await placer.first_look(fleet)
        await placer.tick(settings, fleet, {})
        assert placer.store_up and placer.leads and placer.table.version == 1
        polled = await store.poll("gw-b", 0)
        assert polled.version == 1 and polled.table is not None and polled.table.leader == "gw-a"
        await store.set_frozen(True)
        assert (await store.operator()).frozen
        assert caplog.text.count(f"{key} held a") == 1
    finally:
        await client.aclose()
        await placer.close()
        await fleet.close()


async def test_a_moving_key_whose_old_member_left_the_pool_is_still_weighed(adapters: dict[str, str]) -> None:
    """A rebuild's fleet (discovery) may no longer have a member of a moving key's old set: the check for a key
    pushed out of its old set reads the residency of the old members still in the pool, and the interval goes on
    (reading the one that left raised KeyError out of the placer's tick)."""
    settings = config(REPLICAS, adapters)
    fleet = Fleet(settings)
    placer = Placer(LocalHomesStore(), "gw", clock=Clock(1000.0))
    llama = fleet.pools["llama"]
    try:
        for tenant, (adapter,) in TENANTS.items():
            llama.residency.views[llama.ring.home(tenant)].resident[adapter] = 0.0
        traffic = colliding(fleet)
        await placer.tick(settings, fleet, traffic)
        warming = dict(placer.table.pools["llama"].warming)
        assert warming
        key = sorted(warming)[0]
        new = [r for r in placer.table.pools["llama"].homes[key] if r not in warming[key]]
        gone = warming[key][0]
        assert gone not in new
        del llama.residency.views[gone], llama.replicas[gone]  # as a rebuilt fleet without it has neither
        await placer.tick(settings, fleet, traffic)
    finally:
        await placer.close()
        await fleet.close()
