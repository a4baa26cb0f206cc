"""Drains outlive a reload and reach every gateway sharing Redis (gateway/admin/drains.py), in running gateways
(tenantgate serve) against simulated replicas; where requests ran is read from the simulators' counters."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis.asyncio
from aiohttp.test_utils import TestClient, TestServer

from gateway.admin.drains import Drains
from gateway.app import create_app
from gateway.config import GatewayConfig
from loadtests.faultkit import GatewayUnderTest, SimReplica, sim_replicas
from loadtests.fleet import api_key, gateway_config, write_adapters
from loadtests.processes import free_port
from tests.gateway.admin.test_admin_surface import raw_config
from tests.redis_server import RedisServer

pytestmark = pytest.mark.timeout(120)

SIM = ["--time-scale", "0.01", "--max-loras", "4"]
TENANTS = {"t0": ["lora-t0"]}


def config_for(root: Path, replicas: dict[str, SimReplica], **extra: Any) -> dict[str, Any]:
    adapters = write_adapters(root, ["lora-t0"])
    urls = {name: replica.url for name, replica in replicas.items()}
    config = gateway_config(
        urls, TENANTS, adapters, port=free_port(), policy="bounded_consistent_hash", extra=extra or None
    )
    config["pools"][0]["slow_start_s"] = 0
    return config


@contextlib.contextmanager
def gateways(root: Path, configs: list[dict[str, Any]], first: int = 0) -> Iterator[list[GatewayUnderTest]]:
    started = [GatewayUnderTest(root, config, name=f"gateway-{first + i}") for i, config in enumerate(configs)]
    try:
        for gw in started:
            gw.start()
        yield started
    finally:
        for gw in started:
            gw.stop()


def drained(gw: GatewayUnderTest, replica: str) -> bool:
    replicas = gw.admin("GET", "/admin/state").json()["pools"]["llama"]["replicas"]
    return bool(next(r for r in replicas if r["id"] == replica)["drained"])


def ran_on(gw: GatewayUnderTest, replicas: dict[str, SimReplica], count: int = 3) -> dict[str, int]:
    """Where ``count`` requests of t0 through ``gw`` ran."""
    before = {n: r.stats()["requests_by_model"].get("lora-t0", 0) for n, r in replicas.items()}
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=api_key("t0"), max_retries=0, timeout=30)
    for _ in range(count):
        client.completions.create(model="lora-t0", prompt="x", max_tokens=2)
    return {n: r.stats()["requests_by_model"].get("lora-t0", 0) - before[n] for n, r in replicas.items()}


def until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(100):  # bounded: gateways read the shared set every second
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"never happened: {what}")


def test_a_drain_survives_a_reload(tmp_path: Path) -> None:
    with sim_replicas(tmp_path, 2, *SIM) as replicas, gateways(tmp_path, [config_for(tmp_path, replicas)]) as (gw,):
        home = gw.home_of("t0")
        other = next(name for name in replicas if name != home)
        assert gw.admin("POST", f"/admin/replicas/llama/{home}/drain").json()["drained"] is True
        assert gw.admin("POST", "/admin/reload").status_code == 200  # a new fleet
        assert drained(gw, home)
        after_reload = ran_on(gw, replicas)
        gw.admin("POST", f"/admin/replicas/llama/{home}/undrain")
        undrained = ran_on(gw, replicas)
    assert after_reload == {home: 0, other: 3}
    assert undrained == {home: 3, other: 0}


def test_a_drain_through_one_gateway_reaches_every_gateway_sharing_redis(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Two gateways share Redis: a drain through the first is seen by the second within its sync and its requests
    avoid the replica; a gateway started afterwards (a new pod) starts with it; an undrain through the second
    reaches the first."""
    with sim_replicas(tmp_path, 2, *SIM) as replicas:
        configs = [config_for(tmp_path, replicas, state={"redis_url": redis_server.url}) for _ in range(3)]
        with gateways(tmp_path, configs[:2]) as (first, second):
            home = first.home_of("t0")
            other = next(name for name in replicas if name != home)
            assert first.admin("POST", f"/admin/replicas/llama/{home}/drain").json()["drained"] is True
            until(lambda: drained(second, home), "the second gateway sees the drain")
            through_second = ran_on(second, replicas)
            with gateways(tmp_path, configs[2:], first=2) as (third,):
                born_drained = drained(third, home)
                through_third = ran_on(third, replicas)
            assert second.admin("POST", f"/admin/replicas/llama/{home}/undrain").json()["drained"] is False
            until(lambda: not drained(first, home), "the first gateway sees the undrain")
            through_first = ran_on(first, replicas)
    assert through_second == {home: 0, other: 3}
    assert born_drained and through_third == {home: 0, other: 3}
    assert through_first == {home: 3, other: 0}


def test_a_drain_is_refused_while_redis_does_not_answer(tmp_path: Path) -> None:
    """Not made on this gateway alone, where the others would never hear of it: refused, naming why."""
    redis = RedisServer(log_path=tmp_path / "redis.log").start()
    try:
        with sim_replicas(tmp_path, 1, *SIM) as replicas:
            config = config_for(tmp_path, replicas, state={"redis_url": redis.url})
            with gateways(tmp_path, [config]) as (gw,):
                redis.stop()
                refused = gw.admin("POST", "/admin/replicas/llama/r0/drain")
                still_serving = drained(gw, "r0")
    finally:
        redis.stop()
    assert refused.status_code == 503 and "shared store is unreachable" in refused.text, refused.text
    assert refused.json()["error"]["code"] == "store_unavailable" and refused.headers["Retry-After"] == "5"
    assert not still_serving


@pytest.mark.parametrize("shared", [False, True], ids=["in-process", "redis"])
async def test_the_set_is_followed_only_where_other_gateways_change_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, shared: bool
) -> None:
    """Without Redis only this gateway changes the drains (and applies each change itself): no follower task wakes
    each second (one did, reading nothing); with Redis one follows the shared set."""
    monkeypatch.setenv("TENANTGATE_ADMIN_TOKEN", "drains-test-admin-token-0123456789abcdef")
    raw = raw_config(tmp_path)
    if shared:
        raw["state"] = {"redis_url": request.getfixturevalue("redis_server").url}
    async with TestClient(TestServer(create_app(GatewayConfig.model_validate(raw)))):
        followers = [task for task in asyncio.all_tasks() if task.get_name() == "drains" and not task.done()]
        assert len(followers) == (1 if shared else 0)


async def test_a_drains_key_of_another_type_is_replaced_and_drains_work_again(redis_server: RedisServer) -> None:
    """Someone SETs a string where the drained replicas' SET lives: every gateway's read of it (each second) and
    every drain raised WRONGTYPE (StoreUnavailable): the last set known stayed, and no drain or undrain could be
    made, until an operator deleted the key. The gateway owns the key: one of another type is replaced by the
    drains the gateway that meets it knew (read as no drain, it put every drained replica back into service on
    every gateway within SYNC_S: a replica taken out for maintenance took traffic again), and drains work again."""
    here, there = Drains(redis_server.url, prefix="t-drains"), Drains(redis_server.url, prefix="t-drains")
    client = redis.asyncio.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        await client.set("t-drains:{drains}", "not a set")
        await here.set("llama", "r0", True)
        await there.sync()
        assert there.drained == {"llama/r0"}
        await client.set("t-drains:{drains}", "not a set")
        await there.sync()
        assert there.drained == {"llama/r0"} and await client.smembers("t-drains:{drains}") == {"llama/r0"}
        await client.set("t-drains:{drains}", "not a set")
        await here.set("llama", "r1", True)  # a change meeting it keeps the known drains too
        await there.sync()
        assert there.drained == {"llama/r0", "llama/r1"}
        await here.set("llama", "r0", False)
        await there.sync()
        assert there.drained == {"llama/r1"}
    finally:
        await client.aclose()
        await here.close()
        await there.close()
