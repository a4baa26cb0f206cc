"""Faults a tenant causes must not eject replicas; a broken replica is still ejected, even when it serves one tenant
(gateway/fleet/outlier.py's rule), against simulated replicas through the openai SDK and a gateway process."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from loadtests.faultkit import GatewayUnderTest, SimReplica, sim_replicas
from loadtests.fleet import api_key, gateway_config, write_adapters
from loadtests.processes import free_port

pytestmark = pytest.mark.timeout(180)

SIM = ["--time-scale", "0.1", "--max-loras", "4", "--max-cpu-loras", "8"]
TENANTS = {"noisy": ["lora-noisy"], "quiet": ["lora-quiet"]}
MARKER = "tg-poison-7f3a"  # the simulators answer 500 to a request holding it (loadtests/sim/faults.py)


def config_for(root: Path, replicas: dict[str, SimReplica], tenants: dict[str, list[str]] = TENANTS) -> dict[str, Any]:
    adapters = write_adapters(root, sorted({a for names in tenants.values() for a in names}))
    urls = {name: replica.url for name, replica in replicas.items()}
    config = gateway_config(urls, tenants, adapters, port=free_port(), max_adapters=8)
    # The issue's repro: a 2 s pool timeout, five failures in a row eject. The engines' metrics are scraped often
    # and a stall is 1 s without a token, so the stall rule is live (and must not be fooled by long generations).
    config["pools"][0].update(
        {"slow_start_s": 0, "request_timeout_s": 2.0, "outlier": {"consecutive_failures": 5, "stall_after_s": 1.0}}
    )
    config["telemetry"] = {"engine_scrape_interval_s": 0.25}
    return config


@contextlib.contextmanager
def gateway(root: Path, config: dict[str, Any]) -> Iterator[GatewayUnderTest]:
    process = GatewayUnderTest(root, config)
    process.start()
    try:
        yield process
    finally:
        process.stop()


def replicas_state(gw: GatewayUnderTest) -> dict[str, dict[str, Any]]:
    state: dict[str, dict[str, Any]] = gw.admin("GET", "/admin/residency").json()["pools"]["llama"]["replicas"]
    return state


def statuses(gw: GatewayUnderTest, tenant: str, count: int, **request: Any) -> list[int]:
    """Send ``count`` completions at once as ``tenant``; each one's HTTP status."""

    async def one(client: openai.AsyncOpenAI) -> int:
        try:
            await client.completions.create(model=TENANTS[tenant][0], **request)
        except openai.APIStatusError as exc:
            return exc.status_code
        return 200

    async def all_at_once() -> list[int]:
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=api_key(tenant), max_retries=0, timeout=30)
        async with client:
            return list(await asyncio.gather(*(one(client) for _ in range(count))))

    return asyncio.run(all_at_once())


def test_long_generations_past_the_pool_timeout_and_prompts_that_break_the_engine_eject_nothing(
    tmp_path: Path,
) -> None:
    """The issue's two repros, each twice over the ejection threshold: 5 concurrent generations of 4,000 tokens
    past a 2 s pool timeout (504), then 5 prompts that make every engine answer 500 (502)."""
    with sim_replicas(tmp_path, 2, *SIM) as replicas, gateway(tmp_path, config_for(tmp_path, replicas)) as gw:
        for replica in replicas.values():
            replica.faults(failing_marker=MARKER)
        long = {"prompt": "tell me everything", "max_tokens": 4000, "extra_body": {"ignore_eos": True}}
        for _ in range(2):
            assert statuses(gw, "noisy", 5, **long) == [504] * 5
        for _ in range(2):
            assert statuses(gw, "noisy", 5, prompt=f"{MARKER} please", max_tokens=4) == [502] * 5
        state = replicas_state(gw)
        assert [(s["ejected"], s["ejections"], s["healthy"]) for s in state.values()] == [(False, 0, True)] * 2
        assert statuses(gw, "quiet", 3, prompt="hello", max_tokens=4) == [200] * 3


def test_a_broken_replica_serving_one_tenant_is_still_ejected(tmp_path: Path) -> None:
    """Tenant affinity: the replica serves one tenant, so failures never span two tenants. Its 500s succeed on the
    other replica (dispatch retries them once), and that evidence ejects it; the tenant saw no error."""
    tenants = {"noisy": ["lora-noisy"]}
    with sim_replicas(tmp_path, 2, *SIM) as replicas, gateway(tmp_path, config_for(tmp_path, replicas, tenants)) as gw:
        home = gw.home_of("noisy")
        replicas[home].faults(error_status=500)
        for _ in range(5):
            assert statuses(gw, "noisy", 1, prompt="hello", max_tokens=4) == [200]
        state = replicas_state(gw)[home]
        assert (state["ejected"], state["ejection_reason"]) == (True, "failed_here_only"), state
