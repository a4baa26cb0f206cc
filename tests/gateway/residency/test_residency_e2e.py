"""Residency end to end: `tenantgate serve` processes, simulated vLLM replicas and a real redis-server.

What happened is read from the replicas' own counters (/sim/stats) and from the record in Redis, never from the
gateway's word alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.residency.redis import RedisStore
from loadtests.fleet import (
    ADMIN_TOKEN,
    api_key,
    fleet_with_gateway,
    gateway_config,
    gateway_process,
    sim_stats,
    simulated_replicas,
    write_adapters,
)
from loadtests.processes import free_port
from tests.redis_server import RedisServer

pytestmark = pytest.mark.timeout(180)

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
FAST_SIM = ["--time-scale", "0.01", "--max-loras", "2", "--max-cpu-loras", "4"]


def admin_get(gateway_url: str, path: str) -> dict[str, Any]:
    answer = httpx.get(gateway_url + path, headers=ADMIN, timeout=10)
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


def ask(gateway_url: str, tenant: str, model: str, prompt: str = "hello") -> str:
    client = openai.OpenAI(base_url=gateway_url + "/v1", api_key=api_key(tenant), max_retries=0, timeout=30)
    return client.completions.create(model=model, prompt=prompt, max_tokens=4).choices[0].text


def test_prewarmed_and_pinned_adapters_are_resident_before_ready(tmp_path: Path) -> None:
    tenants = {"acme": ["support-acme"], "globex": ["sql-globex"], "initech": ["chat-initech"]}
    options = {"support-acme": {"pinned": True}, "sql-globex": {"prewarm": True}}
    with fleet_with_gateway(tmp_path, tenants, 3, FAST_SIM, adapter_options=options) as fleet:
        # fleet_with_gateway returned once /readyz said ready; no tenant has sent anything yet.
        for tenant, adapter in (("acme", "support-acme"), ("globex", "sql-globex")):
            home = admin_get(fleet.gateway_url, f"/admin/route?tenant={tenant}")["home"]
            stats = sim_stats(fleet.replica_urls[home])
            assert adapter in stats["registered"]
            assert stats["requests_by_model"].get(adapter) == 1  # the one-token warm-up
        record = admin_get(fleet.gateway_url, "/admin/residency")["pools"]["llama"]["replicas"]
        pins = {r: [a for a, info in view["adapters"].items() if info["pinned"]] for r, view in record.items()}
        assert sorted(a for pinned in pins.values() for a in pinned) == ["support-acme"]
        # The others fill free slots at their tenants' homes (residency.fill_free_slots), each warmed with one token
        # too (residency.fill_warm_up, on by default), so its first request does not wait for the GPU copy.
        home = admin_get(fleet.gateway_url, "/admin/route?tenant=initech")["home"]
        holders = [r for r, url in fleet.replica_urls.items() if "chat-initech" in sim_stats(url)["registered"]]
        assert holders == [home] and sim_stats(fleet.replica_urls[home])["requests_by_model"].get("chat-initech") == 1

        warmed = httpx.post(fleet.gateway_url + "/admin/adapters/chat-initech/warm", headers=ADMIN, timeout=30)
        home = admin_get(fleet.gateway_url, "/admin/route?tenant=initech")["home"]
        assert warmed.status_code == 200 and warmed.json()["warmed_on"] == [home]
        assert "chat-initech" in sim_stats(fleet.replica_urls[home])["registered"]
        missing = httpx.post(fleet.gateway_url + "/admin/adapters/nope/warm", headers=ADMIN, timeout=30)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_a_full_working_set_evicts_the_lru_adapter_through_the_engine(tmp_path: Path) -> None:
    tenants = {"acme": ["a", "b", "c"]}
    with fleet_with_gateway(tmp_path, tenants, 1, FAST_SIM, max_adapters=2) as fleet:
        for model in ("a", "b", "a", "c"):
            ask(fleet.gateway_url, "acme", model)
        stats = sim_stats(fleet.replica_urls["r0"])
        assert stats["registered"] == ["a", "c"]  # b was the least recently used
        assert stats["unregistrations"] == 1 and stats["peak_registered"] == 2
        counters = admin_get(fleet.gateway_url, "/admin/residency")["pools"]["llama"]["counters"]
        assert counters["evictions_on_request_path"] == 1


def test_the_eviction_timer_unloads_idle_adapters_but_not_pinned_ones(tmp_path: Path) -> None:
    tenants = {"acme": ["a", "b"], "globex": ["p"]}
    # The timer's rule without the fill: with it, a replica's own adapters stay while no other wants the slot
    # (tests/gateway/residency/test_fill.py).
    residency = {"residency": {"evict_interval_s": 0.2, "idle_evict_s": 0.5, "fill_free_slots": False}}
    options = {"p": {"pinned": True}}
    with fleet_with_gateway(
        tmp_path, tenants, 1, FAST_SIM, max_adapters=3, adapter_options=options, extra=residency
    ) as fleet:
        ask(fleet.gateway_url, "acme", "a")
        ask(fleet.gateway_url, "acme", "b")
        registered = sim_stats(fleet.replica_urls["r0"])["registered"]
        for _ in range(100):  # bounded wait for the timer, however fast or slow this machine is
            registered = sim_stats(fleet.replica_urls["r0"])["registered"]
            if registered == ["p"]:
                break
            time.sleep(0.1)
        assert registered == ["p"]
        counters = admin_get(fleet.gateway_url, "/admin/residency")["pools"]["llama"]["counters"]
        assert counters["evictions_scheduled"] == 2


@contextlib.contextmanager
def two_gateways(
    root: Path,
    tenants: dict[str, list[str]],
    replicas: int,
    redis_url: str,
    *,
    sim_args: tuple[str, ...] = tuple(FAST_SIM),
    residency: dict[str, Any] | None = None,
) -> Iterator[tuple[dict[str, str], list[str]]]:
    adapters = write_adapters(root, sorted({name for names in tenants.values() for name in names}))
    # A slow Redis answer must not make a gateway fall back to its local view here: this test is not about that.
    extra = {"state": {"redis_url": redis_url, "operation_timeout_s": 5}, "residency": residency or {}}
    with simulated_replicas(root, replicas, *sim_args) as urls, contextlib.ExitStack() as stack:
        gateways = []
        for name in ("gw-a", "gw-b"):
            config = gateway_config(urls, tenants, adapters, port=free_port(), max_adapters=2, extra=extra)
            url, _ = stack.enter_context(gateway_process(root, config, name))
            gateways.append(url)
        yield urls, gateways


def test_two_gateways_sharing_redis_load_once_stay_in_the_working_set_and_agree(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """vLLM queues a request whose adapter has no slot, so a load that finds every adapter in use (in flight at
    either gateway, or begun within the grace: here both gateways' requests come at once) goes over max_adapters
    rather than wait; the set comes back once its adapters are idle. Loads are never duplicated, every tenant stays
    on its one home, and the gateways agree on the homes."""
    tenants = {f"t{i}": [f"adapter-t{i}"] for i in range(8)}  # 8 adapters, 3 replicas x 2 slots
    timer = {"evict_interval_s": 0.5, "idle_evict_s": 1.5, "headroom": 0}
    with two_gateways(tmp_path, tenants, 3, redis_server.url, residency=timer) as (replicas, gateways):

        async def both_at_once(tenant: str, round_: int) -> None:
            clients = [
                openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key(tenant), max_retries=0) for url in gateways
            ]
            await asyncio.gather(
                *(c.completions.create(model=f"adapter-{tenant}", prompt=f"r{round_}", max_tokens=2) for c in clients)
            )

        async def traffic() -> None:
            for round_ in range(3):
                for tenant in tenants:  # each tenant's request reaches both gateways at the same moment
                    await both_at_once(tenant, round_)

        asyncio.run(traffic())
        stats = {replica: sim_stats(url) for replica, url in replicas.items()}
        homes = [{t: admin_get(url, f"/admin/route?tenant={t}")["home"] for t in tenants} for url in gateways]
        for _ in range(100):  # bounded: the timer brings every set back within max_adapters once traffic stops
            registered = {replica: sim_stats(url)["registered"] for replica, url in replicas.items()}
            if all(len(names) <= 2 for names in registered.values()):
                break
            time.sleep(0.1)
        assert all(len(names) <= 2 for names in registered.values()), registered

    assert homes[0] == homes[1]  # computed apart, with no coordination
    assert max(Counter(homes[0].values()).values()) <= 3  # balanced: 8 tenants, 3 replicas
    for replica, replica_stats in stats.items():
        assert replica_stats["duplicate_loads"] == 0, replica
        # over the bound only by what is homed there: no spill loaded an adapter elsewhere
        assert replica_stats["peak_registered"] <= Counter(homes[0].values())[replica], replica
    for tenant in tenants:  # both gateways sent every request of a tenant to its one home
        served_by = {r for r, s in stats.items() if s["requests_by_model"].get(f"adapter-{tenant}")}
        assert served_by == {homes[0][tenant]}, tenant


# Between two requests of the rotation below: past the grace for a request another gateway began unannounced
# (FLYING_GRACE_S, 0.1 s), so that three requests still fall within the in-use window (1 s) the gateways used before.
PACE_S = 0.2


def test_two_gateways_keep_a_busy_replicas_set_to_what_the_engine_holds(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """README, Working set: on vLLM, a load evicts the least recently used adapter no gateway has in flight, though
    every adapter on the replica was used within the last second by one gateway or the other. Before, gateways
    sharing Redis called all of them in use (the in-use window), the load ran the set over max_adapters, the
    engine's host cache (2 adapters here) dropped one the record still held, and its next request found it gone:
    a cold load routing had not priced, read from the engine's own log of why each cold load happened."""
    sim = ("--time-scale", "0.1", "--max-loras", "2", "--max-cpu-loras", "2")
    no_fill = {"fill_free_slots": False}
    with two_gateways(tmp_path, {"ta": ["x", "y", "z"]}, 1, redis_server.url, sim_args=sim, residency=no_fill) as (
        replicas,
        gateways,
    ):

        async def rotation() -> None:
            clients = [
                openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key("ta"), max_retries=0, timeout=30)
                for url in gateways
            ]
            for index in range(12):  # x, y, z in turn over two slots, alternately through each gateway
                answer = await clients[index % 2].completions.create(model="xyz"[index % 3], prompt="q", max_tokens=2)
                assert answer.choices
                await asyncio.sleep(PACE_S)
            for client in clients:
                await client.close()

        asyncio.run(rotation())
        stats = sim_stats(replicas["r0"])
        records = [admin_get(url, "/admin/residency")["pools"]["llama"]["replicas"]["r0"] for url in gateways]
    causes = Counter(cause for _, _, cause, _ in stats["cold_load_log"])
    assert causes == {"load": 12}, stats["cold_load_log"]  # every request a load the gateways made, none a surprise
    assert stats["peak_registered"] == 2 and stats["duplicate_loads"] == 0
    assert [sorted(record["adapters"]) for record in records] == [sorted(stats["registered"])] * 2


def test_a_set_run_over_max_adapters_comes_back_once_its_requests_end_without_another_load(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """README, Working set: a vLLM set that ran over max_adapters (every adapter in flight when a load came) is
    brought back within a use flush of an adapter going idle, not at the next load there (which need not come) nor
    at the eviction timer (30 s). Both gateways see the set over; the replica's lock lets one of them unload."""
    sim = ("--time-scale", "0.1", "--max-loras", "2", "--max-cpu-loras", "2")
    no_fill = {"fill_free_slots": False}
    with two_gateways(tmp_path, {"ta": ["x", "y", "z"]}, 1, redis_server.url, sim_args=sim, residency=no_fill) as (
        replicas,
        gateways,
    ):
        replica = replicas["r0"]

        async def over_the_bound() -> None:
            a = openai.AsyncOpenAI(base_url=gateways[0] + "/v1", api_key=api_key("ta"), max_retries=0, timeout=30)
            for model in ("x", "y"):
                assert (await a.completions.create(model=model, prompt="load", max_tokens=2)).choices
            async with httpx.AsyncClient(timeout=30) as http:
                await http.post(replica + "/sim/control", json={"paused": True})
                sent = (await http.get(replica + "/sim/stats")).json()["requests"]
                held = [
                    asyncio.create_task(a.completions.create(model=model, prompt="hold", max_tokens=2))
                    for model in ("x", "y")
                ]
                for _ in range(3_000):  # bounded: until the engine has both (in flight at gateway A)
                    if (await http.get(replica + "/sim/stats")).json()["requests"] >= sent + 2:
                        break
                    await asyncio.sleep(0.01)
                newcomer = asyncio.create_task(a.completions.create(model="z", prompt="over", max_tokens=2))
                for _ in range(3_000):  # bounded: until z is registered, over the bound
                    if len((await http.get(replica + "/sim/stats")).json()["registered"]) == 3:
                        break
                    await asyncio.sleep(0.01)
                await http.post(replica + "/sim/control", json={"paused": False})
            for task in (*held, newcomer):
                assert (await task).choices
            await a.close()

        asyncio.run(over_the_bound())
        assert sim_stats(replica)["peak_registered"] == 3
        for _ in range(100):  # bounded (10 s): the eviction timer (30 s) would not bring it back in time
            stats = sim_stats(replica)
            if len(stats["registered"]) <= 2:
                break
            time.sleep(0.1)
        records = [admin_get(url, "/admin/residency")["pools"]["llama"]["replicas"]["r0"] for url in gateways]
    kept = sorted(stats["registered"])
    assert len(kept) == 2 and "z" in kept  # x or y went, whichever was idle first: z's request ended last
    assert stats["unregistrations"] == 1  # by one gateway: the other found it done under the replica's lock
    assert [sorted(record["adapters"]) for record in records] == [kept] * 2


def test_redis_killed_mid_run_fails_no_request_and_the_record_converges(tmp_path: Path) -> None:
    tenants = {f"t{i}": [f"adapter-t{i}"] for i in range(6)}
    redis = RedisServer(log_path=tmp_path / "redis.log").start()
    try:
        with two_gateways(
            tmp_path, tenants, 2, redis.url, residency={"sync_interval_s": 0.2, "reconcile_interval_s": 1.0}
        ) as (
            replicas,
            gateways,
        ):
            gateway = gateways[0]
            failures: list[BaseException] = []

            async def tenant_traffic(tenant: str, requests: int) -> None:
                client = openai.AsyncOpenAI(base_url=gateway + "/v1", api_key=api_key(tenant), max_retries=0)
                for i in range(requests):
                    try:
                        await client.completions.create(model=f"adapter-{tenant}", prompt=f"q{i}", max_tokens=2)
                    except openai.APIError as exc:
                        failures.append(exc)

            async def run(requests: int) -> None:
                await asyncio.gather(*(tenant_traffic(t, requests) for t in tenants))

            asyncio.run(run(3))
            redis.stop()
            asyncio.run(run(5))  # Redis is gone: loads, evictions and uses go on from the local view
            noticed_by = time.monotonic() + 120  # its sync (every 0.2 s) notices, however slow the machine
            while time.monotonic() < noticed_by:
                ready = httpx.get(gateway + "/readyz").json()
                if ready["residency_store"].startswith("down"):
                    break
                time.sleep(0.05)
            assert ready["status"] == "ready" and ready["residency_store"].startswith("down")
            assert "tenantgate_residency_store_up 0.0" in httpx.get(gateway + "/metrics", headers=ADMIN).text
            assert failures == []

            redis.start()  # back, and empty
            started = time.monotonic()
            truth: dict[str, list[str]] = {}
            record: dict[str, list[str]] = {}

            async def read_record() -> dict[str, list[str]]:
                store = RedisStore(redis.url)
                try:
                    return {r: sorted((await store.record("llama", r)).resident) for r in replicas}
                finally:
                    await store.close()

            # Waited for, not timed: how soon it converges is the machine's (printed); a generous deadline only
            # keeps a record that never converges from hanging the test.
            deadline = started + 120
            while time.monotonic() < deadline:
                truth = {r: sim_stats(url)["registered"] for r, url in replicas.items()}
                record = asyncio.run(read_record())
                if record == truth:
                    break
                time.sleep(0.05)
            converged_s = time.monotonic() - started
            assert record == truth and all(truth.values())
            print(f"record converged {converged_s:.2f} s after Redis came back (reconcile interval 1.0 s)")
            asyncio.run(run(2))
            assert failures == []
            # Either gateway may have rebuilt the record: this one says its store is up at its own next sync (every
            # 0.2 s; later on a starved machine), so that is waited for too.
            while time.monotonic() < deadline:
                if httpx.get(gateway + "/readyz").json()["residency_store"] == "up":
                    break
                time.sleep(0.05)
            assert httpx.get(gateway + "/readyz").json()["residency_store"] == "up"
            assert "tenantgate_residency_store_up 1.0" in httpx.get(gateway + "/metrics", headers=ADMIN).text
    finally:
        redis.stop()
