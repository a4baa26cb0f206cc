"""Homes from traffic end to end: two `tenantgate serve` processes sharing a real redis-server, four simulated
replicas. The first gateway serves two heavy tenants that count-balanced homes put on one replica; it leads,
moves one of them (its adapter warmed at the new home first) and publishes the table. The second, started once
the first has published, routes every key by the same homes after one interval; both export the version."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import GatewayConfig
from gateway.fleet.fleet import Fleet
from loadtests.fleet import ADMIN_TOKEN, api_key, gateway_config, gateway_process, simulated_replicas, write_adapters
from loadtests.processes import free_port
from tests.redis_server import RedisServer

pytestmark = pytest.mark.timeout(180)

TENANTS = {f"t{i}": [f"a{i}"] for i in range(8)}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def placement(url: str) -> dict[str, Any]:
    answer: dict[str, Any] = httpx.get(url + "/admin/placement", headers=ADMIN).json()
    return answer


def replica_sets(answer: dict[str, Any]) -> dict[str, list[str]]:
    return {key: entry["replicas"] for key, entry in answer["pools"]["llama"].items()}


def version_metric(url: str) -> float:
    text = httpx.get(url + "/metrics", headers=ADMIN).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tenantgate_placement_version":
                return sample.value
    return -1.0


async def colliding_pair(config: dict[str, Any]) -> list[str]:
    """Two tenants whose count-balanced homes are the same replica (the fleet is built, never started)."""
    fleet = Fleet(GatewayConfig.model_validate(config))
    try:
        ring = fleet.pools["llama"].ring
        by_home: dict[str, list[str]] = {}
        for tenant in sorted(TENANTS):
            by_home.setdefault(ring.home(tenant), []).append(tenant)
        return next(tenants for tenants in by_home.values() if len(tenants) >= 2)[:2]
    finally:
        await fleet.close()


def test_two_gateways_started_apart_route_by_the_same_homes(tmp_path: Path, redis_server: RedisServer) -> None:
    adapters = write_adapters(tmp_path, [name for names in TENANTS.values() for name in names])
    extra = {
        "state": {"redis_url": redis_server.url, "operation_timeout_s": 5},
        "traffic": {"interval_s": 0.2, "window_s": 1.0},
        # No noise margin (placement.sigmas): the two tenants' rate is what one sequential client reaches, and
        # moving one off the pair's replica must take r off a peak of 2r by more than 3 sqrt(r) (three sigmas of
        # a 1 s window), which needs r > 9 req/s each: on a busy machine the leader made no move in 400 rounds.
        # What this test checks is the gateways' agreement, not the margin (test_plan's).
        "placement": {"interval_s": 0.3, "grow_above": 100.0, "shrink_below": 50.0, "sigmas": 0.0},
    }
    with simulated_replicas(tmp_path, 4, "--time-scale", "0.01") as urls:
        configs = [
            gateway_config(urls, TENANTS, adapters, port=free_port(), max_adapters=4, extra=extra) for _ in range(2)
        ]
        for config in configs:
            config["routing"]["home_placement"] = "traffic"
        heavy = asyncio.run(colliding_pair(configs[0]))
        with gateway_process(tmp_path, configs[0], "gw-a") as (gw_a, _):
            first = placement(gw_a)
            assert first["pools"]["llama"][heavy[0]]["replicas"] == first["pools"]["llama"][heavy[1]]["replicas"]
            clients = {
                t: openai.OpenAI(base_url=gw_a + "/v1", api_key=api_key(t), max_retries=0, timeout=30) for t in heavy
            }
            answer = first
            for i in range(400):  # bounded: a few traffic and placement intervals
                for tenant, client in clients.items():
                    client.completions.create(model=TENANTS[tenant][0], prompt=f"q{i}", max_tokens=2)
                answer = placement(gw_a)
                homes = replica_sets(answer)
                warming = any(entry["warming"] for entry in answer["pools"]["llama"].values())
                if homes[heavy[0]][0] != homes[heavy[1]][0] and not warming:
                    break
            assert answer["leads"] and answer["version"] >= 1
            moved = next(t for t in heavy if answer["pools"]["llama"][t]["why"].startswith("balance:"))
            assert replica_sets(answer)[heavy[0]][0] != replica_sets(answer)[heavy[1]][0], answer
            with gateway_process(tmp_path, configs[1], "gw-b") as (gw_b, _):
                seen: dict[str, Any] = {}
                for _ in range(300):  # bounded: the second gateway polls once per 0.3 s interval
                    seen = {url: placement(url) for url in (gw_a, gw_b)}
                    if seen[gw_a]["version"] == seen[gw_b]["version"]:
                        break
                    time.sleep(0.1)
                a, b = seen[gw_a], seen[gw_b]
                assert a["version"] == b["version"] >= 1 and not b["leads"]
                assert replica_sets(a) == replica_sets(b)
                assert b["pools"]["llama"][moved]["why"] == a["pools"]["llama"][moved]["why"]
                assert version_metric(gw_b) == b["version"]
                route = httpx.get(gw_b + "/admin/route", params={"tenant": moved}, headers=ADMIN).json()
                assert route["placement"]["replicas"] == replica_sets(a)[moved]
                assert route["home"] == replica_sets(a)[moved][0]
                state = httpx.get(gw_b + "/admin/state", headers=ADMIN).json()
                [row] = [t for t in state["pools"]["llama"]["tenants"] if t["id"] == moved]
                assert row["placement"]["replicas"] == replica_sets(a)[moved] and row["placement"]["why"] != "balanced"
                # Operators, through the gateway that does not lead: a pin brings the moved tenant back where it
                # collides (pins win), then a freeze holds the table; bad bodies are 400s.
                origin = first["pools"]["llama"][moved]["replicas"][0]
                pins = f"{gw_b}/admin/placement/pins/llama/{moved}"
                refused = httpx.put(pins, json={"replica": "r9"}, headers=ADMIN)
                assert refused.status_code == 400 and refused.json()["error"]["param"] == "replica"
                assert httpx.put(pins, json={"replica": origin}, headers=ADMIN).json()["pinned_to"] == origin
                assert origin != replica_sets(a)[moved][0]
                pinned = until(gw_a, lambda p: p["pools"]["llama"][moved]["replicas"] == [origin])
                assert pinned["pools"]["llama"][moved]["why"] == f"pinned to {origin}"
                assert pinned["pins"]["llama"] == {moved: origin}
                freeze = f"{gw_b}/admin/placement/freeze"
                assert httpx.post(freeze, json={"frozen": "yes"}, headers=ADMIN).status_code == 400
                assert httpx.post(freeze, json={"frozen": True}, headers=ADMIN).json() == {"frozen": True}
                until(gw_a, lambda p: bool(p["frozen"]))
                assert httpx.delete(pins, headers=ADMIN).json()["pinned_to"] is None  # pins apply while frozen:
                unpinned = until(gw_a, lambda p: p["pools"]["llama"][moved]["why"] != f"pinned to {origin}")
                assert unpinned["pools"]["llama"][moved]["replicas"] == [origin]  # unpinned, it stays put
                frozen_at = placement(gw_a)["version"]
                for i in range(5):  # traffic goes on across intervals; the frozen table does not move
                    for tenant, client in clients.items():
                        client.completions.create(model=TENANTS[tenant][0], prompt=f"f{i}", max_tokens=2)
                    time.sleep(0.3)
                assert placement(gw_a)["version"] == frozen_at


def until(url: str, condition: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The gateway's placement once ``condition`` holds (bounded: 30 s, many 0.3 s intervals on a busy machine)."""
    answer = placement(url)
    for _ in range(300):
        if condition(answer):
            return answer
        time.sleep(0.1)
        answer = placement(url)
    raise AssertionError(f"not reached: {answer}")
