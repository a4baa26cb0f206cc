"""POST /admin/reload through one gateway reloads every gateway sharing the Redis, and answers with each one's
outcome and the digest of the config file it now runs. Two `tenantgate serve` processes, a real redis-server of
the test's own (no other test's gateways in its heartbeat set), a simulated replica."""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from loadtests.faultkit import GatewayUnderTest
from loadtests.fleet import api_key, gateway_config
from loadtests.processes import free_port
from tests.redis_server import RedisServer
from tests.servers import EngineProcess

pytestmark = pytest.mark.timeout(180)


def _config(sim: EngineProcess, redis_url: str, port: int, tenants: dict[str, list[str]]) -> dict[str, Any]:
    adapters = {"a1": sim.adapters["a1"]}
    return gateway_config({"r0": sim.url}, tenants, adapters, port=port, extra={"state": {"redis_url": redis_url}})


@contextlib.contextmanager
def two_gateways(tmp_path: Path, sim: EngineProcess) -> Iterator[tuple[list[GatewayUnderTest], list[int], str]]:
    with RedisServer(log_path=tmp_path / "redis.log") as server:
        ports = [free_port(), free_port()]
        gateways = [
            GatewayUnderTest(tmp_path, _config(sim, server.url, port, {"acme": ["a1"]}), name=f"g{i}")
            for i, port in enumerate(ports)
        ]
        try:
            for gateway in gateways:
                gateway.start(timeout_s=60)
            members = redis.Redis.from_url(server.url)
            deadline = time.monotonic() + 20
            while members.zcard("tg:gateways") < 2:  # each has sent its first heartbeat
                assert time.monotonic() < deadline, "the gateways never joined"
                time.sleep(0.05)
            members.close()
            yield gateways, ports, server.url
        finally:
            for gateway in gateways:
                gateway.stop()


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_reload_through_one_gateway_reloads_every_gateway(sim_engine: EngineProcess, tmp_path: Path) -> None:
    with two_gateways(tmp_path, sim_engine) as (gateways, ports, redis_url):
        first, second = gateways
        assert second.admin("GET", "/admin/route?tenant=newco").status_code == 400  # an unknown tenant
        # The ConfigMap changes in every pod: a tenant more.
        for gateway, port in zip(gateways, ports, strict=True):
            gateway.write_config(_config(sim_engine, redis_url, port, {"acme": ["a1"], "newco": ["a1"]}))
        answer = first.admin("POST", "/admin/reload").json()
        assert answer["status"] == "reloaded" and answer["missing"] == []
        outcomes = {a["gateway"]: (a["status"], a["config_digest"]) for a in answer["gateways"]}
        assert sorted(outcomes.values()) == sorted(("reloaded", _digest(g.config_path)) for g in gateways)
        assert answer["gateway"] in outcomes and len(outcomes) == 2
        # The other gateway serves the new tenant without anyone having asked it.
        assert second.admin("GET", "/admin/route?tenant=newco").status_code == 200
        completion = {"model": "a1", "prompt": "x", "max_tokens": 2}
        headers = {"Authorization": f"Bearer {api_key('newco')}"}
        assert (
            httpx.post(second.url + "/v1/completions", json=completion, headers=headers, timeout=30).status_code == 200
        )


def test_a_peer_that_refuses_says_so_and_scope_local_reloads_one(sim_engine: EngineProcess, tmp_path: Path) -> None:
    with two_gateways(tmp_path, sim_engine) as (gateways, _, _):
        first, second = gateways
        second.config_path.write_text("pools: [")  # this pod's copy is broken
        answer = first.admin("POST", "/admin/reload").json()
        statuses = {a["gateway"] == answer["gateway"]: a["status"] for a in answer["gateways"]}
        assert statuses == {True: "reloaded", False: "refused"}, answer
        [refused] = [a for a in answer["gateways"] if a["status"] == "refused"]
        assert "not valid YAML" in refused["error"]
        local = first.admin("POST", "/admin/reload?scope=local").json()
        assert local["status"] == "reloaded" and "gateways" not in local
