"""A gateway killed (SIGKILL) mid-load, sharing Redis with others: what it leaves behind must not hold up the gateway
that survives it, nor itself once restarted.

What a gateway killed while it loads (or fills, evicts, reconciles) on a replica leaves in Redis is that replica's
lock (``tg:{pool:replica}:lock``), taken with ``residency.lock_ttl_s`` and never given back. The tests take such a
lock as a gateway does (``RedisStore.acquire`` with the default ttl, under a holder no live gateway has) and never
renew nor release it: that is the killed gateway. Each then asks that a live gateway's load on that replica, and a
restarted gateway's readiness, come within a bound far below the old default lock ttl (120 s, and a load gave up
waiting for a lock after ``adapter_load_timeout_s``, 60 s: a restarted gateway's start-up reconciliation waited
that long per replica, and a survivor's request for a cold adapter there waited 60 s, then was retried elsewhere).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import openai
import pytest

from gateway.config import ResidencyConfig
from gateway.residency.redis import RedisStore
from loadtests.faultkit import GatewayUnderTest, sim_replicas
from loadtests.fleet import api_key
from loadtests.processes import free_port
from tests.gateway.test_faults import MODELS, SIM, config_for, gateway
from tests.redis_server import RedisServer

pytestmark = pytest.mark.timeout(240)

# Well above the default lock ttl (and its poll's pace), well below what a dead holder used to cost (60 s at least).
BOUND_S = 40.0


def dead_gateways_lock(redis_url: str, replica: str, adapter: str) -> None:
    """Take the replica's lock as a gateway starting a load does, then vanish (no renewal, no release)."""

    async def take() -> None:
        store = RedisStore(redis_url)
        try:
            held = await store.acquire("llama", replica, f"deadbeef0000 {adapter}", ResidencyConfig().lock_ttl_s)
            assert held
        finally:
            await store.close()

    asyncio.run(take())


def test_a_survivors_load_does_not_wait_for_a_dead_gateways_lock(tmp_path: Path) -> None:
    with RedisServer(log_path=tmp_path / "redis.log") as redis, sim_replicas(tmp_path, 2, *SIM) as replicas:
        config = config_for(tmp_path, replicas)
        config["state"] = {"redis_url": redis.url}
        with gateway(tmp_path, config) as gw:
            tenant = "t0"
            home = gw.home_of(tenant)
            # The adapter is cold everywhere: the next request must load it on its home, under the lock.
            assert gw.admin("DELETE", f"/admin/adapters/{MODELS[tenant]}/residency").status_code == 200
            dead_gateways_lock(redis.url, home, "lora-t5")
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key=api_key(tenant), max_retries=0, timeout=BOUND_S)
            started = time.monotonic()
            answer = client.completions.create(model=MODELS[tenant], prompt="after the crash", max_tokens=2)
            took = time.monotonic() - started
    assert answer.choices, answer
    assert took < BOUND_S


def test_a_restarted_gateway_comes_up_past_the_lock_it_held_when_killed(tmp_path: Path) -> None:
    with RedisServer(log_path=tmp_path / "redis.log") as redis, sim_replicas(tmp_path, 2, *SIM) as replicas:
        config = config_for(tmp_path, replicas)
        config["state"] = {"redis_url": redis.url}
        for replica in replicas:  # killed during its fill, which loads on every replica at once
            dead_gateways_lock(redis.url, replica, "lora-t0")
        gw = GatewayUnderTest(tmp_path, config)
        started = time.monotonic()
        try:
            gw.start(timeout_s=BOUND_S)  # /readyz answers 200 (it raises past the bound)
            ready_after = time.monotonic() - started
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key=api_key("t1"), max_retries=0, timeout=30)
            answer = client.completions.create(model=MODELS["t1"], prompt="back", max_tokens=2)
        finally:
            gw.stop()
    assert answer.choices, answer
    assert ready_after < BOUND_S


def test_a_restarted_gateway_routes_by_the_shared_homes_table_as_soon_as_it_is_ready(tmp_path: Path) -> None:
    """Homes from traffic: the table lives in Redis. A gateway (re)started beside a leader that moved a key routed
    by count-balanced homes until its first placement interval (10 s by default) had passed, while the others
    routed by the table: for that long its requests for moved keys went where their adapters were not planned (cold
    loads that push out planned adapters). It reads the table once before it serves now."""
    with RedisServer(log_path=tmp_path / "redis.log") as redis, sim_replicas(tmp_path, 2, *SIM) as replicas:
        leader_config = config_for(tmp_path, replicas)
        leader_config["state"] = {"redis_url": redis.url}
        leader_config["routing"]["home_placement"] = "traffic"
        leader_config["placement"] = {"interval_s": 0.3}
        with gateway(tmp_path, leader_config) as leader:
            tenant = "t0"
            balanced = leader.home_of(tenant)
            elsewhere = next(r for r in replicas if r != balanced)
            pinned = leader.admin("PUT", f"/admin/placement/pins/llama/{tenant}", json={"replica": elsewhere})
            assert pinned.status_code == 200, pinned.text
            for _ in range(300):  # bounded: the leader publishes at its next 0.3 s interval
                if leader.home_of(tenant) == elsewhere:
                    break
                time.sleep(0.05)
            assert leader.home_of(tenant) == elsewhere
            config = {**leader_config, "listen": {"host": "127.0.0.1", "port": free_port()}}
            config["placement"] = {"interval_s": 10.0}  # the default: the first interval is 10 s away
            restarted = GatewayUnderTest(tmp_path, config, name="restarted")
            try:
                restarted.start()
                assert restarted.home_of(tenant) == elsewhere
            finally:
                restarted.stop()
