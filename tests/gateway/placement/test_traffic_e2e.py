"""Traffic per key end to end: two `tenantgate serve` processes sharing a real redis-server, one simulated replica.
Each gateway serves one tenant; after an interval or two both export the fleet's figure, both tenants in it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtests.fleet import ADMIN_TOKEN, api_key, gateway_config, gateway_process, simulated_replicas, write_adapters
from loadtests.processes import free_port
from tests.redis_server import RedisServer

pytestmark = pytest.mark.timeout(120)

TENANTS = {"acme": ["support-acme"], "globex": ["sql-globex"]}


def key_rates(gateway_url: str) -> dict[str, float]:
    """tenantgate_traffic_key_requests_per_second by key, and the gateways the last merge summed (as "gateways")."""
    text = httpx.get(gateway_url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).text
    rates: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tenantgate_traffic_key_requests_per_second":
                rates[sample.labels["key"]] = sample.value
            elif sample.name == "tenantgate_traffic_gateways":
                rates["gateways"] = sample.value
    return rates


def test_two_gateways_export_the_fleets_traffic_per_key(tmp_path: Path, redis_server: RedisServer) -> None:
    adapters = write_adapters(tmp_path, ["support-acme", "sql-globex"])
    extra = {
        "state": {"redis_url": redis_server.url, "operation_timeout_s": 5},
        "traffic": {"interval_s": 0.2, "window_s": 2.0},
    }
    with simulated_replicas(tmp_path, 1, "--time-scale", "0.01") as urls:
        configs = [gateway_config(urls, TENANTS, adapters, port=free_port(), extra=extra) for _ in range(2)]
        with (
            gateway_process(tmp_path, configs[0], "gw-a") as (gw_a, _),
            gateway_process(tmp_path, configs[1], "gw-b") as (gw_b, _),
        ):
            for url, tenant in ((gw_a, "acme"), (gw_b, "globex")):
                client = openai.OpenAI(base_url=url + "/v1", api_key=api_key(tenant), max_retries=0, timeout=30)
                for i in range(10):
                    client.completions.create(model=TENANTS[tenant][0], prompt=f"q{i}", max_tokens=2)
            seen = {}
            for _ in range(100):  # bounded: a few intervals of 0.2 s for both to fold and swap
                seen = {url: key_rates(url) for url in (gw_a, gw_b)}
                if all(
                    r.get("gateways") == 2 and r.get("acme", 0) > 0 and r.get("globex", 0) > 0 for r in seen.values()
                ):
                    break
                time.sleep(0.1)
    for rates in seen.values():  # each gateway served one tenant, and each sees both: the fleet's figure
        assert rates.get("gateways") == 2 and rates.get("acme", 0) > 0 and rates.get("globex", 0) > 0, seen


def spill_rates(gateway_url: str) -> dict[str, float]:
    text = httpx.get(gateway_url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).text
    return {
        sample.labels["key"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "tenantgate_traffic_key_spills_per_second"
    }


def test_requests_sent_off_a_keys_set_for_demand_are_counted_as_its_spills(tmp_path: Path) -> None:
    """Bounded loads with no slack (balance_factor 1, capacity_floor 1): acme's concurrent requests overflow its
    home (spill:over_capacity) onto the other replica, outside its set; globex, one request at a time, never does."""
    adapters = write_adapters(tmp_path, ["support-acme", "sql-globex"])
    extra = {"traffic": {"interval_s": 0.2, "window_s": 2.0}}
    with simulated_replicas(tmp_path, 2, "--time-scale", "0.2") as urls:
        config = gateway_config(urls, TENANTS, adapters, port=free_port(), policy="bounded_consistent_hash",
                                balance_factor=1.0, extra=extra)  # fmt: skip
        config["routing"]["capacity_floor"] = 1
        with gateway_process(tmp_path, config, "gw") as (url, _):
            acme = openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key("acme"), max_retries=0, timeout=30)
            globex = openai.OpenAI(base_url=url + "/v1", api_key=api_key("globex"), max_retries=0, timeout=30)

            async def burst() -> None:
                calls = [acme.completions.create(model="support-acme", prompt=f"b{i}", max_tokens=8) for i in range(8)]
                await asyncio.gather(*calls)
                await acme.close()

            asyncio.run(burst())
            for i in range(4):
                globex.completions.create(model="sql-globex", prompt=f"q{i}", max_tokens=2)
            spills: dict[str, float] = {}
            for _ in range(100):  # bounded: a few intervals of 0.2 s to fold
                spills = spill_rates(url)
                if spills.get("acme", 0) > 0 and "globex" in spills:
                    break
                time.sleep(0.1)
    assert spills.get("acme", 0) > 0 and spills.get("globex") == 0, spills
