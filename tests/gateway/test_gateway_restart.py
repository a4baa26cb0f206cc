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
import contextlib
import threading
import time
from pathlib import Path
from typing import cast

import openai
import pytest
import redis as sync_redis

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


def test_a_gateway_killed_holding_a_lock_gives_it_back_at_once_when_restarted_on_its_identity(tmp_path: Path) -> None:
    """``state.identity_dir``: a gateway SIGKILLed while its load held a replica's lock, restarted on the same
    directory, knows the lock for its own dead predecessor's (gateway/residency/owner.py) and gives it back at
    start-up: ready in seconds, with a ttl (120 s here) that it used to wait out (its start-up reconciliation
    waited for the lock on the replica up to the load timeout, then the fill did: not ready within 30 s)."""
    with RedisServer(log_path=tmp_path / "redis.log") as redis, sim_replicas(tmp_path, 1, *SIM) as replicas:
        config = config_for(tmp_path, replicas)
        config["state"] = {"redis_url": redis.url, "identity_dir": str(tmp_path / "identity")}
        config["residency"] = {"lock_ttl_s": 120.0}
        gw = GatewayUnderTest(tmp_path, config)
        lock_key = "tg:{llama:r0}:lock"
        store = sync_redis.Redis.from_url(redis.url, decode_responses=True)
        try:
            gw.start(timeout_s=BOUND_S)
            assert gw.admin("DELETE", f"/admin/adapters/{MODELS['t0']}/residency").status_code == 200
            replicas["r0"].faults(hang=True)  # the engine takes the load and never answers: the lock stays held

            def cold_request() -> None:
                client = openai.OpenAI(base_url=gw.url + "/v1", api_key=api_key("t0"), max_retries=0, timeout=5)
                with contextlib.suppress(openai.APIError):
                    client.completions.create(model=MODELS["t0"], prompt="mid-load", max_tokens=2)

            request = threading.Thread(target=cold_request, daemon=True)
            request.start()
            for _ in range(200):  # bounded (10 s): the load holds the replica's lock
                if (holder := cast(str | None, store.get(lock_key))) is not None and holder.endswith(MODELS["t0"]):
                    break
                time.sleep(0.05)
            else:
                raise AssertionError(f"no load took the lock: {store.get(lock_key)!r}")
            gw.kill()
            request.join(timeout=10)
            replicas["r0"].faults(hang=False)
            assert store.pttl(lock_key) > 60_000  # the dead gateway's lock, far from lapsing
            started = time.monotonic()
            gw.start(timeout_s=30)  # raises if not ready by then
            ready_after = time.monotonic() - started
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key=api_key("t0"), max_retries=0, timeout=30)
            answer = client.completions.create(model=MODELS["t0"], prompt="back", max_tokens=2)
        finally:
            gw.stop()
            store.close()
    assert answer.choices, answer
    assert ready_after < 30
