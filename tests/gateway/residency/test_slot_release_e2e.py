"""A slot one gateway frees ends another gateway's wait for it at once: two `tenantgate serve` processes sharing a
real redis-server, one simulated Triton replica whose PEFT cache holds one adapter (TensorRT-LLM refuses a load
into a full cache, so the gateways wait for a slot), the `openai` SDK as the client.

The in-use window is 10 s (a use flush every 2.5 s) and the slot wait 3 s: without the release through Redis,
gateway B sees the slot A's request held as free only when A's use mark leaves the window, and its wait gives up
first (503). What happened is read from the engine's own counters and the gateways' metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from backends.lora_weights import task_id
from loadtests.fleet import (
    ADMIN_TOKEN,
    api_key,
    gateway_config,
    gateway_process,
    sim_stats,
    simulated_triton_replicas,
    triton_pool,
)
from loadtests.peft_files import write_peft_adapter
from loadtests.processes import free_port
from tests.redis_server import RedisServer

pytestmark = pytest.mark.timeout(180)

MODEL, BASE = "tensorrt_llm_bls", "trt-base"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
ONE_SLOT = ("--time-scale", "0.01", "--max-loras", "1", "--max-cpu-loras", "1")
RESIDENCY = {"use_flush_interval_s": 2.5, "slot_wait_timeout_s": 3.0, "fill_free_slots": False}


@contextlib.contextmanager
def two_gateways_on_one_triton_slot(root: Path, redis_url: str) -> Iterator[tuple[str, list[str], dict[str, str]]]:
    """Gateways A and B (tenant ta calls adapter x, tb calls y) over one Triton replica with one adapter slot;
    yields the replica's HTTP URL, the gateways' URLs and the adapters' sources."""
    adapters = {name: str(write_peft_adapter(root / name, 8, seed=i)) for i, name in enumerate(("x", "y"))}
    with simulated_triton_replicas(root, 1, MODEL, *ONE_SLOT) as replicas, contextlib.ExitStack() as stack:
        gateways = []
        for name in ("gw-a", "gw-b"):
            extra = {"state": {"redis_url": redis_url, "operation_timeout_s": 5}, "residency": RESIDENCY}
            config: dict[str, Any] = gateway_config({}, {"ta": ["x"], "tb": ["y"]}, {}, port=free_port(), extra=extra)
            config["pools"] = [{**triton_pool(replicas, MODEL, BASE), "max_adapters": 1}]
            config["adapters"] = [{"name": n, "pool": "trt", "source": source} for n, source in adapters.items()]
            for tenant in config["tenants"]:
                tenant["base_models"] = [BASE]
            url, _ = stack.enter_context(gateway_process(root, config, name))
            gateways.append(url)
        yield replicas[0]["url"], gateways, adapters


def metric(text: str, name: str, labels: str = "") -> float:
    found = re.findall(rf"^{name}{re.escape(labels)} (\S+)$", text, re.MULTILINE)
    return sum(float(value) for value in found)


async def until(http: httpx.AsyncClient, url: str, what: str, check: Any) -> None:
    for _ in range(3_000):  # a bounded poll, about 30 s
        if check((await http.get(url, headers=ADMIN)).json() if url.endswith("stats") else
                 (await http.get(url, headers=ADMIN)).text):  # fmt: skip
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"never: {what}")


def test_a_wait_on_one_gateway_ends_when_another_gateways_request_frees_the_slot(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    with two_gateways_on_one_triton_slot(tmp_path, redis_server.url) as (replica, (a, b), adapters):
        ta = openai.OpenAI(base_url=a + "/v1", api_key=api_key("ta"), max_retries=0, timeout=30)
        tb = openai.AsyncOpenAI(base_url=b + "/v1", api_key=api_key("tb"), max_retries=0, timeout=30)
        assert ta.completions.create(model="x", prompt="load x", max_tokens=2).choices  # x takes the one slot

        async def scenario() -> float:
            async with httpx.AsyncClient(timeout=30) as http:
                # Paused, the engine admits A's request (x in flight: its slot busy) and generates nothing.
                await http.post(replica + "/sim/control", json={"paused": True})
                holding = asyncio.create_task(
                    asyncio.to_thread(ta.completions.create, model="x", prompt="hold the slot", max_tokens=2)
                )
                x = str(task_id("x", adapters["x"]))
                await until(http, replica + "/sim/stats", "x in flight", lambda s: x in s["peft_cache"]["in_flight"])
                waiting = asyncio.create_task(tb.completions.create(model="y", prompt="wait for it", max_tokens=2))
                waiters = 'tenantgate_adapter_slot_waiters{pool="trt",replica="t0"}'
                await until(http, b + "/metrics", "B waits for a slot", lambda t: metric(t, waiters) == 1)
                freed_at = time.monotonic()
                await http.post(replica + "/sim/control", json={"paused": False})  # A's request ends
                assert (await holding).choices
                answer = await waiting  # 503 at the 3 s timeout without the release (the mark is in its 10 s window)
                assert answer.choices[0].text
                return time.monotonic() - freed_at

        served_after_s = asyncio.run(scenario())
        print(f"B served {served_after_s * 1000:.0f} ms after A's request was let go")
        stats = sim_stats(replica)
        assert stats["cache_full_errors"] == {}  # the gateways never sent the engine a load it had no room for
        metrics = {url: httpx.get(url + "/metrics", headers=ADMIN).text for url in (a, b)}
        releases = "tenantgate_adapter_slot_releases_total"
        assert metric(metrics[a], releases, '{direction="published",pool="trt"}') >= 1
        assert metric(metrics[b], releases, '{direction="received",pool="trt"}') >= 1
        assert metric(metrics[b], "tenantgate_adapter_slot_signal_up") == 1
        refused = '{outcome="refused",pool="trt",replica="t0"}'
        assert metric(metrics[b], "tenantgate_adapter_slot_waits_total", refused) == 0
